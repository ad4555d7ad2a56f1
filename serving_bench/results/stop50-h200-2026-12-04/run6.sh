#!/usr/bin/env bash
# stop 50, call 6: the final wheel (rotation 0's graph replayed alone after the rounds, NaN-filled first, for the
# post-timing check: call 5's wheel read it after the other rotations' replays, which share its pool) on the
# benchmark's GPU tests, then the grid's qwen3-30b-a3b and deepseek-v3 rows as a check that no honest cell turns WRONG.
set -uo pipefail
start=$SECONDS
v=/tmp/run6; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
repo=$PWD
(source .bundle/rt/activate.sh; export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$repo/.kernels/c16
 cd /tmp && timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs \
    "$repo/tests/test_serving_bench.py" "$repo/tests/test_bench_tools.py" > $v/bench-tests.txt 2>&1
 echo "=== bench-tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/bench-tests.txt | tail -6 | cut -c1-250)
export LAYER_BACKENDS=auto,triton,grouped-mm
OUT=$v KERNELS=.kernels/c16 LAYER_TAG=check- LAYER_MODELS="qwen3-30b-a3b deepseek-v3" LANE0="layer-full" timeout $((230 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/run6.tgz -C /tmp run6
echo "=== done $((SECONDS - start)) s"
