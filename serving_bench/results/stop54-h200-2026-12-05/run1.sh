#!/usr/bin/env bash
# stop 54, call 1: routing inputs read as given (int64 ids, bf16 / fp64 weights: no conversion launches) on the GPU.
# First the bench (three routing dtypes side by side), then every GPU test on this stop's wheel with bundle c20
# (its kernels' sources are unchanged: aot check), then the router's CPU-tier file compiled on the GPU (int64 ids
# and maps through the dispatch kernels, any float weights through gather / combine / row weights).
set -uo pipefail
start=$SECONDS
mkdir -p .kernels && { [ -d .kernels/c20 ] || tar xJf .kpack/c20.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c20 MOE2CTA_KERNEL_REQUESTS=$OUT/kernel-requests.jsonl
export PYTHONUNBUFFERED=1
repo=$PWD
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
cd /tmp
timeout 170 python3 -m moe2cta.serving_bench.topk_inputs_bench --models qwen3-30b-a3b gpt-oss-120b deepseek-v3 \
  --tokens 1 4 64 2048 --json $OUT/topk-inputs.json --md $OUT/topk-inputs.md 2>&1 | tee $OUT/topk-inputs.txt | cut -c1-250
echo "=== bench rc=${PIPESTATUS[0]} $((SECONDS - start)) s"
python3 -m moe2cta aot check "$repo/.kernels/c20" > $OUT/aot-check.txt 2>&1; echo "=== aot check rc=$?"; tail -1 $OUT/aot-check.txt | cut -c1-250
left=$((450 - SECONDS))
timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests" > $OUT/all-tests.txt 2>&1
echo "=== all gpu tests rc=$? $((SECONDS - start)) s (limit $left)"; grep -E "FAILED|ERROR|passed|failed" $OUT/all-tests.txt | tail -12 | cut -c1-300
left=$((585 - SECONDS))
timeout $left python3 -m pytest -q -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_router_triton.py" > $OUT/router-compiled.txt 2>&1
echo "=== router tier compiled rc=$? $((SECONDS - start)) s (limit $left)"; grep -E "FAILED|ERROR|passed|failed" $OUT/router-compiled.txt | tail -8 | cut -c1-300
[ -f $OUT/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $OUT/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
