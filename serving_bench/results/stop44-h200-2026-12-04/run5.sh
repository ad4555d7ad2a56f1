#!/usr/bin/env bash
# stop 44, call 5 (as run, on the machine warm from calls 2-4): grid v32b on the final wheel of this stop, bundle c13.
# A first attempt wrote its results straight under $OUT, more files than a call brings back; this packs them.
mkdir -p .kernels && tar xJf .kpack/c13.tar.xz -C .kernels && OUT=/tmp/v KERNELS=.kernels/c13 LAYER_TAG=v32b- LANE0="layer-full" timeout 300 bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" ; tar czf $OUT/v.tgz -C /tmp v
