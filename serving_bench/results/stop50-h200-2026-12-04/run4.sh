#!/usr/bin/env bash
# stop 50, call 4: the final wheel (bundle loading: a broken library named or compiled instead, the bundle directory's
# problem named, path arguments checked; host code only) on the GPU tests that load kernels from bundle c16: the API,
# graphs, tuning, adapters, and the sm90 tests outside the per-variant matrix.
set -uo pipefail
start=$SECONDS
v=/tmp/run4; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
repo=$PWD
cd /tmp
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs \
    "$repo/tests/test_api.py" "$repo/tests/test_graphed.py" "$repo/tests/test_tuning.py" "$repo/tests/test_adapters.py" \
    "$repo/tests/test_sm90_gpu.py" -k "not test_matches_twin and not test_grid_follows and not test_dynamic_sides" \
    > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/tests.txt | tail -10 | cut -c1-250
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
tar czf $OUT/run4.tgz -C /tmp run4
echo "=== done $((SECONDS - start)) s"
