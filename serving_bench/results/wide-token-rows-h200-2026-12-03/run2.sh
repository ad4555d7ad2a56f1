#!/usr/bin/env bash
# stop 39, call 2: call 1 hung in the first wide token-row kernel (its producer warpgroup asked setmaxnreg for 48
# registers; with the consumers' 232 that is more than the CTA's launch allocation, so the consumers' increase waited
# forever). The producer keeps 40 and holds the unit's tokens in SMEM. The same steps, shorter limits: (1) the wide
# token-row checks of test_sm90_gpu and test_api's token-row layer test; (2) prefill_gemm_bench (GEMM1's default on the
# gathered copy with the gather launch, the same tile on the token rows, the regular kernel on the token rows); (3) the
# layer, interleaved: auto, cute-gathered, cute-token-rows, Triton control.
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
timeout 90 python3 -m pytest -q -x -m gpu -p no:cacheprovider --rootdir $repo $repo/tests/test_sm90_gpu.py \
  $repo/tests/test_api.py -k "wide and token_rows or test_gpu_cute_gemm1_on_token_rows" > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; tail -4 $v/tests.txt | cut -c1-240
pack
for spec in qwen3-30b-a3b:2048 qwen3-235b-a22b:2048 gpt-oss-120b:8192; do
  m=${spec%%:*}; toks=${spec#*:}
  timeout 75 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle c=$K --models $m --tokens $toks \
    --routing model --variants default token_rows_default token_rows --json $v/bench-$m.json > $v/bench-$m.txt 2>&1
  echo "=== bench $m rc=$? $((SECONDS - start)) s"
  grep -E " (cute|gather|row-weights|dense-cublas)" $v/bench-$m.txt | cut -c1-110
  pack
done
for spec in qwen3-30b-a3b,qwen3-235b-a22b:2048 gpt-oss-120b:8192; do
  m=${spec%%:*}; toks=${spec#*:}
  timeout 80 python3 -m moe2cta.serving_bench --models $m --tokens $toks --backends auto,cute-gathered,cute-token-rows,triton \
    --order interleaved --no-measure-ceilings --time-per-case 0.2 --out $v/layer-${m%%,*}-$toks --progress off --no-plots \
    > $v/layer-${m%%,*}-$toks.txt 2>&1
  echo "=== layer $m T=$toks rc=$? $((SECONDS - start)) s"
  grep -E "^ *[0-9]+ +(prefill|decode)" $v/layer-${m%%,*}-$toks.txt | cut -c1-230
  pack
done
echo "=== done $((SECONDS - start)) s"
