#!/usr/bin/env bash
# stop 43, call 1: expert classes in the layer (sm90 expert_classes: deepseek-v3 at 145-256 rows per expert).
# (1) the layer's GPU tests (test_api, with the new expert-class test; test_graphed) on this wheel and bundle c12 plus
# the new kernels; (2) the layer A/B at deepseek-v3 T=8192 (the grid's worst cell): the previous wheel (one launch per
# GEMM) against this one, auto and triton (control), under the model's router and the peer routing, in the order
# old, new, old, new.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels && tar xJf .kpack/c13add.tar.xz -C .kernels || exit 1
cp .kernels/c13x/*.so .kernels/c12/
for w in new old; do
  src=.whl; [ $w = old ] && src=.whl/old
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-$w $src/moe2cta-*.whl || exit 1
done
repo=$PWD
(
source .bundle/rt/activate.sh
export PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$repo/.kernels/c12 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
cd /tmp || exit 1
t0=$SECONDS
PYTHONPATH=/tmp/site-new:$PYTHONPATH timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo -rs \
  $repo/tests/test_api.py $repo/tests/test_graphed.py -x > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|FAILED|ERROR|Error" $v/tests.txt | cut -c1-220 | tail -12
for round in 1 2; do
  for w in old new; do
    for router in model peer; do
      t0=$SECONDS
      PYTHONPATH=/tmp/site-$w:$PYTHONPATH timeout 100 python3 -m moe2cta.serving_bench --models deepseek-v3 \
        --tokens 8192 --router $router --backends auto,triton --time-per-case 0.3 --out $v/ab-$w-$router-$round \
        --progress off --no-plots > $v/ab-$w-$router-$round.txt 2>&1
      echo "=== $w $router round $round rc=$? $((SECONDS - t0)) s: $(grep -E '^ +8192' $v/ab-$w-$router-$round.txt | cut -c60-140)"
    done
  done
done
)
cp -r $v/* $OUT/ 2>/dev/null
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-300 $v/kernel-requests.jsonl; }
echo "=== done $((SECONDS - start)) s"
