#!/usr/bin/env bash
# stop 37, call 1: experts split over kernels by their rows (prefill_gemm_bench --expert-classes), model routing:
# deepseek-v3 T=8192 (two routings) and gpt-oss-120b T=8192, beside the regular and wide kernels alone; then ncu of
# the regular and the 288-row kernel on deepseek-v3 T=8192 (DRAM bytes, L2 hits, clock).
set -uo pipefail
start=$SECONDS
D=$OUT; v=/tmp/v; mkdir -p $v
pack() { tar czf $D/v.tgz -C /tmp v; }
K=.kernels/cls
OUT=$v KERNELS=$K PREFILL_MODELS=deepseek-v3 PREFILL_TOKENS="8192 8192" PREFILL_ROUTING=model PREFILL_SUFFIX=-deepseek \
  PREFILL_VARIANTS="default wide160_even wide288_even" PREFILL_CLASSES="w160_w288 w288 w160 tails" \
  LANE0="prefill-gemm" bash serving_bench/device_validate.sh
pack
OUT=$v KERNELS=$K PREFILL_MODELS=gpt-oss-120b PREFILL_TOKENS="8192" PREFILL_ROUTING=model PREFILL_SUFFIX=-gptoss \
  PREFILL_VARIANTS="default regular" PREFILL_CLASSES="w288 tails" \
  LANE0="prefill-gemm" bash serving_bench/device_validate.sh
pack
echo "=== ncu $((SECONDS - start)) s"
OUT=$v KERNELS=$K NCU_CELLS=deepseek-v3:8192 NCU_VARIANTS="regular wide288_even" PREFILL_ROUTING=model PREFILL_SUFFIX=-reg-w288 \
  LANE0="prefill-ncu" bash serving_bench/device_validate.sh
pack
echo "=== done $((SECONDS - start)) s"
