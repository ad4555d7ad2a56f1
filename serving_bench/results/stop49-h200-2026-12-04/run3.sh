#!/usr/bin/env bash
# stop 49, call 3: the JIT launch's phases for every Triton launch of one forward (jit_phases.py) and the host's
# primitives (launch_cost), code of stop 48 (bundle c16).
set -uo pipefail
start=$SECONDS
v=/tmp/run3; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16
probe=$PWD/serving_bench/results/stop49-h200-2026-12-04/jit_phases.py
cd /tmp
timeout 60 python3 -m moe2cta.serving_bench.launch_cost --json $v/launch-cost.json 2>&1 | tee $v/launch-cost.txt
for c in "qwen3-30b-a3b 2048 auto" "qwen3-30b-a3b 1 auto" "qwen3-30b-a3b 8 triton" "deepseek-v3 2048 auto"; do
  timeout 120 python3 $probe $c 2>&1 | tee -a $v/jit-phases.txt
done
tar czf $OUT/run3.tgz -C /tmp run3
echo "=== done $((SECONDS - start)) s"
