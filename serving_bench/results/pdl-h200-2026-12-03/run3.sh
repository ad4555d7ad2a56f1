#!/usr/bin/env bash
# stop 41, call 3 (call 2's start was refused): (1) probe_gaps.py: do the CuTe GEMMs start before the previous kernel
# ends? Kernel start / end times of a graph replay of the cute layer (qwen3-30b-a3b T = 8, 512, 2048), every
# DependentLaunch variant; (2) every GPU test on bundle c12 (every preset and GPU-test kernel rebuilt from this stop's
# code, the PDL variants included); (3) Nsight Compute sections of the wide 160-row kernels of qwen3-30b-a3b T=2048
# (tensor pipe, DRAM, warp stalls): a lead for the ridge cells.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels || exit 1
K=$PWD/.kernels/c12
repo=$PWD
(
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
cd /tmp || exit 1
timeout 70 python3 $repo/serving_bench/results/pdl-h200-2026-12-03/probe_gaps.py > $v/gaps.txt 2>&1
echo "=== gaps rc=$? $((SECONDS - start)) s"; grep -v Warn $v/gaps.txt | cut -c1-170 | tail -75
)
pack
OUT=$v KERNELS=.kernels/c12 ALL_TESTS_LIMIT=320 LANE0="all-tests" bash serving_bench/device_validate.sh > /dev/null 2>&1
echo "=== all-tests $((SECONDS - start)) s"; tail -40 $v/all-tests.txt | grep -E "FAILED|ERROR|passed|failed|SKIPPED" | cut -c1-200
pack
OUT=$v KERNELS=.kernels/c12 NCU_CELLS="qwen3-30b-a3b:2048" NCU_KERNELS=cute_swapped_backend TAIL=4 LANE0="prefill-ncu-sections" \
  timeout 120 bash serving_bench/device_validate.sh > /dev/null 2>&1
grep -E "Duration|DRAM Throughput|Memory Throughput|SM Frequency|Compute \(SM\)|Issue Slots Busy|Stall|L2 Cache Throughput" \
  $v/ncu-sections-qwen3-30b-a3b-2048.txt | head -40 | cut -c1-150
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; wc -l < $v/kernel-requests.jsonl; }
echo "=== done $((SECONDS - start)) s"
