#!/usr/bin/env bash
# stop 50, call 1 (two H200s if lent): the GPU tests that need two devices (the layer on cuda:1 while cuda:0 is
# current; expert parallelism over NCCL, 2 ranks), then the two GPU tests this stop tightened (the programmatic
# launch chain against an fp64 reference; the failed capture's exception narrowed to the CUDA error).
set -uo pipefail
start=$SECONDS
v=/tmp/run1; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
nvidia-smi --query-gpu=index,name,power.limit --format=csv > $v/gpu.txt
repo=$PWD
cd /tmp
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs \
    "$repo/tests/test_api.py::test_gpu_layer_runs_on_its_device_whichever_is_current" "$repo/tests/test_expert_parallel.py" \
    "$repo/tests/test_sm90_gpu.py::test_programmatic_launch_chain_is_bit_equal" \
    "$repo/tests/test_graphed.py::test_gpu_failed_capture_leaves_the_stream_and_the_generator_as_they_were" \
    > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|SKIPPED|passed|failed" $v/tests.txt | tail -12 | cut -c1-250
tar czf $OUT/run1.tgz -C /tmp run1
echo "=== done $((SECONDS - start)) s"
