#!/usr/bin/env bash
# stop 46, call 4: every GPU test on this stop's wheel (the clock reading and both ceilings) and bundle c15, one run.
set -uo pipefail
start=$SECONDS
v=/tmp/v4; mkdir -p $v
mkdir -p .kernels && [ -d .kernels/c15 ] || tar xJf .kpack/c15.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c15 ALL_TESTS_LIMIT=${LIMIT:-480} LANE0="all-tests" bash serving_bench/device_validate.sh > /dev/null 2>&1
echo "=== all-tests $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/all-tests.txt | tail -12 | cut -c1-250
tar czf $OUT/v4.tgz -C /tmp v4
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
