#!/usr/bin/env bash
# stop 49, call 7: the final wheel (after call 6: the Triton grouped GEMM memoizes its default configuration, the CUTE
# plan holds the family's name) on the GPU tests of the API, the Triton GEMMs, the router, graphs, adapters and token
# GEMVs; then host us per eager forward against stop 48's code (.whl/base), alternated, while the time lasts.
set -uo pipefail
start=$SECONDS
v=/tmp/run7; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base .whl/base/moe2cta-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-new .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
base_path=$PYTHONPATH
repo=$PWD
cd /tmp
PYTHONPATH=/tmp/site-new:$base_path timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs \
    "$repo/tests/test_api.py" "$repo/tests/test_triton_gemm.py" "$repo/tests/test_router_gpu.py" \
    "$repo/tests/test_graphed.py" "$repo/tests/test_adapters.py" "$repo/tests/test_triton_token_gemv.py" > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/tests.txt | tail -8 | cut -c1-250
tar czf $OUT/run7.tgz -C /tmp run7
for round in 1 2 3; do
  [ $((SECONDS - start)) -gt 300 ] && break
  for site in base new; do
    PYTHONPATH=/tmp/site-$site:$base_path timeout 60 python3 -m moe2cta.serving_bench.host_overhead --model qwen3-30b-a3b \
      --tokens 1 8 2048 --backends auto triton --calls 60 --json $v/host-qwen3-30b-a3b-$site-r$round.json \
      > $v/host-qwen3-30b-a3b-$site-r$round.txt 2>&1
  done
  echo "=== round $round $((SECONDS - start)) s"
  tar czf $OUT/run7.tgz -C /tmp run7
done
echo "=== done $((SECONDS - start)) s"
