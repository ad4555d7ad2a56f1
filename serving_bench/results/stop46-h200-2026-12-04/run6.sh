#!/usr/bin/env bash
# stop 46, call 6 (bundle c15, final wheel): grid v36, default sampling, both ceilings beside auto, triton and
# grouped-mm on a third machine start (does the balanced bmm's 1.148x and auto's 1.124x of it repeat?).
set -uo pipefail
start=$SECONDS
v=/tmp/v6; mkdir -p $v
mkdir -p .kernels && tar xJf .kpack/c15.tar.xz -C .kernels || exit 1
export LAYER_BACKENDS=auto,triton,grouped-mm,dense-ceiling,expert-bmm-ceiling
OUT=$v KERNELS=.kernels/c15 LAYER_TAG=v36- LANE0="layer-full" timeout $((270 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/v6.tgz -C /tmp v6
echo "=== done $((SECONDS - start)) s"
