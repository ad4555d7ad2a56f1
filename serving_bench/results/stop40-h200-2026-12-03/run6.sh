#!/usr/bin/env bash
# stop 40, call 6: call 5 found stop 39's hang gone on the current code, so can_implement now takes the token rows on
# every wide tile. (1) The token-row checks (two new: the 160- and 288-row tiles STATIC at K = 320, 5 K tiles on 4
# stages, many units per CTA) and test_api's token-row layer test (now the 256- and 288-row tiles too); (2) the layer's
# GPU tests (test_api, test_graphed: AUTO takes the token rows on those tiles where I <= 1024); (3) the layer at
# qwen3-30b-a3b T=3072 / 4096 (the 288-row tile), gathered against token rows, interleaved; (4) racecheck on the 288-row
# check.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c10.tar.xz -C .kernels || exit 1
K=$PWD/.kernels/c10
repo=$PWD
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
cd /tmp || exit 1
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo -rs $repo/tests/test_sm90_gpu.py \
  $repo/tests/test_api.py -k "token_rows" > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; tail -3 $v/tests.txt | cut -c1-240
pack
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo $repo/tests/test_api.py \
  $repo/tests/test_graphed.py > $v/layer-tests.txt 2>&1
echo "=== layer-tests rc=$? $((SECONDS - start)) s"; tail -3 $v/layer-tests.txt | cut -c1-240
pack
timeout 70 python3 -m moe2cta.serving_bench --models qwen3-30b-a3b --tokens 3072,4096 \
  --backends auto,cute-gathered,cute-token-rows,triton --order interleaved --time-per-case 0.1 --out $v/layer-ab \
  --progress off --no-plots > $v/layer-ab.txt 2>&1
echo "=== layer-ab rc=$? $((SECONDS - start)) s"; grep -E "qwen3|auto|cute|triton" $v/layer-ab/report.md | head -12 | cut -c1-200
pack
timeout 80 compute-sanitizer --tool racecheck --racecheck-report hazard python3 $repo/serving_bench/hopper_gemm_bench.py \
  run --kernel-dir $K --skip-bench --no-pingpong --routings random --only g1_oai_bias_wide288_even_token_rows_k320_many \
  > $v/racecheck.txt 2>&1
echo "=== racecheck rc=$? $((SECONDS - start)) s"; grep -E "RACECHECK SUMMARY|PASS|FAIL" $v/racecheck.txt | tail -3 | cut -c1-200
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; wc -l < $v/kernel-requests.jsonl; }
echo "=== done $((SECONDS - start)) s"
