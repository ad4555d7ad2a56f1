#!/usr/bin/env bash
# stop 53, call 2: grid v42 on the benchmark of stops 52-53 (floors at the targets' ceilings, 4.24 TB/s and 792 TFLOP/s;
# the card's measured ceilings recorded beside; every rotated input checked before timing and each rotation's timed
# graph after it), model routers, then deepseek-v3 under the peer routing (v42p). No kernel changed since stop 48 (bundle
# c20: stop 48's kernels rebuilt from stop 53's sources): the figures to compare are the restated v37-v41
# (results/restated-floors-2026-12-04).
set -uo pipefail
start=$SECONDS
v=/tmp/run2; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c20 ] || tar xJf .kpack/c20.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
export LAYER_BACKENDS=auto,triton,grouped-mm,dense-ceiling,expert-bmm-ceiling
OUT=$v KERNELS=.kernels/c20 LAYER_TAG=v42- LANE0="layer-full" timeout $((480 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
OUT=$v KERNELS=.kernels/c20 LAYER_TAG=v42p- LAYER_ROUTER=peer LAYER_MODELS=deepseek-v3 LANE0="layer-full" timeout $((560 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/run2.tgz -C /tmp run2
echo "=== done $((SECONDS - start)) s"
