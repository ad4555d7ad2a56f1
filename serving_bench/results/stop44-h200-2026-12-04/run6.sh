#!/usr/bin/env bash
# stop 44, call 6: probe_levels.py (a grid case's two sample levels against the SM clock), qwen3-235b-a22b T=8192 cute,
# after 2 s and after 0.5 s of rest.
set -uo pipefail
mkdir -p .kernels && tar xJf .kpack/c13.tar.xz -C .kernels || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
repo=$PWD
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$repo/.kernels/c13
cd /tmp || exit 1
for idle in 2 0.5; do
  timeout 90 python3 $repo/serving_bench/results/stop44-h200-2026-12-04/probe_levels.py --idle $idle --seconds 4 \
    --out $OUT/levels-idle$idle.json > $OUT/levels-idle$idle.txt 2>&1
  echo "=== idle $idle rc=$?"; cut -c1-90 $OUT/levels-idle$idle.txt | head -60
done
