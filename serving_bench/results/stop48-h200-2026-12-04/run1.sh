#!/usr/bin/env bash
# stop 48, call 1: every GPU test on this stop's wheel and bundle c16 (stop 43's kernels rebuilt with the grid as a
# launch argument, ENTRY_ABI 2), one pytest run.
set -uo pipefail
start=$SECONDS
v=/tmp/v1; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
OUT=$v KERNELS=.kernels/c16 ALL_TESTS_LIMIT=${LIMIT:-570} LANE0="all-tests" bash serving_bench/device_validate.sh > /dev/null 2>&1
echo "=== all-tests $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/all-tests.txt | tail -14 | cut -c1-250
tar czf $OUT/v1.tgz -C /tmp v1
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
