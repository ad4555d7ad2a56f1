#!/usr/bin/env bash
# stop 49, call 1: the host's cost per primitive (launch_cost) and per eager forward with its own-time profile
# (host_overhead --sort tottime), on the code of stop 48 (bundle c16).
set -uo pipefail
start=$SECONDS
v=/tmp/run1; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16
cd /tmp
nproc > $v/host.txt; lscpu | grep -E "Model name|MHz|^CPU\(s\)" >> $v/host.txt; python3 -V >> $v/host.txt; cat $v/host.txt
timeout 120 python3 -m moe2cta.serving_bench.launch_cost --json $v/launch-cost.json 2>&1 | tee $v/launch-cost.txt
echo "=== launch_cost $((SECONDS - start)) s"
timeout 200 python3 -m moe2cta.serving_bench.host_overhead --model qwen3-30b-a3b --tokens 1 8 128 2048 8192 \
    --backends auto triton --calls 60 --profile 45 --sort tottime --json $v/host-qwen3-30b-a3b.json > $v/host-qwen3-30b-a3b.txt 2>&1
grep "per forward" $v/host-qwen3-30b-a3b.txt
echo "=== qwen3 $((SECONDS - start)) s"
timeout 150 python3 -m moe2cta.serving_bench.host_overhead --model deepseek-v3 --tokens 1 2048 \
    --backends auto --calls 60 --profile 45 --sort tottime --json $v/host-deepseek-v3.json > $v/host-deepseek-v3.txt 2>&1
grep "per forward" $v/host-deepseek-v3.txt
tar czf $OUT/run1.tgz -C /tmp run1
echo "=== done $((SECONDS - start)) s"
