#!/usr/bin/env bash
# stop 40, call 3: (1) this machine's L2 side map (l2_sides_probe), then the DYNAMIC_SIDES tests' "measured" case
# (call 2 skipped those 15 without a map); (2) the full layer grid again on the same machine (run v29b), a repeat of
# call 1's v29 to put a number on run-to-run spread.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c10.tar.xz -C .kernels || exit 1
K=$PWD/.kernels/c10
repo=$PWD
(
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
cd /tmp || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv > $v/gpu3.txt
timeout 60 python3 -m moe2cta.serving_bench.l2_sides_probe --out $v/sides.json > $v/probe.txt 2>&1
echo "=== probe rc=$? $((SECONDS - start)) s"; cut -c1-300 $v/probe.txt | head -3
MOE2CTA_KERNEL_DIR=$K MOE2CTA_SIDE_MAP=$v/sides.json timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
  --rootdir $repo -rs $repo/tests/test_sm90_gpu.py -k "dynamic_sides_under_any_side_map and measured" > $v/sides-tests.txt 2>&1
echo "=== sides-tests rc=$? $((SECONDS - start)) s"; tail -2 $v/sides-tests.txt | cut -c1-200
)
pack
OUT=$v KERNELS=.kernels/c10 LAYER_TAG=v29b- LANE0="layer-full" timeout 300 bash serving_bench/device_validate.sh
pack
echo "=== done $((SECONDS - start)) s"
