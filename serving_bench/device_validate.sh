#!/usr/bin/env bash
# One call on a lent H200: the GPU validation steps that need no full benchmark grid, in priority order,
# each under its own time limit so that a slow step cannot take the others with it. Logs go to $OUT.
# Prepared here (no GPU), all git-ignored and named in `carry`:
#   python3 -m pip wheel --no-deps --no-build-isolation -w .whl .
#   python serving_bench/hopper_gemm_bench.py build --out .kernels/all-sm90   (+ aot / tune builds into it)
#   shared/gpu/runtime-bundle.sh .bundle/rt
# The carry holds at most 64 MB with the repository (~20 MB) and the runtime (17 MB): a bundle of every variant
# no longer fits. The layer grid needs only `python -m moe2cta.aot build --model M --arch sm_90a --out DIR` for the
# five presets (109 kernels, 7 MB); the GPU tests' small shapes need 204 more kernels beside them, listed in
# serving_bench/gpu-test-kernels.jsonl: `python -m moe2cta.aot build --requests serving_bench/gpu-test-kernels.jsonl
# --arch sm_90a --out DIR` (into the same DIR; stop 25's .kernels/final is that bundle, 21 MB).
# Usage there: LANE0="pingpong racecheck" LANE1="tests layer" bash serving_bench/device_validate.sh
# Each lane runs its steps in order on its own GPU (lane 1 on GPU 1 when there are two, else after lane 0).
set -uo pipefail
out=${OUT:-/tmp/moe2cta-validate}
mkdir -p "$out"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/moe2cta-site .whl/moe2cta-*.whl || exit 1
# shellcheck disable=SC1091
source .bundle/rt/activate.sh
export PYTHONPATH=/tmp/moe2cta-site:$PYTHONPATH PYTHONUNBUFFERED=1
kdir=$PWD/${KERNELS:-.kernels/all-sm90}
# kernels a step needs and the bundle lacks are recorded there: `python -m moe2cta.aot build --requests FILE
# --arch sm_90a --out DIR` here builds exactly them for the next call
export MOE2CTA_KERNEL_DIR=$kdir MOE2CTA_TUNING_CACHE=$out/tuning.json MOE2CTA_KERNEL_REQUESTS=$out/kernel-requests.jsonl
repo=$PWD
# the bundle's provenance first: every kernel built from the wheel's kernel sources (else the layer refuses CUTE)
(cd /tmp && python3 -m moe2cta aot check "$kdir" > "$out/aot-check.txt" 2>&1) \
    || { echo "=== aot check failed: $(tail -1 "$out/aot-check.txt")"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$out/gpu.txt"
step() {  # step NAME SECONDS COMMAND...: run, log, print the tail
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    (cd /tmp && timeout "$limit" "$@") > "$out/$name.txt" 2>&1
    local rc=$?
    echo "=== $name rc=$rc $((SECONDS - t0)) s"; grep -v '^\[#' "$out/$name.txt" | tail -"${TAIL:-12}"
}
run_step() { case $1 in
pingpong)  # PINGPONG consumers: checks (incl. several units per CTA), then timings beside the defaults
    step pingpong 120 python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" \
        --tokens 2048 8192 --json "$out/pingpong.json" ;;
swapped)  # every check variant (swapped-operand decode kernels included), then decode-size timings
    step swapped 200 python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" --no-pingpong \
        --tokens 1 16 64 256 512 1024 --json "$out/swapped.json" ;;
swapped-bench)  # timings only, at the sizes where the swapped / regular crossover lies
    step swapped-bench 120 python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" --no-pingpong \
        --skip-check --tokens 256 512 --json "$out/swapped-bench.json" ;;
triton-decode-gemm)  # the Triton GEMMs' defaults at the swapped step's sizes, for comparison
    step triton-decode-gemm 120 python3 -m moe2cta.serving_bench.triton_gemm_bench --defaults-only --models qwen3-30b-a3b \
        --tokens 1 16 64 256 512 1024 --out "$out/triton-decode-gemm.json" ;;
