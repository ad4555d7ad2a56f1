#!/usr/bin/env bash
# stop 49, call 4: host us per eager forward by stage, stop 48's code (.whl/base: e4fd56e with this stop's
# host_overhead --stages) against this stop's (.whl), alternated twice (base, new, base, new); bundle c16.
set -uo pipefail
start=$SECONDS
v=/tmp/run4; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base .whl/base/moe2cta-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-new .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16
base_path=$PYTHONPATH
cd /tmp
for round in 1 2; do
  for site in base new; do
    for m in "qwen3-30b-a3b --tokens 1 8 2048 --backends auto triton" "deepseek-v3 --tokens 1 2048 --backends auto" \
             "gpt-oss-120b --tokens 1 2048 --backends auto"; do
      name=$(echo $m | cut -d' ' -f1)
      PYTHONPATH=/tmp/site-$site:$base_path timeout 120 python3 -m moe2cta.serving_bench.host_overhead --model $m \
        --calls 60 --stages --json $v/host-$name-$site-r$round.json > $v/host-$name-$site-r$round.txt 2>&1
      echo "--- $site r$round"; grep "per forward" $v/host-$name-$site-r$round.txt
    done
  done
  echo "=== round $round $((SECONDS - start)) s"
done
tar czf $OUT/run4.tgz -C /tmp run4
echo "=== done $((SECONDS - start)) s"
