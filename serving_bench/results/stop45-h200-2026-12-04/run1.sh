#!/usr/bin/env bash
# stop 45, call 1 (bundle c14: stop 43's kernels rebuilt from this checkout, 495; wheel of this stop's code):
# (1) the serving bench's GPU tests (the settle test's first run, the new grouped-mm peer in a graph);
# (2) the torch._grouped_mm peer, old (fp32 activation + combine) / new (bf16 ops, bmm combine) / mul-sum combine;
# (3) grid v33 on the new peer (default sampling, settle 0).
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
mkdir -p .kernels && tar xJf .kpack/c14.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c14 LANE0="bench-tests" bash serving_bench/device_validate.sh 2>&1 | grep -E "^===|passed|failed|FAILED" | cut -c1-200
pack
repo=$PWD
( source .bundle/rt/activate.sh
  export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$repo/.kernels/c14
  cd /tmp && timeout 200 python3 $repo/serving_bench/results/stop45-h200-2026-12-04/gmm_peer_ab.py --models all \
    --tokens 1,128,2048,8192,32768 --backends grouped-mm,grouped-mm-fp32,grouped-mm-mulsum --time-per-case 0.05 \
    --out $v/gmm-ab --progress off --no-plots > $v/gmm-ab.txt 2>&1
  echo "=== gmm-ab rc=$? $((SECONDS - start)) s"; grep -A6 "^summary" $v/gmm-ab.txt | cut -c1-200 )
pack
OUT=$v KERNELS=.kernels/c14 LAYER_TAG=v33- LANE0="layer-full" timeout $((585 - SECONDS + start)) bash serving_bench/device_validate.sh 2>&1 | grep -E "^===|auto|worst" | cut -c1-160
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
