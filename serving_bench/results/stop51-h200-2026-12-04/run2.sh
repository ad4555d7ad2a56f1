#!/usr/bin/env bash
# stop 51, call 2: the fixes of three helper audits (router, Triton path, test suite) on the GPU. Every GPU test in one
# run (the Triton gpt-oss activation propagating NaN, the dead DYNAMIC reset removed, the router's NaN group scores;
# the tightened tests: graph replay checks the routing weights, bf16 floors, the sm90 default-config and two-stream
# tests against 2x a bf16 torch run, the measured L2 side map probed in the test), then with the time left the
# router's CPU-tier file, which runs compiled on a GPU and is not marked gpu (strided bias / expert map, int64 ids past
# int32). Logs go straight to $OUT, so a call cut at its limit still returns them.
set -uo pipefail
start=$SECONDS
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16 MOE2CTA_KERNEL_REQUESTS=$OUT/kernel-requests.jsonl
export PYTHONUNBUFFERED=1
repo=$PWD
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
cd /tmp
timeout 530 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests" > $OUT/all-tests.txt 2>&1
echo "=== all gpu tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|SKIPPED|passed|failed" $OUT/all-tests.txt | tail -16 | cut -c1-300
left=$((590 - SECONDS))
timeout $left python3 -m pytest -q -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_router_triton.py" > $OUT/router-compiled.txt 2>&1
echo "=== router tier compiled rc=$? $((SECONDS - start)) s (limit $left)"; grep -E "FAILED|ERROR|passed|failed" $OUT/router-compiled.txt | tail -8 | cut -c1-300
[ -f $OUT/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $OUT/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
