#!/usr/bin/env bash
# stop 50, call 5 (bundle c16, the final wheel: the benchmark's checks and time / floor changed, no kernel): the GPU
# tests of the benchmark (timing returns the graphs' outputs; a backend wrong only inside its graph is reported WRONG),
# then grid v41 (model routers; every row checked, the timed replays checked, time / floor per sample) and
# deepseek-v3 under the peer routing (v41p).
set -uo pipefail
start=$SECONDS
v=/tmp/run5; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
repo=$PWD
(source .bundle/rt/activate.sh; export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$repo/.kernels/c16
 cd /tmp && timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs \
    "$repo/tests/test_serving_bench.py" "$repo/tests/test_bench_tools.py" > $v/bench-tests.txt 2>&1
 echo "=== bench-tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/bench-tests.txt | tail -6 | cut -c1-250)
export LAYER_BACKENDS=auto,triton,grouped-mm,dense-ceiling,expert-bmm-ceiling
OUT=$v KERNELS=.kernels/c16 LAYER_TAG=v41- LANE0="layer-full" timeout $((420 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
OUT=$v KERNELS=.kernels/c16 LAYER_TAG=v41p- LAYER_ROUTER=peer LAYER_MODELS=deepseek-v3 LANE0="layer-full" timeout $((480 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/run5.tgz -C /tmp run5
echo "=== done $((SECONDS - start)) s"
