#!/usr/bin/env bash
# stop 47, call 4: the H200's rate for a write-only, a read-only and a copy stream (probe_write_rate.py), to check
# call 3's reading that a write-heavy stream (the gather) runs under the copy rate that sets the floor.
set -uo pipefail
v=/tmp/v4; mkdir -p $v
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $v/gpu.txt
for i in 1 2; do python3 serving_bench/results/stop47-h200-2026-12-04/probe_write_rate.py; done 2>&1 | tee $v/probe.txt
tar czf $OUT/v4.tgz -C /tmp v4
