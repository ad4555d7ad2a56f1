#!/usr/bin/env bash
# stop 45, call 5 (same wheel and bundle c14): GEMM1 on a gathered copy against GEMM1 on the token rows
# (backends cute-gathered / cute-token-rows, the two sides of Gemm1Input.AUTO; auto beside them) at every prefill cell,
# first under sustained load (settle 0.5 s per case), then in the grid's default windows, on one machine start.
# Stop 38's choice (token rows only where I <= 1024) was measured in the default windows only.
set -uo pipefail
start=$SECONDS
v=/tmp/v5; mkdir -p $v
mkdir -p .kernels && [ -d .kernels/c14 ] || tar xJf .kpack/c14.tar.xz -C .kernels || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$PWD/.kernels/c14 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
cd /tmp || exit 1
for s in 0.5 0; do
  timeout $((560 - SECONDS + start)) python3 -m moe2cta.serving_bench --models all --tokens 2048,8192,32768 \
    --backends auto,cute-gathered,cute-token-rows --time-per-case 0.05 --settle-seconds $s --out $v/a1-settle$s \
    --progress off --no-plots > $v/a1-settle$s.txt 2>&1
  echo "=== settle $s rc=$? $((SECONDS - start)) s"; grep -A6 "^summary" $v/a1-settle$s.txt | cut -c1-150
  tar czf $OUT/v5.tgz -C /tmp v5
done
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
