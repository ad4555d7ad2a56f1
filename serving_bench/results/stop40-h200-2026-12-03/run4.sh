#!/usr/bin/env bash
# stop 40, call 4: where the time goes in the prefill cells above 1.35x of the floor in v29 (kernel times of the
# cute layer under torch.profiler, graph replays): deepseek-v3 T=8192, qwen3-30b-a3b T=2048 / 8192, gpt-oss-120b
# T=32768, qwen3-235b-a22b T=8192.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
mkdir -p .kernels && tar xJf .kpack/c10.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c10 PROFILE_CELLS="deepseek-v3:8192 qwen3-30b-a3b:2048 qwen3-30b-a3b:8192 gpt-oss-120b:32768 qwen3-235b-a22b:8192" \
  PROFILE_BACKENDS="cute" PROFILE_MODES="graph" TAIL=20 LANE0="layer-profile" timeout 420 bash serving_bench/device_validate.sh
pack
echo "=== done $((SECONDS - start)) s"
