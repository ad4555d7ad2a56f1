#!/usr/bin/env bash
# stop 54, call 2: the GPU tests call 1 left at its limit (the token GEMVs', tuning's) and the graphed layer's (its
# static ids are int64 now), then the routing-dtype bench
# again where call 1 read the inputs-as-given slower than the engines' dtypes (gpt-oss-120b T=1 +6.4 us, qwen3-30b
# T=4 +2.3 us; the kernels compile to the same code): two repeats of 0.5 s per cell, percentiles kept.
set -uo pipefail
start=$SECONDS
source serving_bench/device_setup.sh c20
cd /tmp
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_triton_token_gemv.py" \
  "$repo/tests/test_tuning.py" "$repo/tests/test_graphed.py" > $OUT/rest-tests.txt 2>&1
echo "=== token gemv + tuning + graphed gpu tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/rest-tests.txt | tail -8 | cut -c1-300
timeout $((380 - SECONDS + start)) python3 -m moe2cta.serving_bench.topk_inputs_bench --models gpt-oss-120b qwen3-30b-a3b \
  --tokens 1 4 --seconds 0.5 --repeats 2 --json $OUT/topk-inputs2.json --md $OUT/topk-inputs2.md 2>&1 | tee $OUT/topk-inputs2.txt | cut -c1-250
echo "=== bench rc=${PIPESTATUS[0]} $((SECONDS - start)) s"
timeout $((450 - SECONDS + start)) python3 "$repo/serving_bench/results/stop54-h200-2026-12-05/gemv_dtypes.py" gpt-oss-120b \
  qwen3-30b-a3b 2>&1 | tee $OUT/gemv-dtypes.txt | cut -c1-250
echo "=== gemv dtypes rc=${PIPESTATUS[0]} $((SECONDS - start)) s"
[ -f $OUT/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $OUT/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
