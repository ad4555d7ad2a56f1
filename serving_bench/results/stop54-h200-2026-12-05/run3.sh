#!/usr/bin/env bash
# stop 54, call 3 (NOT RUN: no machine was lent for the rest of the session; ready for the next one): which dtype (int64
# ids or bf16 weights) and which kernel make gpt-oss-120b's token GEMVs slower at T=1 (call 2: +6.5 us at the kernel
# level, reproducible; qwen3-30b-a3b T=4 +2.1 us, T=1 equal; the loop bodies differ only in ptxas's instruction
# order). The token GEMVs' GPU tests with the layer's routing-dtype test first. Next, if the ids are the cause: the
# narrowing-at-load variant of the results README, measured the same way.
set -uo pipefail
start=$SECONDS
source serving_bench/device_setup.sh c20
cd /tmp
timeout 75 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_triton_token_gemv.py" \
  "$repo/tests/test_api.py" -k "test_triton_token_gemv or routing_of_any_dtype" > $OUT/token-gemv-tests.txt 2>&1
echo "=== token gemv gpu tests rc=$? $((SECONDS - start)) s"; tail -1 $OUT/token-gemv-tests.txt | cut -c1-200
timeout 50 python3 "$repo/serving_bench/results/stop54-h200-2026-12-05/gemv_split.py" gpt-oss-120b 1 1 2>&1 \
  | tee $OUT/gemv-split.txt | cut -c1-250
echo "=== done $((SECONDS - start)) s"
