#!/usr/bin/env bash
# stop 46, call 2 (bundle c15: stop 43's kernels rebuilt from this checkout; wheel of this stop's code):
# grid v34s: as v34, under sustained load (each case replays untimed for 0.5 s before its samples).
set -uo pipefail
start=$SECONDS
v=/tmp/v2; mkdir -p $v
pack() { tar czf $OUT/v2.tgz -C /tmp v2; }
mkdir -p .kernels && tar xJf .kpack/c15.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c15 LAYER_TAG=v34s- LAYER_SETTLE=0.5 LANE0="layer-full" timeout $((585 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===|auto|worst" | cut -c1-160
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
