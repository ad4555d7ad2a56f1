#!/usr/bin/env bash
# stop 38, call 2: call 1's side map was wrong (its analysis split the SMs by their median latency, which a far-side
# SM reads as near where fewer than half of its lines are far; the upper quartile splits them cleanly, 64 / 68 SMs
# along GPC lines). (1) The probe again on this machine, (2) the regular kernel DYNAMIC against DYNAMIC_SIDES with
# that map and the two controls (zero, random) on the same prefill cells, model routing; (3) ncu of deepseek-v3
# T=8192 (DRAM bytes, L2 hit rate, L2 fabric sectors, clock) for the default and each map.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
mkdir -p /tmp/k && tar xJf .kpack/c5.tar.xz -C /tmp/k
K=/tmp/k/c5
repo=$PWD
cd /tmp || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit,serial --format=csv > $v/gpu.txt
timeout 120 python3 -m moe2cta.serving_bench.l2_sides_probe --out $v/sides.json > $v/probe.txt 2>&1
echo "=== probe rc=$? $((SECONDS - start)) s"; cut -c1-400 $v/probe.txt | head -12
echo "call 1's map: $(python3 -c "import json; print(''.join(map(str, json.load(open('$repo/serving_bench/results/l2-sides-h200-2026-12-03/run1/sides-q75.json'))['side_of_sm'])))")"
pack
maps="probe=$v/sides.json zero random"
for spec in deepseek-v3:8192,32768 qwen3-235b-a22b:8192,32768 gpt-oss-120b:8192,32768 mixtral-8x7b:8192 \
            qwen3-30b-a3b:8192; do
  m=${spec%%:*}; toks=${spec#*:}
  # shellcheck disable=SC2086
  timeout 150 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle c=$K --models $m --tokens ${toks//,/ } \
    --routing model --variants default regular regular_sides --side-maps $maps --json $v/bench-$m.json \
    > $v/bench-$m.txt 2>&1
  echo "=== bench $m rc=$? $((SECONDS - start)) s"
  grep -E " (cute|dense-cublas)" $v/bench-$m.txt | cut -c1-100
  pack
done
timeout 200 ncu --clock-control none --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
lts__t_sector_hit_rate.pct,sm__cycles_elapsed.avg.per_second,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors.sum \
  --kernel-name regex:"Sm90GroupedGemm" python3 -m moe2cta.serving_bench.prefill_gemm_bench --profile --bundle c=$K \
  --models deepseek-v3 --tokens 8192 --routing model --variants default regular_sides --side-maps $maps \
  > $v/ncu-deepseek-8192.txt 2>&1
echo "=== ncu rc=$? $((SECONDS - start)) s"
grep '^"' $v/ncu-deepseek-8192.txt | awk -F'","' '{print $1, $(NF-2), $NF}' | cut -c1-160 | tail -50
pack
echo "=== done $((SECONDS - start)) s"
