#!/usr/bin/env bash
# stop 37, call 8: the layer's GPU tests on the final code (api.sm90_gather_padding): tests/test_api.py and
# tests/test_graphed.py, every kernel from the bundle (the five presets and serving_bench/gpu-test-kernels.jsonl).
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
mkdir -p .kernels && tar xJf .kpack/c4.tar.xz -C .kernels || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
repo=$PWD
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$repo/.kernels/c4 \
  MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
cd /tmp && timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_api.py" \
  "$repo/tests/test_graphed.py" > $v/gpu-tests.txt 2>&1
echo "gpu-tests rc=$? $((SECONDS - start)) s"; tail -6 $v/gpu-tests.txt
tar czf $OUT/v.tgz -C /tmp v
