#!/usr/bin/env bash
# stop 39, call 3 (after two refused starts): call 2 passed every wide token-row check (24 / 24) and measured qwen3
# T=2048, but gpt-oss-120b T=8192 (the 288-row tile, STATIC, on the token rows) printed nothing before its limits, in
# the GEMM bench and in the layer. can_implement now takes the token rows on the 160-row wide tile only, with K tiles a
# multiple of the stage count. (1) What ships: test_api's token-row layer test (512 tokens: the 160-row tile) and the
# 160-row token-row checks; (2) which kernels hang: probe_tr.py, one case per process under a 20 s limit, the 288-row
# tile on the token rows against the same tile on the gathered copy (bit-equal expected), at gpt-oss's shape STATIC and
# DYNAMIC and qwen3-30b's STATIC (can_implement refuses these now: the probe calls the bundle's kernels directly);
# (3) racecheck on the 160-row checks.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
mkdir -p /tmp/k && tar xJf .kpack/c9.tar.xz -C /tmp/k
K=/tmp/k/c9
repo=$PWD
cd /tmp || exit 1
MOE2CTA_KERNEL_DIR=$K timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo $repo/tests/test_sm90_gpu.py \
  $repo/tests/test_api.py -k "wide160 and token_rows or test_gpu_cute_gemm1_on_token_rows" > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; tail -3 $v/tests.txt | cut -c1-240
pack
for c in gptoss:static gptoss:dynamic qwen30:static; do
  timeout 20 python3 $repo/serving_bench/results/wide-token-rows-h200-2026-12-03/probe_tr.py $c $K >> $v/probe.txt 2>&1
  echo "=== probe $c rc=$? $((SECONDS - start)) s"; tail -1 $v/probe.txt | cut -c1-200
  pack
done
NEW="g1_swiglu_wide160_even_token_rows_n256 g1_swiglu_wide160_even_token_rows_n256_decode"
timeout 50 compute-sanitizer --tool racecheck --racecheck-report hazard python3 $repo/serving_bench/hopper_gemm_bench.py \
  run --kernel-dir $K --skip-bench --no-pingpong --routings random zero_experts --only $NEW > $v/racecheck.txt 2>&1
echo "=== racecheck rc=$? $((SECONDS - start)) s"; grep -E "RACECHECK SUMMARY|hazard|Error" $v/racecheck.txt | tail -3
pack
echo "=== done $((SECONDS - start)) s"
