#!/usr/bin/env bash
# stop 51, call 1: stop 50's last two host-code commits (250e74b: plan CLI / tuning cache / expert-parallel checks;
# a9b2b3f: GraphedMoELayer replays without autograd history, captures on a stream of the layer's device) had not run
# on the GPU. Their GPU tests, from a wheel of the current main, with bundle c16.
set -uo pipefail
start=$SECONDS
v=/tmp/run1; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
repo=$PWD
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
cd /tmp
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs \
    "$repo/tests/test_graphed.py" "$repo/tests/test_graph_pools.py" "$repo/tests/test_api.py" \
    "$repo/tests/test_tuning.py" "$repo/tests/test_expert_parallel.py" "$repo/tests/test_adapters.py" \
    > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/tests.txt | tail -12 | cut -c1-250
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
tar czf $OUT/run1.tgz -C /tmp run1
echo "=== done $((SECONDS - start)) s"
