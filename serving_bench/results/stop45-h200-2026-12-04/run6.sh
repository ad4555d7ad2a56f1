#!/usr/bin/env bash
# stop 45, call 6: the device step layer-ab with its new settling (AB_SETTLE, default 0.5 s), run as a null A/B: the
# same wheel and bundle c14 as "old" and "new", in the order old, new, old. What it reads is the A/B tool's own noise.
set -uo pipefail
start=$SECONDS
v=/tmp/v6; mkdir -p $v
mkdir -p .kernels && [ -d .kernels/c14 ] || tar xJf .kpack/c14.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c14 AB_OLD_WHEEL=.whl AB_OLD_KERNELS=.kernels/c14 AB_TOKENS=2048,8192 LANE0="layer-ab" \
  timeout 190 bash serving_bench/device_validate.sh 2>&1 | grep -E "^===" | cut -c1-160
tar czf $OUT/v6.tgz -C /tmp v6
echo "=== done $((SECONDS - start)) s"
