#!/usr/bin/env bash
# stop 34, call 1: wide160 checks, racecheck, per-GEMM timings (model routing) beside the layer's kernels
set -uo pipefail
out=/tmp/v; mkdir -p $out
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
K=$PWD/.kernels/v27; repo=$PWD
export MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$out/kernel-requests.jsonl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $out/gpu.txt
W="g1_swiglu_wide160_n256 g1_oai_bias_wide160_n256_dynamic_many g2_rowscale_bias_wide160_n256_along_m g2_rowscale_wide160_n256_step16_dynamic_many g1_gelu_wide160_n128 g2_plain_wide160_n128_decode g1_swiglu_wide128_n256 g2_rowscale_bias_wide256_dynamic_many"
cd /tmp
echo "=== checks"; timeout 150 python3 $repo/serving_bench/hopper_gemm_bench.py run --kernel-dir $K --skip-bench --only $W --json $out/checks.json > $out/checks.txt 2>&1; echo rc=$?; tail -5 $out/checks.txt
echo "=== racecheck"; timeout 120 compute-sanitizer --tool racecheck --racecheck-report hazard python3 $repo/serving_bench/hopper_gemm_bench.py run --kernel-dir $K --skip-bench --routings random zero_experts --only g1_swiglu_wide160_n256 g2_rowscale_bias_wide160_n256_along_m g1_gelu_wide160_n128 > $out/racecheck.txt 2>&1; echo rc=$?; tail -4 $out/racecheck.txt
echo "=== memcheck"; timeout 90 compute-sanitizer --tool memcheck python3 $repo/serving_bench/hopper_gemm_bench.py run --kernel-dir $K --skip-bench --routings zero_experts --only g1_swiglu_wide160_n256 g2_rowscale_wide160_n256_step16_dynamic_many > $out/memcheck.txt 2>&1; echo rc=$?; tail -3 $out/memcheck.txt
echo "=== prefill"; timeout 200 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle new=$K --models qwen3-30b-a3b qwen3-235b-a22b --tokens 2048 --routing model --variants default token_rows wide wide160 wide128_n256 --json $out/prefill-model-2048.json > $out/prefill-model-2048.txt 2>&1; echo rc=$?; grep -E "gemm[12] (cute|dense-c)" $out/prefill-model-2048.txt
echo "=== mixtral"; timeout 100 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle new=$K --models mixtral-8x7b --tokens 512 --routing model --variants default regular wide160 --json $out/prefill-mixtral-512.json > $out/prefill-mixtral-512.txt 2>&1; echo rc=$?; grep -E "gemm[12] (cute|dense-c)" $out/prefill-mixtral-512.txt
