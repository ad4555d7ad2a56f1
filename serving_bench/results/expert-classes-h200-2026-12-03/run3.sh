#!/usr/bin/env bash
# stop 37, call 3: where the 288-row tile's cycles go against the regular kernel's on deepseek-v3 T=8192 GEMM1 / GEMM2
# (model routing): Nsight Compute sections (speed of light, compute and memory workload, warp states, scheduler), one
# eager call per kernel.
set -uo pipefail
start=$SECONDS
D=$OUT; v=/tmp/v; mkdir -p $v
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
K=$PWD/.kernels/c2
(cd /tmp && timeout 400 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section LaunchStats \
  --kernel-name regex:"Sm90.*GroupedGemmKernel" \
  python3 -m moe2cta.serving_bench.prefill_gemm_bench --profile --bundle "new=$K" --models deepseek-v3 --tokens 8192 \
  --variants regular wide288_even --routing model) > $v/ncu-sections-deepseek-8192.txt 2>&1
echo "ncu rc=$? $((SECONDS - start)) s"
tar czf $D/v.tgz -C /tmp v
