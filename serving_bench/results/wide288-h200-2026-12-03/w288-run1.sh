#!/usr/bin/env bash
# stop 35, call 1: 288-row wide tiles and partial n-blocks: checks, racecheck, memcheck, per-GEMM timings (model
# routing) at ~256 rows per expert beside the layer's kernels
set -uo pipefail
out=/tmp/v; mkdir -p $out
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
K=$PWD/.kernels/${BUNDLE:-v28}; repo=$PWD
export MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$out/kernel-requests.jsonl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit --format=csv > $out/gpu.txt
NEW="g1_swiglu_wide288_3blocks g1_oai_bias_wide288_dynamic_many g2_rowscale_bias_wide288_n320_3blocks g1_oai_bias_wide288_n320_along_m g2_rowscale_wide288_step16_dynamic_many g1_gelu_wide288_n64 g2_plain_wide288_decode g2_rowscale_bias_wide256_n320_dynamic"
OLD="g1_swiglu_wide256 g1_gelu_wide128_step16 g1_oai_bias_wide256_dynamic g2_rowscale_bias_wide256_dynamic_many g2_plain_wide256_n64_along_m g2_rowscale_wide256_one_size g1_swiglu_swapped16 g1_oai_bias_swapped32_dynamic g2_rowscale_bias_swapped16 g2_rowscale_swapped16_dynamic_many g1_swiglu_wide128_n256 g1_oai_bias_wide128_n256_dynamic_many g1_swiglu_wide160_n256 g1_oai_bias_wide160_n256_dynamic_many g2_rowscale_bias_wide160_n256_along_m g2_rowscale_wide160_n256_step16_dynamic_many g1_gelu_wide160_n128 g2_plain_wide160_n128_decode"
cd /tmp
echo "=== checks"; timeout 200 python3 $repo/serving_bench/hopper_gemm_bench.py run --kernel-dir $K --skip-bench --no-pingpong --only $NEW $OLD --json $out/checks.json > $out/checks.txt 2>&1; echo rc=$?; tail -4 $out/checks.txt
echo "=== racecheck"; timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard python3 $repo/serving_bench/hopper_gemm_bench.py run --kernel-dir $K --skip-bench --no-pingpong --routings random zero_experts --only g1_swiglu_wide288_3blocks g2_rowscale_bias_wide288_n320_3blocks g1_oai_bias_wide288_n320_along_m g1_gelu_wide288_n64 > $out/racecheck.txt 2>&1; echo rc=$?; tail -3 $out/racecheck.txt
echo "=== memcheck"; timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $repo/serving_bench/hopper_gemm_bench.py run --kernel-dir $K --skip-bench --no-pingpong --routings zero_experts one_expert --only g2_rowscale_bias_wide288_n320_3blocks g1_oai_bias_wide288_n320_along_m g2_rowscale_wide288_step16_dynamic_many > $out/memcheck.txt 2>&1; echo rc=$?; tail -3 $out/memcheck.txt
echo "=== prefill 8192"; timeout 240 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle new=$K --models gpt-oss-120b deepseek-v3 qwen3-30b-a3b --tokens 8192 --routing model --variants default wide wide288 wide288_dynamic wide288_step16 --json $out/prefill-model-8192.json > $out/prefill-model-8192.txt 2>&1; echo rc=$?; grep -E "gemm[12] (cute|dense-c)" $out/prefill-model-8192.txt
echo "=== prefill 4096"; timeout 120 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle new=$K --models qwen3-30b-a3b qwen3-235b-a22b --tokens 4096 --routing model --variants default wide288 --json $out/prefill-model-4096.json > $out/prefill-model-4096.txt 2>&1; echo rc=$?; grep -E "gemm[12] (cute|dense-c)" $out/prefill-model-4096.txt
