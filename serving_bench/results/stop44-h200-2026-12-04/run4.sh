#!/usr/bin/env bash
# stop 44, call 4: the 15 GPU tests call 3 skipped for want of a measured L2 side map: this machine's map
# (l2_sides_probe), then the DYNAMIC_SIDES tests' "measured" case with it, on the same wheel and bundle c13.
set -uo pipefail
start=$SECONDS
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c13.tar.xz -C .kernels || exit 1
K=$PWD/.kernels/c13
repo=$PWD
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
cd /tmp || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv > $OUT/gpu.txt
timeout 60 python3 -m moe2cta.serving_bench.l2_sides_probe --out $OUT/sides.json > $OUT/probe.txt 2>&1
echo "=== probe rc=$? $((SECONDS - start)) s"; cut -c1-300 $OUT/probe.txt | head -3
MOE2CTA_KERNEL_DIR=$K MOE2CTA_SIDE_MAP=$OUT/sides.json timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
  --rootdir $repo -rs $repo/tests/test_sm90_gpu.py -k "dynamic_sides_under_any_side_map and measured" > $OUT/sides-tests.txt 2>&1
echo "=== sides-tests rc=$? $((SECONDS - start)) s"; tail -2 $OUT/sides-tests.txt | cut -c1-200
