#!/usr/bin/env bash
# stop 45, call 4 (a fresh machine start; same wheel and bundle c14 as calls 1-3): the default grid again (v33b), then
# the sustained grid again (v33s2, LAYER_SETTLE=0.5): do the sustained figures repeat across machine starts?
set -uo pipefail
start=$SECONDS
v=/tmp/v4; mkdir -p $v
mkdir -p .kernels && [ -d .kernels/c14 ] || tar xJf .kpack/c14.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c14 LAYER_TAG=v33b- LANE0="layer-full" timeout 280 bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/v4.tgz -C /tmp v4
OUT=$v KERNELS=.kernels/c14 LAYER_TAG=v33s2- LAYER_SETTLE=0.5 LANE0="layer-full" timeout $((585 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/v4.tgz -C /tmp v4
echo "=== done $((SECONDS - start)) s"
