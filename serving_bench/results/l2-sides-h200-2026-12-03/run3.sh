#!/usr/bin/env bash
# stop 38, call 3: every GPU test on kernels rebuilt from this stop's code (the five presets' `aot build`s, the
# GPU-test requests and the bench's DYNAMIC_SIDES kernels), with this machine's side map from the probe for the
# DYNAMIC_SIDES tests' "measured" case.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
mkdir -p /tmp/k && tar xJf .kpack/c7.tar.xz -C /tmp/k
K=/tmp/k/c7
repo=$PWD
cd /tmp || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit,serial --format=csv > $v/gpu.txt
timeout 60 python3 -m moe2cta.serving_bench.l2_sides_probe --out $v/sides.json > $v/probe.txt 2>&1
echo "=== probe rc=$? $((SECONDS - start)) s"; cut -c1-300 $v/probe.txt | head -3
pack
MOE2CTA_KERNEL_DIR=$K MOE2CTA_SIDE_MAP=$v/sides.json MOE2CTA_TUNING_CACHE=$v/tuning.json \
  MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider \
  --rootdir $repo -rs $repo/tests > $v/all-tests.txt 2>&1
echo "=== all-tests rc=$? $((SECONDS - start)) s"; tail -35 $v/all-tests.txt | cut -c1-200
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; wc -l < $v/kernel-requests.jsonl; }
pack
echo "=== done $((SECONDS - start)) s"
