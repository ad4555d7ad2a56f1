#!/usr/bin/env bash
# stop 42, call 6 (the final wheel, after the launch-path mend of prepare_device): moe2cta.adapters on the GPU: the layer as a torch.library op inside torch.compile (Inductor,
# fullgraph, mode="reduce-overhead" CUDA graphs), triton / cute / auto, against the eager layer call and the fp64
# reference; then test_api's GPU tests again (the layer the op wraps).
set -uo pipefail
start=$SECONDS
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels || exit 1
K=$PWD/.kernels/c12
repo=$PWD
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$OUT/kernel-requests.jsonl
cd /tmp || exit 1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo -rs $repo/tests/test_adapters.py > $OUT/adapters-tests.txt 2>&1
echo "=== adapters rc=$? $((SECONDS - start)) s"; tail -15 $OUT/adapters-tests.txt | cut -c1-240
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo -rs $repo/tests/test_api.py > $OUT/api-tests.txt 2>&1
echo "=== api rc=$? $((SECONDS - start)) s"; tail -3 $OUT/api-tests.txt | cut -c1-240
[ -f $OUT/kernel-requests.jsonl ] && { echo "kernels missing:"; cat $OUT/kernel-requests.jsonl | cut -c1-200; }
echo "=== done $((SECONDS - start)) s"
