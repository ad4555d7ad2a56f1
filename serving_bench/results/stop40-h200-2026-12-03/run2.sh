#!/usr/bin/env bash
# stop 40, call 2: every GPU test (tests/ -m gpu) on bundle c10 (kernels from the current code), the suite of record
# for this stop.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
mkdir -p .kernels && tar xJf .kpack/c10.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c10 ALL_TESTS_LIMIT=${ALL_TESTS_LIMIT:-520} LANE0="all-tests" bash serving_bench/device_validate.sh
tail -40 $v/all-tests.txt | grep -E "FAILED|ERROR|passed|failed" | cut -c1-220
pack
echo "=== done $((SECONDS - start)) s"