racecheck-swapped)
    step racecheck-swapped 100 compute-sanitizer --tool racecheck --racecheck-report hazard \
        python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" --skip-bench --routings random \
        --only g1_swiglu_swapped16 g1_oai_bias_swapped32_dynamic g2_rowscale_bias_swapped16 ;;
layer-cute-decode)  # decode cells, cute (swapped-operand kernels) beside triton
    step layer-cute-decode 200 python3 -m moe2cta.serving_bench --models mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b \
        --tokens 1,8,32,128,512 --backends triton,cute --time-per-case 0.05 --out "$out/layer-cute-decode" --progress off --no-plots ;;
racecheck)  # shared-memory hazards on small configs of every scheduling / unit / consumer variant
    step racecheck 150 compute-sanitizer --tool racecheck --racecheck-report hazard \
        python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" --skip-bench \
        --routings random --only ${RACECHECK_ONLY:-g1_swiglu_single g2_rowscale_pair g1_swiglu_dynamic g1_swiglu_grouped3_dynamic \
        x_g2_rowscale_bias_pingpong_dynamic_many g1_swiglu_pair_dynamic g1_oai_bias_pair_dynamic_many} ;;
tests)
    step tests 180 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_api.py" \
        "$repo/tests/test_serving_bench.py" "$repo/tests/test_triton_gemm.py" "$repo/tests/test_tuning.py" \
        "$repo/tests/test_power.py" ;;
all-tests)  # every GPU test in one pytest run (the tiers above, together; needs the GPU-test bundle)
    step all-tests ${ALL_TESTS_LIMIT:-560} python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests" ;;
tune)
    step tune 90 python3 -m moe2cta.tune_cli run --model qwen3-30b-a3b --arch sm_90a --kernel-dir "$kdir" \
        --cache "$out/tuning-h200.json" --json "$out/tune.json" --verbose ;;
tuning-tests)  # the tuned layer and `moe2cta tune` on the GPU (kernels: the tune bundles plus the tuned-layer test's)
    step tuning-tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_tuning.py" \
        "$repo/tests/test_api.py" -k "tuning" ;;
tune-all)  # autotune each preset at the buckets of its bench cells (T = 512..32768), rows spread as routing spreads
    # them; entries go to $MOE2CTA_TUNING_CACHE. The bundle: `moe2cta tune build --model M --buckets ...` per preset
    for spec in ${TUNE_SPECS:-qwen3-30b-a3b:128,512,2048 qwen3-235b-a22b:128,512,2048 mixtral-8x7b:128,512,2048 \
                 deepseek-v3:64,256,1024 gpt-oss-120b:64,256,1024}; do
        m=${spec%%:*} buckets=${spec#*:}
        # shellcheck disable=SC2086
        TAIL=10 step "tune-$m" 150 python3 -m moe2cta.tune_cli run --model "$m" --arch sm_90a --kernel-dir "$kdir" \
            --rows routed --buckets ${buckets//,/ } --json "$out/tune-$m.json" --verbose
    done ;;
layer-tuned)  # the layer untuned and with that cache, side by side in one run per model
    for m in ${LAYER_MODELS:-mixtral-8x7b qwen3-30b-a3b qwen3-235b-a22b deepseek-v3 gpt-oss-120b}; do
        TAIL=6 step "layer-tuned-$m" 170 python3 -m moe2cta.serving_bench --models "$m" \
            --tokens "${LAYER_TUNED_TOKENS:-512,2048,8192,32768}" --backends cute,cute-tuned \
            --time-per-case 0.05 --out "$out/layer-tuned-$m" --progress off --no-plots
    done ;;
placement)  # equal layer copies at other addresses, interleaved: placement against drift (layer_placement_probe)
    for spec in ${PLACEMENT_SPECS:-mixtral-8x7b:2048,8192 qwen3-30b-a3b:2048,8192 qwen3-235b-a22b:2048,8192 \
                 gpt-oss-120b:8192 deepseek-v3:8192}; do
        m=${spec%%:*} tokens=${spec#*:}
        # shellcheck disable=SC2086
        TAIL=4 step "placement-$m" 150 python3 -m moe2cta.serving_bench.layer_placement_probe --models "$m" \
            --tokens ${tokens//,/ } --copies "${PLACEMENT_COPIES:-3}" --json "$out/placement-$m.json"
    done ;;
router)
    step router 100 python3 -m moe2cta.serving_bench.router_bench --experts 128 --top-k 8 \
        --tokens 1 512 4096 32768 --profile --out "$out/router" ;;
layer)  # decode cells where the launch chain matters (dependent launch, slot gather)
    step layer 80 python3 -m moe2cta.serving_bench --models qwen3-30b-a3b,gpt-oss-120b,qwen3-235b-a22b \
        --tokens 1,8,128 --backends triton,grouped-mm --time-per-case 0.05 --out "$out/layer" --progress off --no-plots ;;
