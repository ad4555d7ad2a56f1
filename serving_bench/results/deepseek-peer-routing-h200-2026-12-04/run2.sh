#!/usr/bin/env bash
# stop 43, call 2: deepseek-v3 T=8192's GEMMs under a near-balanced routing (prefill_gemm_bench --routing random: each
# token's top-8 uniform over the 256 experts, the spread of the peer routing) and under the model's router: the default
# (regular kernel), the 288-row wide tile for every expert (EVEN split), and the expert classes w288 / w160_w288.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels && tar xJf .kpack/w288.tar.xz -C .kernels || exit 1
cp .kernels/w288/*.so .kernels/c12/
repo=$PWD
(
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
cd /tmp || exit 1
for routing in random model; do
  t0=$SECONDS
  timeout 200 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle c12=$repo/.kernels/c12 --models deepseek-v3 \
    --tokens 8192 --routing $routing --variants default wide288_even --expert-classes w288 w160_w288 \
    --json $v/gemm-$routing.json > $v/gemm-$routing.txt 2>&1
  echo "=== $routing rc=$? $((SECONDS - t0)) s"; grep -v Warn $v/gemm-$routing.txt | cut -c1-200 | tail -22
done
)
cp -r $v/* $OUT/ 2>/dev/null
echo "=== done $((SECONDS - start)) s"
