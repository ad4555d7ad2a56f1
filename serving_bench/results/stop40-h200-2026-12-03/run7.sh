#!/usr/bin/env bash
# stop 40, call 7: the final policy (AUTO takes the token rows on the regular kernel and the 160-row wide tile only:
# call 6 measured the 288-row tile on them at 1.25x the gathered copy's layer time): the layer's GPU tests.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
mkdir -p .kernels && tar xJf .kpack/c10.tar.xz -C .kernels || exit 1
repo=$PWD
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$PWD/.kernels/c10
cd /tmp || exit 1
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $repo $repo/tests/test_api.py > $v/api-tests.txt 2>&1
echo "=== api-tests rc=$? $((SECONDS - start)) s"; tail -2 $v/api-tests.txt | cut -c1-240
pack