trace)  # the serving trace scenario and the torch-loop backend, then the no-argument default
    step trace 80 python3 -m moe2cta.serving_bench --models qwen3-30b-a3b --scenario trace --backends triton,cute,torch-loop \
        --trace-requests 64 --time-per-case 0.05 --out "$out/trace" --progress off
    step default 80 python3 -m moe2cta.serving_bench --out "$out/default" --progress off ;;
sweep)  # Triton GEMM configurations at prefill sizes (every model), and the mixed cells
    step sweep 200 python3 -m moe2cta.serving_bench.triton_gemm_bench --wide --routings 2 --tokens 8192 \
        --models qwen3-30b-a3b mixtral-8x7b qwen3-235b-a22b deepseek-v3 gpt-oss-120b --out "$out/sweep.json" ;;
sweep2)
    step sweep2 150 python3 -m moe2cta.serving_bench.triton_gemm_bench --wide --routings 2 --tokens 512 2048 \
        --models mixtral-8x7b deepseek-v3 --out "$out/sweep2.json" ;;
ridge)  # cells where weight streaming and the MMA rate both bind: 128-deep K steps, HALF tails
    step ridge 230 python3 -m moe2cta.serving_bench.triton_gemm_bench --ridge --routings 2 --tokens 512 2048 8192 \
        --models mixtral-8x7b qwen3-30b-a3b deepseek-v3 gpt-oss-120b --out "$out/ridge.json" ;;
triton-tests)
    step triton-tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_triton_gemm.py" ;;
memcheck-triton)  # compute-sanitizer memcheck on the Triton GEMM GPU tests with TMA loads (both w13 layouts, N tails)
    step memcheck-triton 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
        -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_triton_gemm.py" -k "tma_tile_load_gpu or activations_bias" ;;
router-gather-tests)  # the gather (with the GEMM2 row weights it writes) and combine tests of the router tier, on the GPU
    step router-gather-tests 120 python3 -m pytest -q -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_router_triton.py" \
        -k "gather or combine" ;;
sm90-tests)
    step sm90-tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_sm90_gpu.py" ;;
router-tests)
    step router-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_router_gpu.py" ;;
router-variants)
    step router-variants 120 python3 -m moe2cta.serving_bench.router_bench --experts 128 --top-k 8 \
        --tokens 1 512 4096 32768 --variants v2 v3 v3,slots=512 v3,slots=2048 v3,bt=8,warps=2 v3,bt=32,warps=8 \
        --profile --out "$out/router-v3" ;;
router-grouped)  # deepseek-v3's grouped routing: the [T, G, E / G] group view (AUTO) against one pass per group
    step router-grouped 150 python3 -m moe2cta.serving_bench.router_bench --routing-model deepseek-v3 \
        --tokens 1 32 512 4096 32768 --variants v3 v3,groups=per_group --out "$out/router-grouped" ;;
layer-full)  # the full grid (5 models x T in 1..32768), one invocation per model so partial results survive
    # (LAYER_SETTLE=S: each case replays untimed for S seconds first, so that its samples see the sustained clock;
    # LAYER_ROUTER=peer: every model routed as the peer figures were, softmax -> top-k -> renormalize)
    for m in ${LAYER_MODELS:-mixtral-8x7b qwen3-30b-a3b qwen3-235b-a22b deepseek-v3 gpt-oss-120b}; do
        TAIL=3 step "layer-${LAYER_TAG:-}$m" 170 python3 -m moe2cta.serving_bench --models "$m" --full \
            --backends "${LAYER_BACKENDS:-auto,triton,cute,grouped-mm,dense-ceiling}" --order "${LAYER_ORDER:-sequential}" \
            --time-per-case 0.05 --settle-seconds "${LAYER_SETTLE:-0}" --router "${LAYER_ROUTER:-model}" \
            --out "$out/layer-${LAYER_TAG:-}$m" --progress off --no-plots
    done ;;
