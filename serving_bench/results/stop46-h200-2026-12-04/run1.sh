#!/usr/bin/env bash
# stop 46, call 1 (bundle c15: stop 43's kernels rebuilt from this checkout; wheel of this stop's code):
# (1) the serving bench's GPU tests (first runs of the clock reading and the dense ceiling);
# (2) grid v34: default sampling (settle 0), with the dense-ceiling backend and each case's SM clock.
set -uo pipefail
start=$SECONDS
v=/tmp/v1; mkdir -p $v
pack() { tar czf $OUT/v1.tgz -C /tmp v1; }
mkdir -p .kernels && tar xJf .kpack/c15.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c15 LANE0="bench-tests" bash serving_bench/device_validate.sh 2>&1 | grep -E "^===|passed|failed|FAILED|Error" | cut -c1-250
pack
OUT=$v KERNELS=.kernels/c15 LAYER_TAG=v34- LANE0="layer-full" timeout $((585 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===|auto|worst" | cut -c1-160
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
