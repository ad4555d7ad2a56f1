#!/usr/bin/env bash
# stop 43, call 2 (run 1 measured the classes without the empty-unit skip: the regular class's launch walked every
# other class's m-blocks, 1.34x / 1.60x slower): bundle c13 = c12 with every regular kernel rebuilt (a unit with no
# valid row is skipped) plus the classes' 288-row kernels. (1) Every GPU test on it; (2) the layer A/B at deepseek-v3
# T=8192 (old wheel + c12 against this wheel + c13, auto and triton, the model's router and the peer routing, old,
# new, old, new).
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels && tar xJf .kpack/c13.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c13 ALL_TESTS_LIMIT=330 LANE0="all-tests" timeout 380 bash serving_bench/device_validate.sh > /dev/null 2>&1
echo "=== all-tests $((SECONDS - start)) s"; tail -40 $v/all-tests.txt | grep -E "FAILED|ERROR|passed|failed" | cut -c1-200
pack
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-old .whl/old/moe2cta-*.whl || exit 1
repo=$PWD
(
source .bundle/rt/activate.sh
export PYTHONUNBUFFERED=1
cd /tmp || exit 1
for round in 1 2; do
  for w in old new; do
    site=/tmp/site-old kd=$repo/.kernels/c12; [ $w = new ] && site=/tmp/moe2cta-site kd=$repo/.kernels/c13
    for router in model peer; do
      PYTHONPATH=$site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$kd timeout 60 python3 -m moe2cta.serving_bench --models deepseek-v3 \
        --tokens 8192 --router $router --backends auto,triton --time-per-case 0.3 --out $v/ab-$w-$router-$round \
        --progress off --no-plots > $v/ab-$w-$router-$round.txt 2>&1
      echo "=== $w $router $round rc=$? $(grep -E '^8192' $v/ab-$w-$router-$round.txt | cut -c50-120)"
    done
  done
done
)
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
