#!/usr/bin/env bash
# stop 50, call 2 (one H200; call 1 asked for two and was refused): every GPU test on this stop's wheel and bundle
# c16, one pytest run; it includes the two GPU tests this stop tightened (the programmatic launch chain against an
# fp64 reference; the failed capture's exception narrowed to the CUDA error).
set -uo pipefail
start=$SECONDS
v=/tmp/run2; mkdir -p $v
mkdir -p .kernels && { [ -d .kernels/c16 ] || tar xJf .kpack/c16.tar.xz -C .kernels; } || exit 1
OUT=$v KERNELS=.kernels/c16 ALL_TESTS_LIMIT=${LIMIT:-570} LANE0="all-tests" bash serving_bench/device_validate.sh > /dev/null 2>&1
echo "=== all-tests $((SECONDS - start)) s"; grep -E "FAILED|ERROR|passed|failed" $v/all-tests.txt | tail -14 | cut -c1-250
source .bundle/rt/activate.sh  # the two tightened tests again, by name (-v), on the wheel device_validate installed
repo=$PWD
(cd /tmp && PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$repo/.kernels/c16 timeout 120 python3 -m pytest -v \
    -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_sm90_gpu.py::test_programmatic_launch_chain_is_bit_equal" \
    "$repo/tests/test_graphed.py::test_gpu_failed_capture_leaves_the_stream_and_the_generator_as_they_were") > $v/tightened.txt 2>&1
echo "=== tightened rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $v/tightened.txt | cut -c1-250
tar czf $OUT/run2.tgz -C /tmp run2
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
