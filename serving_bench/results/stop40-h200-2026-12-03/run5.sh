#!/usr/bin/env bash
# stop 40, call 5: probe_tr2.py, one case per process under a 20 s limit (a hang prints "copy ok" and nothing after):
# which of gpt-oss's K (45 K tiles on 4 stages), its epilogue (SWIGLU_OAI + bias) and the tile (288 / 160 rows) the
# wide tile's token-row hang under STATIC needs. Kernels: .kernels/probe40 (probe_tr2.py build).
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
K=$PWD/.kernels/probe40
P=$PWD/serving_bench/results/stop40-h200-2026-12-03/probe_tr2.py
cd /tmp || exit 1
for c in t160_k2048_oai_static t288_k2048_oai_static t288_k2880_plain_static t160_k2880_plain_static t288_k2880_oai_static; do
  timeout 20 python3 $P $c $K >> $v/probe.txt 2>&1
  echo "=== $c rc=$? $((SECONDS - start)) s"; grep "^$c" $v/probe.txt | tail -2 | cut -c1-200
  pack
done
echo "=== done $((SECONDS - start)) s"
