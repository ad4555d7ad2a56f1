#!/usr/bin/env bash
# stop 48, call 4 (bundle c16, this stop's wheel): grid v39 on this machine start (the model routers),
# then deepseek-v3 under the peer figures' routing (softmax -> top-k -> renormalize; the only preset whose own router
# differs), so that the peer routing's grid (v39p: v39's other four models + deepseek-v3 peer) comes from one start.
set -uo pipefail
start=$SECONDS
v=/tmp/v4; mkdir -p $v
mkdir -p .kernels && tar xJf .kpack/c16.tar.xz -C .kernels || exit 1
export LAYER_BACKENDS=auto,triton,grouped-mm,dense-ceiling,expert-bmm-ceiling
OUT=$v KERNELS=.kernels/c16 LAYER_TAG=v39- LANE0="layer-full" timeout $((420 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
OUT=$v KERNELS=.kernels/c16 LAYER_TAG=v39p- LAYER_ROUTER=peer LAYER_MODELS=deepseek-v3 LANE0="layer-full" timeout $((560 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/v4.tgz -C /tmp v4
echo "=== done $((SECONDS - start)) s"
