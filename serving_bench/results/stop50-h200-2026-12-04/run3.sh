#!/usr/bin/env bash
# stop 50, call 3 (bundle c16, this stop's wheel; no kernel changed since stop 48): grid v40 on this machine start (the model routers),
# then deepseek-v3 under the peer figures' routing (softmax -> top-k -> renormalize; the only preset whose own router
# differs), so that the peer routing's grid (v40p: v40's other four models + deepseek-v3 peer) comes from one start.
set -uo pipefail
start=$SECONDS
v=/tmp/run3; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
export LAYER_BACKENDS=auto,triton,grouped-mm,dense-ceiling,expert-bmm-ceiling
OUT=$v KERNELS=.kernels/c16 LAYER_TAG=v40- LANE0="layer-full" timeout $((420 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
OUT=$v KERNELS=.kernels/c16 LAYER_TAG=v40p- LAYER_ROUTER=peer LAYER_MODELS=deepseek-v3 LANE0="layer-full" timeout $((560 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/run3.tgz -C /tmp run3
echo "=== done $((SECONDS - start)) s"
