#!/usr/bin/env bash
# stop 37, call 2: (1) deepseek-v3 T=8192, model routing, two routings: the 288-row tile scheduled DYNAMIC (units of
# 64-288 rows: STATIC's round-robin leaves some CTAs longer work) and the expert-class scheme with DYNAMIC wide
# launches, beside the regular default; (2) the 160-row tile's ExpertSplit FILL against EVEN (the policy's since
# stop 36) where the policy runs it: mixtral-8x7b T=512, qwen3-30b-a3b and qwen3-235b-a22b T=2048.
set -uo pipefail
start=$SECONDS
D=$OUT; v=/tmp/v; mkdir -p $v
pack() { tar czf $D/v.tgz -C /tmp v; }
K=.kernels/c2
OUT=$v KERNELS=$K PREFILL_MODELS=deepseek-v3 PREFILL_TOKENS="8192 8192" PREFILL_ROUTING=model PREFILL_SUFFIX=-deepseek \
  PREFILL_VARIANTS="default wide288_even wide288_even_dynamic" PREFILL_CLASSES="w160_w288 w160_w288_dynamic" \
  LANE0="prefill-gemm" bash serving_bench/device_validate.sh
pack
OUT=$v KERNELS=$K PREFILL_MODELS=mixtral-8x7b PREFILL_TOKENS="512 512" PREFILL_ROUTING=model PREFILL_SUFFIX=-mixtral \
  PREFILL_VARIANTS="default wide160" LANE0="prefill-gemm" bash serving_bench/device_validate.sh
pack
OUT=$v KERNELS=$K PREFILL_MODELS="qwen3-30b-a3b qwen3-235b-a22b" PREFILL_TOKENS="2048" PREFILL_ROUTING=model \
  PREFILL_SUFFIX=-qwen3 PREFILL_VARIANTS="default wide160" LANE0="prefill-gemm" bash serving_bench/device_validate.sh
pack
echo "=== done $((SECONDS - start)) s"
