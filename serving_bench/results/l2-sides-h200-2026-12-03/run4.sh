#!/usr/bin/env bash
# stop 38, call 4: run 3's 32 failures were eight kernels missing from the bundle (the EVEN wide-tile check variants,
# never listed in gpu-test-kernels.jsonl; now added and built): those tests again, every test_sm90_gpu case whose
# name holds "even".
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
mkdir -p /tmp/k && tar xJf .kpack/c7.tar.xz -C /tmp/k
repo=$PWD
cd /tmp || exit 1
MOE2CTA_KERNEL_DIR=/tmp/k/c7 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl timeout 200 python3 -m pytest -q -m gpu \
  -p no:cacheprovider --rootdir $repo $repo/tests/test_sm90_gpu.py -k "even" > $v/even-tests.txt 2>&1
echo "=== even-tests rc=$? $((SECONDS - start)) s"; tail -3 $v/even-tests.txt | cut -c1-200
tar czf $OUT/v.tgz -C /tmp v
