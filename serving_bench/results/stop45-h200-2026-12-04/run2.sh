#!/usr/bin/env bash
# stop 45, call 2 (warm from call 1, same wheel and bundle c14): grid v33s, every case replayed untimed for 0.5 s
# before its samples (LAYER_SETTLE, `moe2cta-bench --settle-seconds`), so that every sample sees the sustained,
# power-capped clock.
set -uo pipefail
start=$SECONDS
v=/tmp/v2; mkdir -p $v
mkdir -p .kernels && [ -d .kernels/c14 ] || tar xJf .kpack/c14.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c14 LAYER_TAG=v33s- LAYER_SETTLE=0.5 LANE0="layer-full" timeout 585 bash serving_bench/device_validate.sh 2>&1 | grep -E "^===|auto|worst" | cut -c1-160
tar czf $OUT/v2.tgz -C /tmp v2
echo "=== done $((SECONDS - start)) s"
