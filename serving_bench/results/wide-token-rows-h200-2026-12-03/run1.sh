#!/usr/bin/env bash
# stop 39, call 1: the wide tiles reading the token rows themselves (ASource.TOKEN_ROWS on the 160 / 256 / 288-row
# WEIGHTS_AS_M kernels: cp.async of each unit's valid rows by the producer warpgroup, no gather launch).
# (1) correctness: every token-row check of test_sm90_gpu (the four new wide ones among them) and test_api's token-row
# layer test (the wide tiles now engage at 75 / 256 rows per expert); (2) prefill_gemm_bench, model routing: GEMM1's
# default (the wide tile on the gathered copy; the gather launch timed beside it) against the same tile on the token
# rows (token_rows_default) and the regular kernel on the token rows; (3) the layer, interleaved: auto, cute-gathered,
# cute-token-rows and the Triton control.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
mkdir -p /tmp/k && tar xJf .kpack/c9.tar.xz -C /tmp/k
K=/tmp/k/c9
export MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
repo=$PWD
cd /tmp || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit,serial --format=csv > $v/gpu.txt
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo $repo/tests/test_sm90_gpu.py \
  $repo/tests/test_api.py -k "token_rows" > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; tail -4 $v/tests.txt | cut -c1-240
pack
for spec in qwen3-30b-a3b:2048 qwen3-235b-a22b:2048 gpt-oss-120b:8192 mixtral-8x7b:512; do
  m=${spec%%:*}; toks=${spec#*:}
  timeout 100 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle c=$K --models $m --tokens $toks \
    --routing model --variants default token_rows_default token_rows --json $v/bench-$m.json > $v/bench-$m.txt 2>&1
  echo "=== bench $m rc=$? $((SECONDS - start)) s"
  grep -E " (cute|gather|row-weights|dense-cublas)" $v/bench-$m.txt | cut -c1-110
  pack
done
for spec in qwen3-30b-a3b,qwen3-235b-a22b:2048 gpt-oss-120b:8192 mixtral-8x7b:512; do
  m=${spec%%:*}; toks=${spec#*:}
  timeout 100 python3 -m moe2cta.serving_bench --models $m --tokens $toks --backends auto,cute-gathered,cute-token-rows,triton \
    --order interleaved --no-measure-ceilings --time-per-case 0.2 --out $v/layer-${m%%,*}-$toks --progress off --no-plots \
    > $v/layer-${m%%,*}-$toks.txt 2>&1
  echo "=== layer $m T=$toks rc=$? $((SECONDS - start)) s"
  grep -E "^ *[0-9]+ +(prefill|decode)" $v/layer-${m%%,*}-$toks.txt | cut -c1-230
  pack
done
echo "=== done $((SECONDS - start)) s"
