#!/usr/bin/env bash
# stop 44, call 2 (bundle c13; no kernel changed, only the check harness): a launch given a subset of the experts
# (hopper_gemm_bench routing class_masked: half the experts' counts zeroed while row_offsets keeps their rows, as one
# expert class's launch sees them): (1) the new GPU test over the 101 check variants that take expert subsets;
# (2) racecheck and (3) memcheck on the regular kernel's empty-unit skip (DYNAMIC, stores under the next mainloop,
# token rows, expert-grouped) and two wide EVEN tiles; (4) deepseek-v3's prefill row under the peer routing.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
mkdir -p .kernels && tar xJf .kpack/c13.tar.xz -C .kernels || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
repo=$PWD K=$PWD/.kernels/c13
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
cd /tmp || exit 1
timeout 150 python3 -m pytest -q -p no:cacheprovider --rootdir $repo -rs "$repo/tests/test_sm90_gpu.py" -k subset > $v/subset-tests.txt 2>&1
echo "=== subset tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|passed|failed" $v/subset-tests.txt | tail -8 | cut -c1-300
pack
ONLY="g1_swiglu_dynamic g1_oai_bias_under_skip_grouped3_dynamic_many g1_swiglu_act_under_dynamic g1_swiglu_token_rows g2_rowscale_bias_skip_expert_grouped2_many g1_swiglu_wide288_even_3blocks g2_rowscale_bias_wide160_even_n256_along_m_3blocks"
timeout 170 compute-sanitizer --tool racecheck --racecheck-report hazard python3 $repo/serving_bench/hopper_gemm_bench.py run --kernel-dir $K --skip-bench --routings class_masked --only $ONLY > $v/racecheck-subset.txt 2>&1
echo "=== racecheck rc=$? $((SECONDS - start)) s"; grep -E "^check|RACECHECK SUMMARY|ERROR SUMMARY" $v/racecheck-subset.txt | cut -c1-200
pack
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $repo/serving_bench/hopper_gemm_bench.py run --kernel-dir $K --skip-bench --routings class_masked --only $ONLY > $v/memcheck-subset.txt 2>&1
echo "=== memcheck rc=$? $((SECONDS - start)) s"; grep -E "ERROR SUMMARY|FAIL" $v/memcheck-subset.txt | cut -c1-200
pack
timeout 80 python3 -m moe2cta.serving_bench --models deepseek-v3 --tokens 2048,8192,32768 --router peer --backends auto,triton \
    --time-per-case 0.05 --out $v/deepseek-peer --progress off --no-plots > $v/deepseek-peer.txt 2>&1
echo "=== peer rc=$? $((SECONDS - start)) s"; grep -E "^ *(2048|8192|32768) " $v/deepseek-peer.txt | cut -c1-150
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
