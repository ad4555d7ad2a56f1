#!/usr/bin/env bash
# combine-atomics probe, call 1: build probe_combine.cu for sm_90a on the device, show which atomic instructions the
# SASS holds, run it twice (the second run is the spread).
set -uo pipefail
d=serving_bench/results/combine-atomics-h200-2026-12-04
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo $d/probe_combine.cu -o /tmp/probe_combine || exit 1
cuobjdump -sass /tmp/probe_combine | grep -oE "\b(RED|ATOM|ATOMG|REDG|REDUX)[A-Z0-9_.]*" | sort | uniq -c > $OUT/sass-atomics.txt
cat $OUT/sass-atomics.txt
/tmp/probe_combine 20 > $OUT/run-a.txt 2>&1; echo "rc a=$?"
/tmp/probe_combine 20 > $OUT/run-b.txt 2>&1; echo "rc b=$?"
cat $OUT/run-a.txt; grep -E "^\||checks" $OUT/run-b.txt
