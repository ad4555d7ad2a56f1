#!/usr/bin/env bash
# stop 35, call 5: the 288-row tile below its range: against the 160-row tile (the default at 96-144 rows per expert)
# and the regular kernel at 128 rows per expert, model routing
set -uo pipefail
mkdir -p .kernels && tar xJf .kpack/v28.tar.xz -C .kernels || exit 1
out=/tmp/v; mkdir -p $out
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$PWD/.kernels/v28
export MOE2CTA_KERNEL_REQUESTS=$out/kernel-requests.jsonl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $out/gpu.txt
cd /tmp
P="python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle new=$MOE2CTA_KERNEL_DIR --routing model"
echo "=== 128 rows"; timeout 150 $P --models qwen3-30b-a3b qwen3-235b-a22b --tokens 2048 --variants regular wide160 wide288 --json $out/below-128.json > $out/below-128.txt 2>&1; echo rc=$?; grep -E "gemm[12] cute" $out/below-128.txt
echo "=== mixtral 512"; timeout 100 $P --models mixtral-8x7b --tokens 512 --variants regular wide160 wide288 --json $out/below-mixtral.json > $out/below-mixtral.txt 2>&1; echo rc=$?; grep -E "gemm[12] cute" $out/below-mixtral.txt
