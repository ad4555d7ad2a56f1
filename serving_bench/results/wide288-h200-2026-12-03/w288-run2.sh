#!/usr/bin/env bash
# stop 35, call 2: the 288-row tile's edges (regular against wide288 at 192..320 rows per expert, model routing), and
# the layer before / after the policy on one machine (old / new / old)
set -uo pipefail
out=/tmp/v; mkdir -p $out
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
K=$PWD/.kernels/${BUNDLE:-v28}; repo=$PWD
export MOE2CTA_KERNEL_DIR=$K MOE2CTA_KERNEL_REQUESTS=$out/kernel-requests.jsonl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit --format=csv > $out/gpu.txt
cd /tmp
P="python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle new=$K --routing model"
echo "=== edges gpt-oss"; timeout 200 $P --models gpt-oss-120b --tokens 6144 7168 9216 10240 --variants regular wide288 --json $out/edges-gpt-oss.json > $out/edges-gpt-oss.txt 2>&1; echo rc=$?; grep -E "gemm[12] cute" $out/edges-gpt-oss.txt
echo "=== edges qwen3"; timeout 150 $P --models qwen3-235b-a22b qwen3-30b-a3b --tokens 3072 3584 4608 --variants regular wide288 --json $out/edges-qwen3.json > $out/edges-qwen3.txt 2>&1; echo rc=$?; grep -E "gemm1 cute" $out/edges-qwen3.txt
echo "=== mixtral 1024"; timeout 100 $P --models mixtral-8x7b --tokens 1024 --variants regular wide wide288 --json $out/mixtral-1024.json > $out/mixtral-1024.txt 2>&1; echo rc=$?; grep -E "gemm[12] (cute|dense-c)" $out/mixtral-1024.txt
echo "=== layer-ab"
for v in old new old2; do
    site=/tmp/moe2cta-site-$v; wheel=$repo/.whl; [ "$v" != new ] && wheel=$repo/.whl/prev
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"/moe2cta-*.whl
    PYTHONPATH=$site:$PYTHONPATH timeout 200 python3 -m moe2cta.serving_bench --models gpt-oss-120b,qwen3-235b-a22b,qwen3-30b-a3b \
        --tokens 4096,8192 --backends auto,triton --time-per-case 0.05 --out "$out/layer-ab-$v" --progress off --no-plots \
        > $out/layer-ab-$v.txt 2>&1; echo "$v rc=$?"
done
python3 - <<'PY'
import json, glob
rows = {}
for v in ("old", "new", "old2"):
    for f in glob.glob(f"/tmp/v/layer-ab-{v}/**/*.json", recursive=True):
        d = json.load(open(f))
        for r in d.get("results", d if isinstance(d, list) else []):
            if isinstance(r, dict) and "backend" in r:
                rows.setdefault((r.get("model"), r.get("tokens"), r["backend"]), {})[v] = r.get("median_us") or r.get("us")
for k, v in sorted(rows.items(), key=str):
    print(k, v)
PY
