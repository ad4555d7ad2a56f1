#!/usr/bin/env bash
# stop 43: deepseek-v3's grid cells (T = 1..32768, auto / triton / cute / torch._grouped_mm) under its own router (the
# grid's: sigmoid, group-limited, random correction bias) and under the peer figures' routing (softmax -> top-k ->
# renormalize, `--router peer`), alternated twice on one machine start: model, peer, model, peer.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c12.tar.xz -C .kernels || exit 1
repo=$PWD
(
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$repo/.kernels/c12
cd /tmp || exit 1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > $v/gpu.txt 2>&1
for tag in model1:model peer1:peer model2:model peer2:peer; do
  name=${tag%%:*} router=${tag#*:}
  t0=$SECONDS
  timeout 150 python3 -m moe2cta.serving_bench --models deepseek-v3 --full --router $router \
    --backends auto,triton,cute,grouped-mm --order sequential --time-per-case 0.05 --out $v/deepseek-$name \
    --progress off --no-plots > $v/deepseek-$name.txt 2>&1
  echo "=== $name rc=$? $((SECONDS - t0)) s"
  grep -E "^\| *(1|8|32|128|512|2048|8192|32768) \||decode|prefill|worst" $v/deepseek-$name.txt | cut -c1-160 | tail -14
done
)
cp -r $v/* $OUT/ 2>/dev/null
echo "=== done $((SECONDS - start)) s"