layer-orders)  # the full grid per LAYER_ORDERS entry TAG:ORDER (default: interleaved, then one backend at a time)
    for tag_order in ${LAYER_ORDERS:-i1:interleaved seq:sequential}; do
        LAYER_TAG=${tag_order%%:*}- LAYER_ORDER=${tag_order#*:} run_step layer-full
    done ;;
pool-tests)  # GEMM graphs sharing a memory pool with other graphs, DYNAMIC launches on two streams, the Triton GEMMs
    step pool-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_graph_pools.py" \
        "$repo/tests/test_triton_gemm.py" "$repo/tests/test_sm90_gpu.py::test_dynamic_launches_on_concurrent_streams" ;;
bench-tests)  # the serving benchmark's GPU tests (graph timing, interleaved timing)
    step bench-tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_serving_bench.py" ;;
layer-ab)  # the layer's prefill cells under two code versions on one machine: the installed wheel with $kdir, and
    # AB_OLD_WHEEL (a wheel directory) with AB_OLD_KERNELS, in the order old, new, old (the repeat shows the drift);
    # each case settles for AB_SETTLE seconds first (sustained medians repeat about twice as well: stop 45; AB_SETTLE=0
    # leaves the option out, for wheels older than stop 44's)
    settle_args=(); [ "${AB_SETTLE:-0.5}" != 0 ] && settle_args=(--settle-seconds "${AB_SETTLE:-0.5}")
    for v in old new old2; do
        site=/tmp/moe2cta-site-$v wheel=$repo/.whl kernels=$kdir
        [ "$v" != new ] && wheel=$repo/$AB_OLD_WHEEL kernels=$repo/$AB_OLD_KERNELS
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"/moe2cta-*.whl
        PYTHONPATH=$site:$PYTHONPATH MOE2CTA_KERNEL_DIR=$kernels TAIL=3 step "layer-ab-$v" 250 python3 -m moe2cta.serving_bench \
            --models "${AB_MODELS:-mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b}" \
            --tokens "${AB_TOKENS:-2048,8192,32768}" --backends auto,triton --time-per-case 0.05 \
            "${settle_args[@]}" --out "$out/layer-ab-$v" \
            --progress off --no-plots
    done ;;
layer-decode)  # decode cells of the three models with the smallest floors at T=1
    step layer-decode 60 python3 -m moe2cta.serving_bench --models qwen3-30b-a3b,gpt-oss-120b,qwen3-235b-a22b --tokens 1,8 \
        --backends triton --time-per-case 0.05 --out "$out/layer-decode" --progress off --no-plots ;;
router-default)
    step router-default 60 python3 -m moe2cta.serving_bench.router_bench --experts 128 --top-k 8 --tokens 1 512 4096 32768 \
        --out "$out/router-default" ;;
