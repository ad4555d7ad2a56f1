#!/usr/bin/env bash
# stop 41, call 4: the full layer grid on this stop's final code (bundle c12: every kernel rebuilt from it; defaults
# unchanged, the programmatic launches not taken), run v30.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c12 LAYER_TAG=v30- LANE0="layer-full" timeout 420 bash serving_bench/device_validate.sh
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; wc -l < $v/kernel-requests.jsonl; }
echo "=== done $((SECONDS - start)) s"
