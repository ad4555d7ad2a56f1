#!/usr/bin/env bash
# stop 42, call 1: every GPU test on the wheel of the split configuration layer (grouped_gemm/sm90_config.py,
# re-exported by sm90_grouped_gemm.py), bundle c12 (stop 41's kernels; no kernel or key changed since).
set -uo pipefail
start=$SECONDS
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels || exit 1
OUT=$OUT KERNELS=.kernels/c12 ALL_TESTS_LIMIT=420 LANE0="all-tests" bash serving_bench/device_validate.sh > /dev/null 2>&1
echo "=== all-tests $((SECONDS - start)) s"
grep -E "FAILED|ERROR|passed|failed" $OUT/all-tests.txt | tail -15 | cut -c1-220
grep -E "^SKIPPED" $OUT/all-tests.txt | cut -c1-160 | sort | uniq -c | sort -rn | head -8
[ -f $OUT/kernel-requests.jsonl ] && { echo "kernels missing:"; wc -l < $OUT/kernel-requests.jsonl; }
echo "=== done $((SECONDS - start)) s"
