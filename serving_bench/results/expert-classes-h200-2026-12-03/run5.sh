#!/usr/bin/env bash
# stop 37, call 5: why Raster.EXPERT_TILES is 36% slower than ALONG_N on deepseek-v3 T=32768 GEMM1 while the units in
# flight are the same set (STATIC round-robin): DRAM bytes, L2 hit rate and the L2 fabric traffic between the two
# L2 partitions, one eager call per kernel.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
K=$PWD/.kernels/c4
for t in 32768 8192; do
  (cd /tmp && timeout 200 ncu --clock-control none --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
lts__t_sector_hit_rate.pct,sm__cycles_elapsed.avg.per_second,lts__t_sectors.sum --kernel-name regex:"Sm90Swapped" \
    python3 -m moe2cta.serving_bench.prefill_gemm_bench --profile --bundle "new=$K" --models deepseek-v3 --tokens $t \
    --variants wide288_even wide288_even_expert_tiles --routing model) > $v/ncu-$t.txt 2>&1
  echo "ncu $t rc=$? $((SECONDS - start)) s"
  (cd /tmp && timeout 200 ncu --clock-control none --csv --metrics lts__t_sectors_srcunit_ltcfabric.sum \
    --kernel-name regex:"Sm90Swapped" \
    python3 -m moe2cta.serving_bench.prefill_gemm_bench --profile --bundle "new=$K" --models deepseek-v3 --tokens $t \
    --variants wide288_even wide288_even_expert_tiles --routing model) > $v/ncu-fabric-$t.txt 2>&1
  echo "ncu fabric $t rc=$? $((SECONDS - start)) s"
done
tar czf $OUT/v.tgz -C /tmp v
for f in $v/ncu-*.txt; do echo "## $f"; grep '^"' $f | awk -F'","' '{print $1, $5, $(NF-2), $NF}' | cut -c1-200; done
