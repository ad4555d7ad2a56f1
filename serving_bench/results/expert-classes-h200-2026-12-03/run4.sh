#!/usr/bin/env bash
# stop 37, call 4: Raster.EXPERT_TILES for the wide kernel (an expert's token tiles of one n-block run together, so
# an expert of two or more tiles reads each weight tile once; where every expert has one tile it is ALONG_N).
# Checks (four new variants and two ALONG_N twins, four routings) and racecheck, then model-routing GEMM timings
# against ALONG_N and the regular kernel where experts need several 288-row tiles.
set -uo pipefail
start=$SECONDS
D=$OUT; v=/tmp/v; mkdir -p $v
pack() { tar czf $D/v.tgz -C /tmp v; }
K=.kernels/c4
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
NEW="g1_swiglu_wide288_even_expert_tiles_3blocks g2_rowscale_bias_wide288_even_expert_tiles_n320_many
 g1_oai_bias_wide160_expert_tiles_n256_dynamic_many g2_rowscale_wide160_even_expert_tiles_n256_3blocks"
(
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
# shellcheck disable=SC2086
(cd /tmp && timeout 150 python3 $OLDPWD/serving_bench/hopper_gemm_bench.py run --kernel-dir $OLDPWD/$K --skip-bench \
  --only $NEW g1_swiglu_wide288_even_3blocks g2_rowscale_bias_wide288_even_n320_3blocks --json $v/checks.json) \
  > $v/checks.txt 2>&1; echo "checks rc=$? $((SECONDS - start)) s"; tail -14 $v/checks.txt
# shellcheck disable=SC2086
(cd /tmp && timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard python3 \
  $OLDPWD/serving_bench/hopper_gemm_bench.py run --kernel-dir $OLDPWD/$K --skip-bench --routings random --only $NEW) \
  > $v/racecheck.txt 2>&1; echo "racecheck rc=$? $((SECONDS - start)) s"; grep -E "hazard|ERROR|RACECHECK SUMMARY" $v/racecheck.txt | tail -4
)
pack
run() {  # run SUFFIX MODELS TOKENS VARIANTS
  OUT=$v KERNELS=$K PREFILL_MODELS="$2" PREFILL_TOKENS="$3" PREFILL_ROUTING=model PREFILL_SUFFIX=-$1 \
    PREFILL_VARIANTS="$4" LANE0="prefill-gemm" TAIL=0 bash serving_bench/device_validate.sh
  grep -v "^\[#" $v/prefill-gemm-$1.txt | grep -E "cute|dense-bmm" ; pack
}
run deepseek deepseek-v3 "8192 8192 32768" "default wide288_even wide288_even_expert_tiles"
run gptoss gpt-oss-120b "8192 10240" "default regular wide288_even wide288_even_expert_tiles"
run qwen235 qwen3-235b-a22b "4096 8192" "default wide288_even wide288_even_expert_tiles"
run qwen30 qwen3-30b-a3b "8192" "default wide288_even wide288_even_expert_tiles"
run mixtral mixtral-8x7b "2048" "default regular wide288_even_expert_tiles"
echo "=== done $((SECONDS - start)) s"
