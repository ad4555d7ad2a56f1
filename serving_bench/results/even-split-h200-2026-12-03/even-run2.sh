#!/usr/bin/env bash
# stop 36, call 2: the layer before / after (old = e33cbd8's wheel / new / old) where the policy changed (mixtral-8x7b
# GEMM2 at 512 rows per expert on the 288-row tile; EVEN on the 160- and 288-row tiles), the full grid (run v28), then
# every GPU test in the time left. Outputs are packed into $OUT/v.tgz after each step (a call returns few files).
set -uo pipefail
start=$SECONDS
mkdir -p .kernels && tar xJf .kpack/v29.tar.xz -C .kernels || exit 1
D=$OUT; v=/tmp/v; mkdir -p $v
pack() { tar czf $D/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
repo=$PWD; K=$PWD/.kernels/v29
(
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit --format=csv > $v/gpu.txt
cd /tmp
echo "=== layer-ab $(date +%T)"
for t in old new old2; do
    site=/tmp/moe2cta-site-$t; wheel=$repo/.whl; [ "$t" != new ] && wheel=$repo/.whl/prev
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"/moe2cta-*.whl
    PYTHONPATH=$site:$PYTHONPATH timeout 80 python3 -m moe2cta.serving_bench --models mixtral-8x7b,gpt-oss-120b \
        --tokens 2048,8192 --backends auto,triton --time-per-case 0.05 --out "$v/layer-ab-$t" --progress off --no-plots \
        > $v/layer-ab-$t.txt 2>&1; echo "$t rc=$? $(date +%T)"
done
)
pack
echo "=== grid $(date +%T)"
OUT=$v KERNELS=.kernels/v29 LAYER_TAG=v28- LANE0="layer-full" timeout 300 bash serving_bench/device_validate.sh
pack
left=$((585 - (SECONDS - start)))
echo "=== all-tests $(date +%T), ${left} s left"
if [ $left -gt 60 ]; then
    OUT=$v KERNELS=.kernels/v29 ALL_TESTS_LIMIT=$((left - 15)) LANE0="all-tests" bash serving_bench/device_validate.sh
fi
pack