wide-checks)  # the wide swapped-operand kernels (and the swapped decode kernels beside them) over the four routings
    step wide-checks 200 python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" --skip-bench \
        --no-pingpong --only ${WIDE_CHECKS:-g1_swiglu_wide256 g1_gelu_wide128_step16 g1_oai_bias_wide256_dynamic \
        g1_swiglu_wide256_dynamic_many g2_rowscale_bias_wide256_dynamic_many g2_plain_wide256_n64_along_m \
        g2_rowscale_wide256_one_size g1_swiglu_wide256_decode g1_swiglu_swapped16 g1_oai_bias_swapped32_dynamic \
        g2_rowscale_bias_swapped16 g2_rowscale_swapped16_dynamic_many g1_swiglu_wide128_n256 \
        g1_oai_bias_wide128_n256_dynamic_many g2_rowscale_bias_wide128_n256_along_m \
        g2_rowscale_wide128_n256_step16_dynamic_many g1_swiglu_wide160_n256 g1_oai_bias_wide160_n256_dynamic_many \
        g2_rowscale_bias_wide160_n256_along_m g2_rowscale_wide160_n256_step16_dynamic_many g1_gelu_wide160_n128 \
        g2_plain_wide160_n128_decode g1_swiglu_wide288_3blocks g1_oai_bias_wide288_dynamic_many \
        g2_rowscale_bias_wide288_n320_3blocks g1_oai_bias_wide288_n320_along_m g2_rowscale_wide288_step16_dynamic_many \
        g1_gelu_wide288_n64 g2_plain_wide288_decode g2_rowscale_bias_wide256_n320_dynamic \
        g1_swiglu_wide288_even_3blocks g1_oai_bias_wide288_even_dynamic_many g2_rowscale_bias_wide288_even_n320_3blocks \
        g2_rowscale_wide288_even_step16_dynamic_many g2_plain_wide288_even_decode g1_swiglu_wide160_even_n256 \
        g2_rowscale_bias_wide160_even_n256_along_m_3blocks g1_gelu_wide256_even_dynamic_many} --json "$out/wide-checks.json" ;;
racecheck-wide)  # shared-memory hazards of the wide kernels (per-unit transaction bytes, partial token tiles)
    step racecheck-wide 150 compute-sanitizer --tool racecheck --racecheck-report hazard \
        python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" --skip-bench --no-pingpong \
        --routings random zero_experts --only ${RACECHECK_WIDE:-g1_oai_bias_wide256_dynamic g2_plain_wide256_n64_along_m \
        g1_gelu_wide128_step16 g1_swiglu_wide128_n256 g2_rowscale_bias_wide128_n256_along_m g1_swiglu_wide160_n256 \
        g2_rowscale_bias_wide160_n256_along_m g1_gelu_wide160_n128 g1_swiglu_wide288_3blocks \
        g2_rowscale_bias_wide288_n320_3blocks g1_oai_bias_wide288_n320_along_m g1_gelu_wide288_n64 \
        g1_swiglu_wide288_even_3blocks g2_rowscale_bias_wide288_even_n320_3blocks g1_swiglu_wide160_even_n256} ;;
memcheck-wide)
    step memcheck-wide 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" --skip-bench --no-pingpong \
        --routings zero_experts one_expert --only ${MEMCHECK_ONLY:-g1_oai_bias_wide256_dynamic g2_rowscale_wide256_one_size \
        g1_swiglu_wide160_n256 g2_rowscale_wide160_n256_step16_dynamic_many g2_rowscale_bias_wide288_n320_3blocks \
        g1_oai_bias_wide288_n320_along_m g2_rowscale_wide288_step16_dynamic_many \
        g2_rowscale_bias_wide288_even_n320_3blocks g2_rowscale_bias_wide160_even_n256_along_m_3blocks g2_plain_wide288_even_decode} ;;
fuse-tail-checks)  # the FUSE_TAIL / SPLIT_TAIL kernels (cute_fused_tail_backend.py) over the four routings, no timings
    step fuse-tail-checks 200 python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" --skip-bench \
        --no-pingpong --only ${FUSE_CHECKS:-g1_swiglu_fuse_tail g1_swiglu_fuse_tail_expert_grouped3_n256_dynamic_many \
        g1_oai_bias_fuse_tail_n192_dynamic_many g1_gelu_fuse_tail_fp16_grouped3_dynamic \
        g2_rowscale_bias_fuse_tail_n256_tail_dynamic_many g2_rowscale_fuse_tail_expert_grouped2_many \
        g2_plain_fuse_tail_decode g1_swiglu_fuse_tail_k32_expert_grouped3_n256_dynamic_many \
        g2_rowscale_bias_fuse_tail_k32_n256_tail_many g1_swiglu_split_tail_expert_grouped3_n256_dynamic_3blocks \
        g1_oai_bias_split_tail_dynamic_3blocks g2_rowscale_bias_split_tail_n192_3blocks g2_rowscale_bias_split_tail_n256_tail_3blocks \
        g2_rowscale_split_tail_expert_grouped2_dynamic_many g1_gelu_split_tail_fp16_k32_3blocks} \
        --json "$out/fuse-tail-checks.json" ;;
