#!/usr/bin/env bash
# stop 37, call 6: the regular kernel scheduled STATIC against its DYNAMIC default, same raster and padding rows
# (after run 5: where the CTAs that share an operand sit matters; STATIC puts consecutive units, which share a weight
# tile in the grouped rasters, on consecutive CTAs), and STATIC with every padding row multiplied (equal units).
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
K=.kernels/c4
run() {  # run SUFFIX MODELS TOKENS
  OUT=$v KERNELS=$K PREFILL_MODELS="$2" PREFILL_TOKENS="$3" PREFILL_ROUTING=model PREFILL_SUFFIX=-$1 \
    PREFILL_VARIANTS="default regular_static regular_static_multiply" LANE0="prefill-gemm" TAIL=0 \
    bash serving_bench/device_validate.sh
  grep -v "^\[#" $v/prefill-gemm-$1.txt | grep -E "cute|dense-bmm" ; pack
}
run deepseek deepseek-v3 "8192 8192 32768"
run qwen qwen3-235b-a22b "8192"
run qwen30 qwen3-30b-a3b "8192"
run mixtral mixtral-8x7b "8192"
run gptoss gpt-oss-120b "32768"
echo "=== done $((SECONDS - start)) s"
