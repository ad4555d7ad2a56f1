#!/usr/bin/env bash
# stop 49, call 6: host us per eager forward, stop 48's code (.whl/base) against this stop's (.whl), five rounds
# alternated (base, new, base, new, ...): the host's own speed drifts by up to 2x between runs of one process.
set -uo pipefail
start=$SECONDS
v=/tmp/run6; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base .whl/base/moe2cta-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-new .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16
base_path=$PYTHONPATH
cd /tmp
for round in 1 2 3 4 5; do
  for site in base new; do
    for m in "qwen3-30b-a3b --tokens 1 8 2048" "gpt-oss-120b --tokens 1 2048"; do
      name=$(echo $m | cut -d' ' -f1)
      PYTHONPATH=/tmp/site-$site:$base_path timeout 100 python3 -m moe2cta.serving_bench.host_overhead --model $m \
        --backends auto --calls 60 --json $v/host-$name-$site-r$round.json > $v/host-$name-$site-r$round.txt 2>&1
    done
  done
  echo "=== round $round $((SECONDS - start)) s"
  [ $((SECONDS - start)) -gt 420 ] && break
done
tar czf $OUT/run6.tgz -C /tmp run6
echo "=== done $((SECONDS - start)) s"
