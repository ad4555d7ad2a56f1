#!/usr/bin/env bash
# stop 42, call 5: the full layer grid on this stop's final wheel (bundle c12: stop 41's kernels, no kernel, key or
# default changed; prepare_device and the adapters are the only code the layer runs differently), run v31: a regression
# check and one more sample of the run-to-run spread.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c12 LAYER_TAG=v31- LANE0="layer-full" timeout 400 bash serving_bench/device_validate.sh
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; wc -l < $v/kernel-requests.jsonl; }
echo "=== done $((SECONDS - start)) s"
