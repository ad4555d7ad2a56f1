#!/usr/bin/env bash
# stop 40, call 1: (1) stop 39's race fix on the 160-row wide tile's token-row producer (one lane writes each row's
# token between two warp barriers), on kernels rebuilt from the current code (bundle c10 = c9 with every
# weights-as-m token-row kernel rebuilt): the 160-row token-row checks and test_api's token-row layer tests, then
# racecheck on the two 160-row token-row check variants; (2) the full layer grid, run v29 (stop 39's layer default
# included: qwen3-30b-a3b T=2048 GEMM1 on the token rows).
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c10.tar.xz -C .kernels || exit 1
K=$PWD/.kernels/c10
repo=$PWD
(
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
cd /tmp || exit 1
MOE2CTA_KERNEL_DIR=$K timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo $repo/tests/test_sm90_gpu.py \
  $repo/tests/test_api.py -k "wide160 and token_rows or token_rows" > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; tail -3 $v/tests.txt | cut -c1-240
NEW="g1_swiglu_wide160_even_token_rows_n256 g1_swiglu_wide160_even_token_rows_n256_decode"
timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard python3 $repo/serving_bench/hopper_gemm_bench.py \
  run --kernel-dir $K --skip-bench --no-pingpong --routings random zero_experts --only $NEW > $v/racecheck.txt 2>&1
echo "=== racecheck rc=$? $((SECONDS - start)) s"; grep -E "RACECHECK SUMMARY|hazard|Error|PASS|FAIL" $v/racecheck.txt | tail -6 | cut -c1-200
)
pack
echo "=== grid $(date +%T) $((SECONDS - start)) s"
OUT=$v KERNELS=.kernels/c10 LAYER_TAG=v29- LANE0="layer-full" timeout 340 bash serving_bench/device_validate.sh
pack
echo "=== done $((SECONDS - start)) s"
