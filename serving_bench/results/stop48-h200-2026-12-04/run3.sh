#!/usr/bin/env bash
# stop 48, call 3 (two H200s): the GPU tests that need two devices: the layer on cuda:1 while cuda:0 is current
# (Triton launches follow the current device), and expert parallelism over NCCL all-to-all (2 ranks).
set -uo pipefail
start=$SECONDS
v=/tmp/v3; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
nvidia-smi --query-gpu=index,name --format=csv > $v/gpu.txt
repo=$PWD
(cd /tmp && timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs \
    "$repo/tests/test_api.py::test_gpu_layer_runs_on_its_device_whichever_is_current" "$repo/tests/test_expert_parallel.py") > $v/two-gpu-tests.txt 2>&1
echo "=== two-gpu-tests rc=$? $((SECONDS - start)) s"; tail -12 $v/two-gpu-tests.txt | cut -c1-250
tar czf $OUT/v3.tgz -C /tmp v3
echo "=== done $((SECONDS - start)) s"
