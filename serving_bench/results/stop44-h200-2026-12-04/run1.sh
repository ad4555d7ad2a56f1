#!/usr/bin/env bash
# stop 44, call 1 (HEAD 3833659 wheel, bundle c13 = stop 43's kernels): (1) grid v32, the full layer grid on stop 43's
# code (expert classes at deepseek-v3 T=8192, the regular kernels' empty-unit skip); (2) compute-sanitizer memcheck and
# racecheck on the expert-classes layer test (the regular kernel's new skip branch runs there: its class launch sees
# the other classes' experts with zero counts), each under the time left.
set -uo pipefail
start=$SECONDS
v=/tmp/v; mkdir -p $v
pack() { tar czf $OUT/v.tgz -C /tmp v; }
mkdir -p .kernels && tar xJf .kpack/c13.tar.xz -C .kernels || exit 1
OUT=$v KERNELS=.kernels/c13 LAYER_TAG=v32- LANE0="layer-full" timeout 230 bash serving_bench/device_validate.sh 2>&1 | grep -E "^===|auto|worst" | cut -c1-160
echo "=== grid $((SECONDS - start)) s"
pack
repo=$PWD
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1 MOE2CTA_KERNEL_DIR=$repo/.kernels/c13 MOE2CTA_KERNEL_REQUESTS=$v/kernel-requests.jsonl
cd /tmp || exit 1
t=tests/test_api.py::test_gpu_cute_expert_classes_match_reference_and_replay_in_a_graph
left=$((560 - SECONDS + start)); [ $left -gt 150 ] && left=150
timeout $left compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider --rootdir $repo $repo/$t > $v/memcheck-classes.txt 2>&1
echo "=== memcheck rc=$? $((SECONDS - start)) s"; grep -E "ERROR SUMMARY|passed|failed" $v/memcheck-classes.txt | tail -3
pack
left=$((585 - SECONDS + start))
timeout $left compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider --rootdir $repo $repo/$t > $v/racecheck-classes.txt 2>&1
echo "=== racecheck rc=$? $((SECONDS - start)) s"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed" $v/racecheck-classes.txt | tail -3
pack
[ -f $v/kernel-requests.jsonl ] && { echo "kernels missing:"; cut -c1-250 $v/kernel-requests.jsonl | head; }
echo "=== done $((SECONDS - start)) s"
