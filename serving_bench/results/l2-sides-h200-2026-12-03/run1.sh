#!/usr/bin/env bash
# stop 38, call 1: (1) the L2-side probe (which SMs read through which L2 partition; l2_sides_probe), (2) the GPU
# tests of Scheduler.DYNAMIC_SIDES under several side maps (the probe's among them), (3) the regular kernel DYNAMIC
# against DYNAMIC_SIDES with the probe's map and two controls (zero: the DYNAMIC order through the same kernel;
# random: half the SMs on each side, placed at random) on the prefill cells where the regular kernel runs, model
# routing, interleaved rounds (prefill_gemm_bench).
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
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv > $v/gpu.txt
timeout 120 python3 -m moe2cta.serving_bench.l2_sides_probe --out $v/sides.json > $v/probe.txt 2>&1
echo "=== probe rc=$? $((SECONDS - start)) s"; cut -c1-400 $v/probe.txt | head -12
pack
maps="probe=$v/sides.json zero random"
[ -f $v/sides.json ] || maps="parity zero random"
MOE2CTA_KERNEL_DIR=$K MOE2CTA_SIDE_MAP=$v/sides.json timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
  --rootdir $repo $repo/tests/test_sm90_gpu.py -k "sides" -rs > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; tail -4 $v/tests.txt
pack
for spec in deepseek-v3:8192,32768 qwen3-235b-a22b:8192,32768 gpt-oss-120b:8192,32768 mixtral-8x7b:8192 \
            qwen3-30b-a3b:8192; do
  m=${spec%%:*}; toks=${spec#*:}
  extra=""; [ "$m" = qwen3-30b-a3b ] && extra="token_rows token_rows_sides"
  # shellcheck disable=SC2086
  timeout 150 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle c=$K --models $m --tokens ${toks//,/ } \
    --routing model --variants default regular regular_sides $extra --side-maps $maps --json $v/bench-$m.json \
    > $v/bench-$m.txt 2>&1
  echo "=== bench $m rc=$? $((SECONDS - start)) s"
  grep -E " (cute|dense-cublas)" $v/bench-$m.txt | cut -c1-100
  pack
  [ $((SECONDS - start)) -gt 520 ] && break
done
echo "=== done $((SECONDS - start)) s"
