#!/usr/bin/env bash
# stop 36, call 1: ExpertSplit.EVEN (an expert's rows spread evenly over its wide tiles) against FILL and the regular
# kernel: checks, per-GEMM timings (model routing) at 128 / 256 / 320 / 512 / 1024 rows per expert and deepseek-v3's
# spread; the sm90 and layer GPU tests with the policy's wide tiles on EVEN; racecheck and memcheck; then the 288-row
# tile at 128 rows per expert (against the 160-row one)
set -uo pipefail
mkdir -p .kernels && tar xJf .kpack/v29.tar.xz -C .kernels || exit 1
out=${OUT:-/tmp}/v; mkdir -p $out
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
K=$PWD/.kernels/v29; repo=$PWD
export MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$out/kernel-requests.jsonl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit --format=csv > $out/gpu.txt
EVEN="g1_swiglu_wide288_even_3blocks g1_oai_bias_wide288_even_dynamic_many g2_rowscale_bias_wide288_even_n320_3blocks g2_rowscale_wide288_even_step16_dynamic_many g2_plain_wide288_even_decode g1_swiglu_wide160_even_n256 g2_rowscale_bias_wide160_even_n256_along_m_3blocks g1_gelu_wide256_even_dynamic_many"
cd /tmp
H="python3 $repo/serving_bench/hopper_gemm_bench.py run --kernel-dir $K --skip-bench --no-pingpong"
echo "=== checks"; timeout 100 $H --only $EVEN g1_swiglu_wide288_3blocks g2_rowscale_bias_wide288_n320_3blocks --json $out/checks.json > $out/checks.txt 2>&1; echo rc=$?; tail -3 $out/checks.txt
P="python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle new=$K --routing model"
bench() {  # name timeout models... -- tokens... -- variants...
    local name=$1 t=$2; shift 2
    echo "=== $name $(date +%T)"; timeout $t $P "$@" --json $out/$name.json > $out/$name.txt 2>&1; echo rc=$?
    grep -E "gemm[12] (cute|dense-c)" $out/$name.txt
}
bench deepseek-8192 90 --models deepseek-v3 --tokens 8192 --variants regular wide288 wide288_even
bench gpt-oss-256-320 90 --models gpt-oss-120b --tokens 8192 10240 --variants regular wide288 wide288_even
bench rows512 120 --models qwen3-235b-a22b qwen3-30b-a3b --tokens 8192 --variants regular wide288 wide288_even
bench mixtral-2048 60 --models mixtral-8x7b --tokens 2048 --variants regular wide288 wide288_even
bench rows1024 120 --models gpt-oss-120b deepseek-v3 --tokens 32768 --variants regular wide288_even
echo "=== gpu-tests"; (cd /tmp && timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_api.py" "$repo/tests/test_sm90_gpu.py" "$repo/tests/test_graphed.py") > $out/gpu-tests.txt 2>&1; echo rc=$?; tail -4 $out/gpu-tests.txt
echo "=== racecheck"; timeout 90 compute-sanitizer --tool racecheck --racecheck-report hazard $H --routings random one_expert --only g1_swiglu_wide288_even_3blocks g2_rowscale_bias_wide288_even_n320_3blocks g1_swiglu_wide160_even_n256 > $out/racecheck.txt 2>&1; echo rc=$?; tail -2 $out/racecheck.txt
echo "=== memcheck"; timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 $H --routings zero_experts one_expert --only g2_rowscale_bias_wide288_even_n320_3blocks g2_rowscale_bias_wide160_even_n256_along_m_3blocks g2_plain_wide288_even_decode > $out/memcheck.txt 2>&1; echo rc=$?; tail -2 $out/memcheck.txt
bench rows128 90 --models qwen3-30b-a3b qwen3-235b-a22b --tokens 2048 --variants regular wide160 wide288
bench mixtral-512 60 --models mixtral-8x7b --tokens 512 --variants regular wide160 wide288
