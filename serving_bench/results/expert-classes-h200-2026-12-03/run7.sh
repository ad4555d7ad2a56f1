#!/usr/bin/env bash
# stop 37, call 7: the layer before / after (old = commit 8c19f06's wheel / new / old) where GEMM1 is a wide tile and
# the gather no longer copies a token row into A's padding rows (api.sm90_gather_padding): qwen3-30b-a3b and
# qwen3-235b-a22b at T=2048, auto beside the Triton control.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
repo=$PWD
(
source .bundle/rt/activate.sh
export PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$repo/.kernels/c4
cd /tmp
for t in old new old2; do
    site=/tmp/moe2cta-site-$t; wheel=$repo/.whl; [ "$t" != new ] && wheel=$repo/.whl/prev
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"/moe2cta-*.whl
    PYTHONPATH=$site:$PYTHONPATH timeout 110 python3 -m moe2cta.serving_bench --models qwen3-30b-a3b,qwen3-235b-a22b \
        --tokens 2048 --backends auto,triton --time-per-case 0.1 --out "$v/layer-ab-$t" --progress off --no-plots \
        > $v/layer-ab-$t.txt 2>&1; echo "$t rc=$? $((SECONDS - start)) s"
    grep -E "^ +2048" $v/layer-ab-$t.txt
done
)
tar czf $OUT/v.tgz -C /tmp v
