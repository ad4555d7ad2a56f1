# Sourced from the repository root by a device call's script (serving_bench/results/*/runN.sh), with the kernel
# bundle's name as $1 (e.g. c20): unpacks .kpack/$1.tar.xz into .kernels/$1 unless it is there, installs the wheel in
# .whl outside the tree (/tmp/moe2cta-site), activates the CuTe runtime in .bundle/rt, and exports PYTHONPATH,
# MOE2CTA_KERNEL_DIR, MOE2CTA_KERNEL_REQUESTS (kernels the layer asked for and the bundle lacked, under $OUT) and
# PYTHONUNBUFFERED. Sets `repo` to the repository root. Carry: .whl, .bundle/rt, .kpack.
mkdir -p .kernels && { [ -d ".kernels/$1" ] || tar xJf ".kpack/$1.tar.xz" -C .kernels; } || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
# shellcheck disable=SC1091
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:${PYTHONPATH:-} MOE2CTA_KERNEL_DIR=$PWD/.kernels/$1
export MOE2CTA_KERNEL_REQUESTS=$OUT/kernel-requests.jsonl PYTHONUNBUFFERED=1
repo=$PWD
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
