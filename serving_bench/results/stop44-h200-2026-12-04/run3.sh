#!/usr/bin/env bash
# stop 44, call 3: every GPU test on the final wheel of this stop (bundle c13), one pytest run.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
mkdir -p .kernels && tar xJf .kpack/c13.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c13 ALL_TESTS_LIMIT=${LIMIT:-440} LANE0="all-tests" bash serving_bench/device_validate.sh > /dev/null 2>&1
echo "=== all-tests $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/all-tests.txt | tail -12 | cut -c1-250
tar czf $OUT/v.tgz -C /tmp v
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
