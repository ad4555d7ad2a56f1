#!/usr/bin/env bash
# stop 46, call 3 (bundle c15; wheel with expert-bmm-ceiling): the serving bench's GPU tests, then grids v35 (default
# sampling) and v35s (settle 0.5 s) with both ceilings beside auto, triton and grouped-mm (cute left out for time).
set -uo pipefail
start=$SECONDS
v=/tmp/v3; mkdir -p $v
pack() { tar czf $OUT/v3.tgz -C /tmp v3; }
mkdir -p .kernels && tar xJf .kpack/c15.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c15 LANE0="bench-tests" bash serving_bench/device_validate.sh 2>&1 | grep -E "^===|passed|failed|FAILED|Error" | cut -c1-250
pack
export LAYER_BACKENDS=auto,triton,grouped-mm,dense-ceiling,expert-bmm-ceiling
OUT=$v KERNELS=.kernels/c15 LAYER_TAG=v35- LANE0="layer-full" timeout $((585 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
pack
OUT=$v KERNELS=.kernels/c15 LAYER_TAG=v35s- LAYER_SETTLE=0.5 LANE0="layer-full" timeout $((585 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
