#!/usr/bin/env bash
# stop 53, call 1: the changes of stops 51-53 on the GPU (nothing of them has run on one). First the bundle's
# provenance (`aot check`: every kernel of c20 built from the wheel's kernel sources), then every GPU test (stop 51's
# Triton clamp / DYNAMIC reset / router NaN group score and tightened tests; stop 52's benchmark checks: every rotated
# input, each rotation's timed graph, the per-row bound, interleaved rotations; stop 53's operand-overlap checks and
# bench fixes), then the router's CPU-tier file
# compiled on the GPU. Logs go straight to $OUT, so a call cut at its limit still returns them.
set -uo pipefail
start=$SECONDS
mkdir -p .kernels && { [ -d .kernels/c20 ] || tar xJf .kpack/c20.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c20 MOE2CTA_KERNEL_REQUESTS=$OUT/kernel-requests.jsonl
export PYTHONUNBUFFERED=1
repo=$PWD
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
(cd /tmp && python3 -m moe2cta aot check "$repo/.kernels/c20" > $OUT/aot-check.txt 2>&1; echo "=== aot check rc=$?"; tail -3 $OUT/aot-check.txt | cut -c1-250)
cd /tmp
timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests" > $OUT/all-tests.txt 2>&1
echo "=== all gpu tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|SKIPPED|passed|failed" $OUT/all-tests.txt | tail -16 | cut -c1-300
left=$((590 - SECONDS))
timeout $left python3 -m pytest -q -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_router_triton.py" > $OUT/router-compiled.txt 2>&1
echo "=== router tier compiled rc=$? $((SECONDS - start)) s (limit $left)"; grep -E "FAILED|ERROR|passed|failed" $OUT/router-compiled.txt | tail -8 | cut -c1-300
[ -f $OUT/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $OUT/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
