#!/usr/bin/env bash
# stop 49, call 2: host us per eager forward by stage (host_overhead --stages), code of stop 48 (bundle c16).
set -uo pipefail
start=$SECONDS
v=/tmp/run2; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16
cd /tmp
for m in qwen3-30b-a3b deepseek-v3 gpt-oss-120b; do
  timeout 150 python3 -m moe2cta.serving_bench.host_overhead --model $m --tokens 1 8 2048 \
    --backends auto triton --calls 60 --stages --json $v/host-$m.json > $v/host-$m.txt 2>&1
  cat $v/host-$m.txt
  echo "=== $m $((SECONDS - start)) s"
done
tar czf $OUT/run2.tgz -C /tmp run2
echo "=== done $((SECONDS - start)) s"
