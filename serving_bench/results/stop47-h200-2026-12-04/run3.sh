#!/usr/bin/env bash
# stop 47, call 3: the gather's kernel variants at the layer's prefill shapes (permute_bench): each token's row loaded
# once for its k slots (TOKEN_LOADS) and the stores' cache modifier (.cs), at 8 and 16 slots per program, beside the
# launch-parameter grid; every output compared bit for bit with the default's.
set -uo pipefail
# (the bench runs from /tmp: the checkout's moe2cta/ folder would shadow the installed package)
start=$SECONDS
v=/tmp/v3; mkdir -p $v
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
export PYTHONPATH=/tmp/moe2cta-site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $v/gpu.txt
(cd /tmp && timeout 500 python3 -m moe2cta.serving_bench.permute_bench --json $v/permute.json --cells qwen3-30b-a3b:2048 \
    qwen3-30b-a3b:8192 qwen3-235b-a22b:2048 qwen3-235b-a22b:8192 deepseek-v3:8192 gpt-oss-120b:8192 \
    gpt-oss-120b:32768 mixtral-8x7b:8192) > $v/permute.txt 2>&1
echo "=== permute rc=$? $((SECONDS - start)) s"
cat $v/permute.txt | grep -v Warning | tail -20
python3 - <<'PY'
import json
d = json.load(open("/tmp/v3/permute.json"))["results"]
for r in d:
    if r["kernel"] == "gather" and (r.get("loads") or r["default"]):
        print(f'{r["model"]:16s} {r["tokens"]:6d} bs {r["block_s"]:2d} {r.get("loads", "slot"):5s} {r.get("store", "") or "-":4s} '
              f'{r["us"]:8.1f} us floor {r["floor_us"]:7.1f} identical {r["identical"]}')
PY
tar czf $OUT/v3.tgz -C /tmp v3
echo "=== done $((SECONDS - start)) s"