checks)  # every check variant (regular, swapped, ping-pong) over the four routings, no timings
    step checks 120 python3 "$repo/serving_bench/hopper_gemm_bench.py" run --kernel-dir "$kdir" --skip-bench \
        --json "$out/checks.json" ;;
prefill-gemm)  # prefill-size GEMMs of every model: CuTe bundles side by side (EXTRA_BUNDLES='label=dir ...' beside $kdir),
    # the Triton default and dense cuBLAS on the same total shape; PREFILL_CLASSES: expert-class schemes too
    base=(); for b in ${EXTRA_BUNDLES:-}; do base+=(--bundle "${b%%=*}=$repo/${b#*=}"); done
    # (an older bundle beside the new one was built from other kernel sources: loaded with a warning, not refused)
    # shellcheck disable=SC2086
    MOE2CTA_KERNEL_PROVENANCE=${EXTRA_BUNDLES:+warn} \
    step "prefill-gemm${PREFILL_SUFFIX:-}" 400 python3 -m moe2cta.serving_bench.prefill_gemm_bench "${base[@]}" --bundle "new=$kdir" \
        --tokens ${PREFILL_TOKENS:-2048 8192} --variants ${PREFILL_VARIANTS:-default} --routing ${PREFILL_ROUTING:-random} \
        --padding ${PREFILL_PADDING:-random} ${PREFILL_CLASSES:+--expert-classes $PREFILL_CLASSES} \
        ${PREFILL_MODELS:+--models $PREFILL_MODELS} --json "$out/prefill-gemm${PREFILL_SUFFIX:-}.json" ;;
prefill-power)  # sustained board power, SM clock and energy per useful FLOP: the floor's matmul, then the CuTe GEMMs
    # beside dense cuBLAS on the same total shape (serving_bench/power.py)
    step power-tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_power.py"
    step floor-power 60 python3 -m moe2cta.serving_bench.power --seconds 3 --json "$out/floor-power.json"
    # shellcheck disable=SC2086
    step prefill-power 420 python3 -m moe2cta.serving_bench.prefill_gemm_bench --bundle "new=$kdir" \
        --tokens ${POWER_TOKENS:-2048 8192} ${POWER_MODELS:+--models $POWER_MODELS} --sustain "${POWER_SECONDS:-2.5}" \
        --json "$out/prefill-power.json" ;;
power-model)  # the power-capped card: idle, a DRAM read and copy stream, the floor's matmul, all sustained, and
    # with POWER_STREAM_PJ each preset's prefill bound by the energy model against the floor (serving_bench/power.py)
    step power-tests 90 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_power.py"
    # (POWER_STREAM_PJ: a weight stream's pJ/byte, as prefill-power prints it per GEMM, for the bounds)
    # shellcheck disable=SC2086
    step power-model 120 python3 -m moe2cta.serving_bench.power --probes idle read copy matmul \
        ${POWER_STREAM_PJ:+--stream-pj-per-byte $POWER_STREAM_PJ} --seconds "${POWER_SECONDS:-3}" \
        --json "$out/power-model.json" ;;
prefill-ncu-sections)  # Nsight Compute sections of the CuTe prefill GEMMs: tensor pipe, memory, warp stalls, clock
    for cell in ${NCU_CELLS:-qwen3-30b-a3b:2048 gpt-oss-120b:8192}; do
        # shellcheck disable=SC2086
        step "ncu-sections-${cell/:/-}" 240 ncu --clock-control none --section SpeedOfLight \
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
            --section SchedulerStats --kernel-name regex:"${NCU_KERNELS:-cute_backend}" \
            python3 -m moe2cta.serving_bench.prefill_gemm_bench --profile --bundle "new=$kdir" \
            --models "${cell%%:*}" --tokens "${cell##*:}" --variants ${NCU_VARIANTS:-default} \
            --routing ${PREFILL_ROUTING:-random} --padding ${PREFILL_PADDING:-random}
    done ;;
