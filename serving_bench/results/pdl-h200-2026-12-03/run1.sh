#!/usr/bin/env bash
# stop 41, call 1: the CuTe GEMMs as programmatic dependent launches (DependentLaunch). (1) the nine new check
# variants (PROGRAMMATIC / PROGRAMMATIC_WEIGHT_PREFETCH on the decode, wide, regular, PAIR and fused-tail kernels)
# against the twin, four routings each, and the layer's chain with every variant in CUDA graphs; (2) racecheck on two of them; (3) probe_pdl.py: the layer (cute) at the decode
# cells and three prefill cells, every variant's graphs bit-compared and timed in interleaved rounds.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c11.tar.xz -C .kernels || exit 1
K=$PWD/.kernels/c11
repo=$PWD
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $v/gpu.txt
cd /tmp || exit 1
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo -rs $repo/tests/test_sm90_gpu.py -k "pdl or programmatic" \
  > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; tail -3 $v/tests.txt | cut -c1-240
pack
timeout 80 compute-sanitizer --tool racecheck --racecheck-report hazard python3 $repo/serving_bench/hopper_gemm_bench.py \
  run --kernel-dir $K --skip-bench --no-pingpong --routings random \
  --only g1_swiglu_swapped16_pdl_prefetch g2_rowscale_bias_grouped3_skip_dynamic_pdl_prefetch > $v/racecheck.txt 2>&1
echo "=== racecheck rc=$? $((SECONDS - start)) s"; grep -E "RACECHECK SUMMARY|PASS|FAIL" $v/racecheck.txt | tail -4 | cut -c1-200
pack
timeout 330 python3 $repo/serving_bench/results/pdl-h200-2026-12-03/probe_pdl.py run --json $v/probe.json \
  > $v/probe.txt 2>&1
echo "=== probe rc=$? $((SECONDS - start)) s"; cut -c1-250 $v/probe.txt | grep -v Warn | tail -30
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; wc -l < $v/kernel-requests.jsonl; }
echo "=== done $((SECONDS - start)) s"
