#!/usr/bin/env bash
# stop 48, call 7: the README's main job on the GPU with the final wheel (the command-line checks added after call 6):
# `moe2cta-bench` with its defaults, bundle c16; and its exit status.
set -uo pipefail
start=$SECONDS
v=/tmp/v7; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
(cd /tmp && timeout 400 python3 -m moe2cta.serving_bench --progress off --no-plots --out $v/bench) > $v/bench.txt 2>&1
echo "=== moe2cta-bench rc=$? $((SECONDS - start)) s"; grep -A8 "^summary" $v/bench.txt | cut -c1-200
tar czf $OUT/v7.tgz -C /tmp v7
echo "=== done $((SECONDS - start)) s"
