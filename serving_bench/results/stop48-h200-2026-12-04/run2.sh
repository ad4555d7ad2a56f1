#!/usr/bin/env bash
# stop 48, call 2: the layer under the old code (stop 47's wheel, bundle c15) and the new (this stop's wheel, c16),
# old / new / old on one machine, decode and prefill cells; each case settles 0.5 s first.
set -uo pipefail
start=$SECONDS
v=/tmp/v2; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } && \
    { [ -d .kernels/c15 ] || tar xJf .kpack/c15.tar.xz -C .kernels; } || exit 1
OUT=$v KERNELS=.kernels/c16 AB_OLD_WHEEL=.whl/old AB_OLD_KERNELS=.kernels/c15 \
    AB_MODELS=${AB_MODELS:-qwen3-30b-a3b,gpt-oss-120b,deepseek-v3} AB_TOKENS=${AB_TOKENS:-1,8,64,2048,8192} \
    LANE0="layer-ab" timeout $((580 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===|geomean" | cut -c1-200
tar czf $OUT/v2.tgz -C /tmp v2
echo "=== done $((SECONDS - start)) s"
