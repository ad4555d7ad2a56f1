#!/usr/bin/env bash
# stop 54, call 3: after call 2 (gpt-oss-120b's token GEMVs 6.5 us slower at T=1 on int64 ids + bf16 weights; loop
# bodies the same but for ptxas's instruction order) the token GEMVs narrow int64 ids to int32 at their load, so the
# rest of the kernel is the int32 one. Their GPU tests, then per kernel and dtype (gemv_split.py), then the layer
# (topk_inputs_bench).
set -uo pipefail
start=$SECONDS
source serving_bench/device_setup.sh c20
cd /tmp
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_triton_token_gemv.py" \
  "$repo/tests/test_api.py" -k "test_triton_token_gemv or routing_of_any_dtype" > $OUT/token-gemv-tests.txt 2>&1
echo "=== token gemv gpu tests rc=$? $((SECONDS - start)) s"; tail -1 $OUT/token-gemv-tests.txt | cut -c1-200
timeout 60 python3 "$repo/serving_bench/results/stop54-h200-2026-12-05/gemv_split.py" gpt-oss-120b 1 1 2>&1 \
  | tee $OUT/gemv-split.txt | cut -c1-250
echo "=== split $((SECONDS - start)) s"
timeout $((180 - SECONDS + start)) python3 -m moe2cta.serving_bench.topk_inputs_bench --models gpt-oss-120b qwen3-30b-a3b \
  --tokens 1 4 --seconds 0.5 --json $OUT/topk-inputs3.json --md $OUT/topk-inputs3.md 2>&1 | tee $OUT/topk-inputs3.txt | cut -c1-250
echo "=== done $((SECONDS - start)) s"
