#!/usr/bin/env bash
# stop 35, call 3: the full grid (run v27) with the 288-row policy, the sm90 / layer GPU tests on the final kernels,
# and the policy's lower edge (160 rows per expert). The bundle travels as .kpack/v28.tar.xz (27 MB of kernels, 1.3 MB
# packed) and is unpacked into .kernels/v28.
set -uo pipefail
mkdir -p .kernels && tar xJf .kpack/v28.tar.xz -C .kernels || exit 1
export OUT=/tmp/v KERNELS=.kernels/v28 LAYER_TAG=v27-
LANE0="layer-full sm90-tests tests graphed-tests" timeout 480 bash serving_bench/device_validate.sh
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$PWD/.kernels/v28
echo "=== edges 160"; (cd /tmp && timeout 90 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle new=$MOE2CTA_KERNEL_DIR \
    --routing model --models gpt-oss-120b qwen3-235b-a22b --tokens 5120 2560 --variants regular wide288 wide160 \
    --json $OUT/edges-160.json > $OUT/edges-160.txt 2>&1); echo rc=$?; grep -E "gemm[12] cute" $OUT/edges-160.txt
