#!/usr/bin/env bash
# stop 48, call 6: the final wheel (argument checks of persistent_ctas and config_for_rows added after call 5) on the
# GPU tests of the public API and the sm90 defaults (the CuTe layer path), bundle c16.
set -uo pipefail
start=$SECONDS
v=/tmp/v6; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/c16 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
repo=$PWD
(cd /tmp && timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_api.py" \
    "$repo/tests/test_graphed.py" \
    "$repo/tests/test_sm90_gpu.py" -k "not grid_follows and not matches_twin and not sides") > $v/tests.txt 2>&1
echo "=== tests rc=$? $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/tests.txt | tail -8 | cut -c1-250
tar czf $OUT/v6.tgz -C /tmp v6
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
