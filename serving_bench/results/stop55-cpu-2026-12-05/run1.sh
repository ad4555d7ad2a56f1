#!/usr/bin/env bash
# stop 55, call 1 (NOT RUN: no machine was lent this session; ready for the next one). This stop changed no kernel's
# code, but host checks in digested files (the sm90 SMEM model, sm100 can_implement), so bundle c21 is c20's 445
# kernels rebuilt from this stop's sources (same keys). It also changed how a bundle library is loaded (the CuTe DSL
# runtime first, the library's recorded size and sha256 compared) and the layer's TOKEN_ROWS path
# (scatter_row_weights with top_k). So: `aot check`, every GPU test once, then stop 54's run3 split of the
# gpt-oss-120b T=1 token GEMVs by id width and weight dtype (int64 ids + bf16 weights were 6.5 us slower than
# int32 + fp32 there). Carry .whl (rebuilt from this stop's code), .bundle/rt, .kpack (c21.tar.xz).
set -uo pipefail
start=$SECONDS
source serving_bench/device_setup.sh c21
python3 -m moe2cta aot check "$MOE2CTA_KERNEL_DIR" | tail -3
cd /tmp
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests" > $OUT/gpu-tests.txt 2>&1
echo "=== gpu tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-tests.txt | tail -8 | cut -c1-300
timeout $((480 - SECONDS + start)) python3 "$repo/serving_bench/results/stop54-h200-2026-12-05/gemv_split.py" \
  gpt-oss-120b 1 1 2>&1 | tee $OUT/gemv-split.txt | cut -c1-250
echo "=== gemv split rc=${PIPESTATUS[0]} $((SECONDS - start)) s"
[ -f $OUT/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $OUT/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
