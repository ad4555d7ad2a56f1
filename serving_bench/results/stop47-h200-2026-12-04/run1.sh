#!/usr/bin/env bash
# stop 47, call 1 (bundle c15, stop 46's kernels and defaults): grid v37 on this machine start (the model routers),
# then deepseek-v3 under the peer figures' routing (softmax -> top-k -> renormalize; the only preset whose own router
# differs), so that the peer routing's grid (v37p: v37's other four models + deepseek-v3 peer) comes from one start.
set -uo pipefail
start=$SECONDS
v=/tmp/v1; mkdir -p $v
mkdir -p .kernels && tar xJf .kpack/c15.tar.xz -C .kernels || exit 1
export LAYER_BACKENDS=auto,triton,grouped-mm,dense-ceiling,expert-bmm-ceiling
OUT=$v KERNELS=.kernels/c15 LAYER_TAG=v37- LANE0="layer-full" timeout $((420 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
OUT=$v KERNELS=.kernels/c15 LAYER_TAG=v37p- LAYER_ROUTER=peer LAYER_MODELS=deepseek-v3 LANE0="layer-full" timeout $((560 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/v1.tgz -C /tmp v1
echo "=== done $((SECONDS - start)) s"
