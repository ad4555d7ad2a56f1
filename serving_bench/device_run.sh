#!/usr/bin/env bash
# One call on a lent H200 (or 2x H200) machine: install this checkout from a prebuilt wheel, load the CuTe
# kernel bundle (no DSL compiler there), run the 2-GPU expert-parallel check when two GPUs are present,
# then the serving benchmark on GPU 0 (one model per invocation, so partial results survive a time limit)
# while the integration GPU tests run on GPU 1 (or before the benchmark on a one-GPU machine).
# Prepared here (no GPU):
#   python3 -m pip wheel --no-deps --no-build-isolation -w .whl .
#   for m in <models>; do python -m moe2cta.aot build --model $m --arch sm_90a --out .kernels/bundle-sm90; done
#   shared/gpu/runtime-bundle.sh .bundle/rt
# Usage there: bash serving_bench/device_run.sh "model1 model2 ..." [bench args...]
# Results: $OUT/results.tgz (re-packed after every step) and the logs printed.
set -uo pipefail
models=${1:?usage: device_run.sh MODELS [bench args]}
shift
res=/tmp/moe2cta-results
mkdir -p "$res"
pack() { tar czf "${OUT:-/tmp}/results.tgz" -C "$res" . ; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
# shellcheck disable=SC1091
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
export MOE2CTA_KERNEL_DIR=$PWD/.kernels/bundle-sm90
(cd /tmp && python3 -m moe2cta aot check "$MOE2CTA_KERNEL_DIR" > "$res/aot-check.txt" 2>&1) \
    || { echo "aot check failed: $(tail -1 "$res/aot-check.txt")"; pack; exit 1; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$res/gpu.txt"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
repo=$PWD
cd /tmp || exit 1
gpu_tests() {
    timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" \
        "$repo/tests/test_api.py" "$repo/tests/test_serving_bench.py" > "$res/gpu-tests.txt" 2>&1
}
if [ "$ngpu" -ge 2 ]; then
    timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_expert_parallel.py" \
        > "$res/ep-tests.txt" 2>&1; tail -5 "$res/ep-tests.txt"
    timeout 60 python3 -m moe2cta.serving_bench.ep_bench --nprocs 2 --model deepseek-v3 --model qwen3-235b-a22b \
        --tokens 128,2048 --stages triton --json "$res/ep-h200x2.json" > "$res/ep-bench.txt" 2>&1; tail -25 "$res/ep-bench.txt"
    pack
    (CUDA_VISIBLE_DEVICES=1 gpu_tests) &
    tests_pid=$!
else
    gpu_tests; tests_pid=
fi
for m in $models; do
    CUDA_VISIBLE_DEVICES=0 timeout "${BENCH_TIMEOUT:-150}" python3 -m moe2cta.serving_bench --models "$m" \
        --out "$res/bench-$m" --progress off "$@" > "$res/bench-$m.txt" 2>&1
    grep -v '^\[#' "$res/bench-$m.txt" | head -40
    pack
done
[ -n "$tests_pid" ] && wait "$tests_pid"
tail -6 "$res/gpu-tests.txt"
pack
