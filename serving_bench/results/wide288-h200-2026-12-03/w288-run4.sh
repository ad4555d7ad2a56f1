#!/usr/bin/env bash
# stop 35, call 4: every GPU test on the final kernels (the bundle plus the two 288-row kernels of test_api's
# 1024-token cases, which the policy now picks), unpacked from .kpack/v28.tar.xz
set -uo pipefail
mkdir -p .kernels && tar xJf .kpack/v28.tar.xz -C .kernels || exit 1
export OUT=/tmp/v KERNELS=.kernels/v28 ALL_TESTS_LIMIT=540
LANE0="all-tests" bash serving_bench/device_validate.sh
