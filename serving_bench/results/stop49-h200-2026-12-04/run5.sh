#!/usr/bin/env bash
# stop 49, call 5: every GPU test on this stop's wheel (the eager host path trimmed) and bundle c16, one pytest run.
set -uo pipefail
start=$SECONDS
v=/tmp/v5; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
OUT=$v KERNELS=.kernels/c16 ALL_TESTS_LIMIT=${LIMIT:-570} LANE0="all-tests" bash serving_bench/device_validate.sh > /dev/null 2>&1
echo "=== all-tests $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/all-tests.txt | tail -14 | cut -c1-250
tar czf $OUT/v5.tgz -C /tmp v5
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
