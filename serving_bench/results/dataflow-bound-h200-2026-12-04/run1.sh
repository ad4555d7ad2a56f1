#!/usr/bin/env bash
# stop 43, call 1: the upper bound of a GEMM1 -> GEMM2 dataflow (probe_overlap.py): the cute layer with both GEMMs
# plain, both programmatic, and GEMM2 programmatic without its wait, interleaved graph replays over 29 cells.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels && tar xJf .kpack/dataflow.tar.xz -C .kernels || exit 1
cp .kernels/pdl/*.so .kernels/c12/
repo=$PWD
(
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$repo/.kernels/c12
cd /tmp || exit 1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > $v/gpu.txt 2>&1
timeout 480 python3 $repo/serving_bench/results/dataflow-bound-h200-2026-12-04/probe_overlap.py run \
  --nowait $repo/.kernels/nowait --json $v/overlap.json > $v/overlap.txt 2>&1
echo "=== overlap rc=$? $((SECONDS - start)) s"; grep -v Warn $v/overlap.txt | cut -c1-230 | tail -45
)
cp $v/* $OUT/ 2>/dev/null
echo "=== done $((SECONDS - start)) s"