prefill-ncu)  # Nsight Compute: time, DRAM bytes, L2 hit rate, SM clock of the CuTe (NCU_VARIANTS) and Triton GEMMs
    for cell in ${NCU_CELLS:-qwen3-235b-a22b:8192 deepseek-v3:8192}; do
        # shellcheck disable=SC2086
        step "ncu-${cell/:/-}${PREFILL_SUFFIX:-}" 150 ncu --clock-control none --csv --metrics "${NCU_METRICS:-gpu__time_duration.sum,\
dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__cycles_elapsed.avg.per_second}" \
            --kernel-name regex:"${NCU_KERNELS:-cute_backend|cute_swapped_backend|_grouped_gemm_kernel}" \
            python3 -m moe2cta.serving_bench.prefill_gemm_bench --profile --bundle "new=$kdir" \
            --models "${cell%%:*}" --tokens "${cell##*:}" --variants ${NCU_VARIANTS:-default} \
            --routing ${PREFILL_ROUTING:-random} --padding ${PREFILL_PADDING:-random}
    done ;;
prefill-ncu-stalls)  # Nsight Compute sections (speed of light, memory, warp states, scheduler) of the CuTe GEMMs in
    # NCU_VARIANTS at NCU_CELLS: where the cycles of one variant go against another's
    for cell in ${NCU_CELLS:-mixtral-8x7b:8192}; do
        # shellcheck disable=SC2086
        step "ncu-stalls-${cell/:/-}${PREFILL_SUFFIX:-}" 300 ncu --clock-control none --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
            --kernel-name regex:"cute_backend" \
            python3 -m moe2cta.serving_bench.prefill_gemm_bench --profile --bundle "new=$kdir" \
            --models "${cell%%:*}" --tokens "${cell##*:}" --variants ${NCU_VARIANTS:-default} \
            --routing ${PREFILL_ROUTING:-random} --padding ${PREFILL_PADDING:-random}
    done ;;
token-gemv)  # the Triton layer's token GEMVs beside its grouped GEMMs at decode sizes (+ kernel config sweep at T=1)
    step token-gemv 300 python3 -m moe2cta.serving_bench.token_gemv_bench --models ${GEMV_MODELS:-all} --tokens ${GEMV_TOKENS:-1 2 4 8 16} \
        ${GEMV_SWEEP:+--sweep} ${GEMV_CHAIN:+--chain} --json "$out/token-gemv${GEMV_CHAIN:+-chain}.json" ;;
token-gemv-tests)
    step token-gemv-tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" \
        "$repo/tests/test_triton_token_gemv.py" "$repo/tests/test_api.py" ;;
token-gemv-ncu)  # Nsight Compute, application replay, L2 kept between kernels: time, DRAM bytes, L2 hit rate of GEMV1
    # and GEMV2 (three rotated routings) and of a plain read of the same bytes (results/token-prefetch-*)
    for cell in ${GEMV_NCU_CELLS:-qwen3-30b-a3b:1 gpt-oss-120b:1}; do
        # shellcheck disable=SC2086
        step "token-gemv-ncu-${cell/:/-}" 200 ncu --profile-from-start off --replay-mode application --cache-control none \
            --clock-control none --csv --kernel-name regex:"_token_gemv_kernel|reduce_kernel" --metrics "${NCU_METRICS:-\
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__cycles_elapsed.avg.per_second,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active}" \
            python3 -m moe2cta.serving_bench.token_gemv_bench --profile --models "${cell%%:*}" --tokens "${cell##*:}"
    done ;;
token-gemv-ncu-stalls)  # Nsight Compute sections of GEMV1 / GEMV2 and the plain read (caches flushed)
    for cell in ${GEMV_NCU_CELLS:-qwen3-30b-a3b:1 gpt-oss-120b:1}; do
        step "token-gemv-ncu-stalls-${cell/:/-}" 200 ncu --profile-from-start off --clock-control none \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
            --section LaunchStats --section Occupancy --kernel-name regex:"_token_gemv_kernel|reduce_kernel" \
            python3 -m moe2cta.serving_bench.token_gemv_bench --profile --models "${cell%%:*}" --tokens "${cell##*:}"
    done ;;
