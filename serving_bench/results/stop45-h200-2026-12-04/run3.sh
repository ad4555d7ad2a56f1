#!/usr/bin/env bash
# stop 45, call 3: every GPU test on this stop's wheel and bundle c14 (rebuilt here), one pytest run.
set -uo pipefail
start=$SECONDS
v=/tmp/v3; mkdir -p $v
mkdir -p .kernels && [ -d .kernels/c14 ] || tar xJf .kpack/c14.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c14 ALL_TESTS_LIMIT=${LIMIT:-440} LANE0="all-tests" bash serving_bench/device_validate.sh > /dev/null 2>&1
echo "=== all-tests $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/all-tests.txt | tail -12 | cut -c1-250
tar czf $OUT/v3.tgz -C /tmp v3
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