memcheck-token-gemv)  # compute-sanitizer memcheck on the token GEMV GPU tests (both layouts, masked slots and tails;
    # gpt-oss's T=1 GEMV2 runs the narrow tile)
    step memcheck-token-gemv 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider \
        --rootdir "$repo" "$repo/tests/test_triton_token_gemv.py" -k "${MEMCHECK_K:-qwen3 or gpt-oss or layer_token_path}" ;;
layer-profile)  # kernel times of one layer forward per backend (PROFILE_CELLS="model:T ...", PROFILE_MODES="eager graph", PROFILE_SUSTAIN=seconds)
    for cell in ${PROFILE_CELLS:-deepseek-v3:8192 qwen3-30b-a3b:2048}; do
        step "profile-${cell/:/-}" 120 python3 -m moe2cta.serving_bench.layer_profile --model "${cell%%:*}" \
            --tokens "${cell##*:}" --backends ${PROFILE_BACKENDS:-triton cute} --modes ${PROFILE_MODES:-eager} \
            --sustain-seconds ${PROFILE_SUSTAIN:-0} --json "$out/profile-${cell/:/-}.json"
    done ;;
host-overhead)  # host time of one forward per backend and call mode (HOST_CELLS="model:T,T ...", HOST_MODES="eager graphed graphed-in-place",
    # HOST_GRAPH_SIZES="1 2 4 ..." for every cell, HOST_PROFILE=N functions)
    for cell in ${HOST_CELLS:-qwen3-30b-a3b:1,8,2048 deepseek-v3:1,2048}; do
        tokens=${cell##*:}
        step "host-${cell%%:*}" 150 python3 -m moe2cta.serving_bench.host_overhead --model "${cell%%:*}" \
            --tokens ${tokens//,/ } --backends ${HOST_BACKENDS:-triton cute auto} --modes ${HOST_MODES:-eager} \
            ${HOST_GRAPH_SIZES:+--graph-sizes $HOST_GRAPH_SIZES} --profile ${HOST_PROFILE:-0} \
            --json "$out/host-${cell%%:*}.json"
    done ;;
graphed-tests)  # GraphedMoELayer against the layer's eager forward, bit for bit (needs the GPU-test bundle's custom shape)
    step graphed-tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$repo" -rs "$repo/tests/test_graphed.py" ;;
layer-padding)  # the layer's time per content of A's padding rows (as left, zeros, N(0,1), a token row), interleaved
    step layer-padding 300 python3 -m moe2cta.serving_bench.layer_padding_probe \
        --models ${PADDING_MODELS:-deepseek-v3 qwen3-235b-a22b qwen3-30b-a3b gpt-oss-120b} --tokens ${PADDING_TOKENS:-2048 8192} \
        --backend ${PADDING_BACKEND:-cute} --json "$out/layer-padding.json" ;;
layer-routings)  # prefill cells per routing: uniform (the grid's) beside balanced (T*k/E rows per expert: no tails, so
    # padding only where T*k/E is not a multiple of the tile height), auto beside torch._grouped_mm
    step layer-routings 400 python3 -m moe2cta.serving_bench --models ${ROUTINGS_MODELS:-mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b} \
        --tokens ${ROUTINGS_TOKENS:-2048,8192,32768} --routing ${ROUTINGS:-uniform,balanced} --backends auto,grouped-mm \
        --time-per-case 0.05 --out "$out/layer-routings" --progress off --no-plots ;;
layer-prefill)  # prefill cells of every model, cute beside triton
    step layer-prefill 240 python3 -m moe2cta.serving_bench --models mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b \
        --tokens 2048,8192,32768 --backends triton,cute --time-per-case 0.05 --out "$out/layer-prefill" --progress off --no-plots ;;
*) echo "unknown step $1" ;;
esac; }
lane() { local gpu=$1; shift; for s in "$@"; do CUDA_VISIBLE_DEVICES=$gpu run_step "$s"; done; }
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -ge 2 ]; then
    # shellcheck disable=SC2086
    lane 1 ${LANE1:-} > "$out/lane1.log" 2>&1 &
    # shellcheck disable=SC2086
    lane 0 ${LANE0:-}
    wait; cat "$out/lane1.log"
else
    # shellcheck disable=SC2086
    lane 0 ${LANE0:-} ${LANE1:-}
fi
