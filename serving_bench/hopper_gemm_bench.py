"""H200 driver for the sm90 CuTe grouped GEMM: correctness against the torch twin, then timings.

Two steps, so that the GPU host needs no CuTe DSL compiler:

    # here (no GPU): compile every kernel this script runs into a bundle
    python serving_bench/hopper_gemm_bench.py build --out .kernels/sm90
    # on the H200 (bundle runtime activated: source .bundle/rt/activate.sh)
    python3 serving_bench/hopper_gemm_bench.py run --kernel-dir .kernels/sm90 --json $OUT/sm90.json

`run` checks small problems over random, skewed, zero-expert and one-expert routings for every variant
(output poisoned with NaN first; error ||out - ref|| / ||ref|| on valid rows against an fp32 reference,
bound 2x a same-dtype torch run's error + 1e-3; `--routings class_masked`: a launch given half the experts' counts,
as one expert class's launch is, on the variants that take expert subsets, whose other rows must stay unwritten),
then times GEMM1 / GEMM2 of model presets at a few token counts: CUDA-graph replay, median of many replays,
inputs rotated over several copies, each with its own routing, so that L2 holds none of them (before stop 52 the copies
shared one routing: at T=1 their 8 experts' weights, 25-50 MB, could stay in L2); pair vs single work units and static vs dynamic
scheduler in the same run. A watchdog ends the process if one kernel call hangs (naming it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import threading
import time

import torch

try:  # installed package
    from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
    from moe2cta.grouped_gemm.budget import WorkUnit
    from moe2cta.grouped_gemm.epilogue import Activation
    from moe2cta.grouped_gemm.reference import grouped_gemm1_reference, grouped_gemm2_reference
except ImportError:  # a bare checkout (the GPU host): import grouped_gemm/ as a top-level package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from grouped_gemm import sm90_grouped_gemm as s90  # type: ignore[no-redef]
    from grouped_gemm.budget import WorkUnit  # type: ignore[no-redef]
    from grouped_gemm.epilogue import Activation  # type: ignore[no-redef]
    from grouped_gemm.reference import grouped_gemm1_reference, grouped_gemm2_reference  # type: ignore[no-redef]

# the floor's ceilings: the targets' (serving_bench/floors.py DEFAULT_BANDWIDTH / DEFAULT_MATMUL_FLOPS; kept here so
# that a bare checkout runs this script)
FLOOR_BANDWIDTH = 4.24e12
FLOOR_MATMUL_FLOPS = 792e12
QUEUE_SLEEP_CYCLES = 200_000  # ~0.1 ms of GPU sleep before each timed replay: the host's launch leaves the window

Cfg = s90.Sm90GemmConfig
Problem = s90.Sm90Problem
G1, G2 = s90.GemmStage.GEMM1, s90.GemmStage.GEMM2
ALIGN = 128

# ------------------------------------------------------------------------------------------ variants
# small correctness problem: E experts, hidden H, intermediate I
CHECK_E, CHECK_H, CHECK_I = 8, 256, 192


def check_variants():
    """(name, config, problem) for the correctness tier, simplest first."""
    bf = torch.bfloat16
    TOKEN_ROWS = s90.ASource.TOKEN_ROWS
    SKIP = s90.PaddingRows.SKIP
    EVEN = s90.ExpertSplit.EVEN
    FUSE = s90.PaddingRows.FUSE_TAIL
    SPLIT = s90.PaddingRows.SPLIT_TAIL
    UNDER = s90.EpilogueStore.UNDER_NEXT_MAINLOOP
    ACT = s90.EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP
    EG, DYN, SIDES = s90.Raster.EXPERT_GROUPED_M, s90.Scheduler.DYNAMIC, s90.Scheduler.DYNAMIC_SIDES
    PDL, PREFETCH = s90.DependentLaunch.PROGRAMMATIC, s90.DependentLaunch.PROGRAMMATIC_WEIGHT_PREFETCH
    pair = Cfg(tile_m=128, tile_n=128, work_unit=WorkUnit.PAIR, pair_threshold=1)
    single = Cfg(tile_m=128, tile_n=128, work_unit=WorkUnit.SINGLE, raster=s90.Raster.ALONG_M)
    dyn = Cfg(tile_m=128, tile_n=128, work_unit=WorkUnit.SINGLE, scheduler=s90.Scheduler.DYNAMIC)
    decode = Cfg(tile_m=64, tile_n=64, work_unit=WorkUnit.SINGLE, raster=s90.Raster.ALONG_N)
    p1 = Problem(G1, 2 * CHECK_I, CHECK_H, CHECK_E, bf, Activation.SWIGLU)
    p1_gelu = Problem(G1, 2 * CHECK_I, CHECK_H, CHECK_E, bf, Activation.GELU_GATED)
    p1_fp16 = Problem(G1, 2 * CHECK_I, CHECK_H, CHECK_E, torch.float16, Activation.SWIGLU)
    p1_oai = Problem(G1, 2 * CHECK_I, CHECK_H, CHECK_E, bf, Activation.SWIGLU_OAI, has_bias=True)
    p1_n512 = Problem(G1, 512, CHECK_H, CHECK_E, bf, Activation.SWIGLU)  # 2I a multiple of 256 weight rows
    p1_n512_k320 = Problem(G1, 512, 320, CHECK_E, bf, Activation.SWIGLU)  # 5 K tiles of 64 on 4 stages
    p1_oai_k320 = Problem(G1, 2 * CHECK_I, 320, CHECK_E, bf, Activation.SWIGLU_OAI, has_bias=True)
    p1_oai_n512 = Problem(G1, 512, CHECK_H, CHECK_E, bf, Activation.SWIGLU_OAI, has_bias=True)
    p2 = Problem(G2, CHECK_H, CHECK_I, CHECK_E, bf, None, False, True)
    p2_bias = Problem(G2, CHECK_H, CHECK_I, CHECK_E, bf, None, True, True)
    p2_plain = Problem(G2, CHECK_H, CHECK_I, CHECK_E, bf, None, False, False)
    p2_n384 = Problem(G2, 384, CHECK_I, CHECK_E, bf, None, True, True)  # 1.5 n-blocks of 256
    p2_n320 = Problem(G2, 320, CHECK_I, CHECK_E, bf, None, True, True)  # 2.5 n-blocks of 128
    p1_oai_n320 = Problem(G1, 320, CHECK_H, CHECK_E, bf, Activation.SWIGLU_OAI, has_bias=True)
    return [
        ("g1_swiglu_single", single, p1),
        ("g1_swiglu_pair", pair, p1),
        ("g1_swiglu_dynamic", dyn, p1),
        ("g1_swiglu_decode64", decode, p1),
        ("g1_gelu_single", single, p1_gelu),
        ("g1_oai_bias_pair", pair, p1_oai),
        ("g2_rowscale_pair", pair, p2),
        ("g2_rowscale_bias_dynamic", dyn, p2_bias),
        ("g2_plain_single", single, p2_plain),
        ("g2_rowscale_n256_pair", Cfg(tile_n=256, work_unit=WorkUnit.PAIR, pair_threshold=1), p2),
        ("g2_rowscale_m64n256_dynamic", Cfg(tile_m=64, tile_n=256, work_unit=WorkUnit.SINGLE,
                                            scheduler=s90.Scheduler.DYNAMIC), p2_bias),
        # GROUPED_M raster: groups of 3 m-blocks (short last group), dynamic and static
        ("g1_swiglu_grouped3_dynamic", Cfg(tile_n=128, scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.GROUPED_M,
                                           raster_group_m=3), p1),
        ("g2_rowscale_grouped3_many", Cfg(tile_n=256, raster=s90.Raster.GROUPED_M, raster_group_m=3), p2),
        # EXPERT_GROUPED_M: groups cut at expert boundaries (short groups at every expert's end)
        ("g1_swiglu_expert_grouped3_dynamic", Cfg(tile_n=128, scheduler=s90.Scheduler.DYNAMIC,
                                                  raster=s90.Raster.EXPERT_GROUPED_M, raster_group_m=3), p1),
        ("g2_rowscale_bias_skip_expert_grouped2_many", Cfg(tile_n=256, raster=s90.Raster.EXPERT_GROUPED_M,
                                                           raster_group_m=2, padding_rows=SKIP), p2_bias),
        ("g1_oai_bias_expert_grouped8_dynamic_many", Cfg(tile_n=128, scheduler=s90.Scheduler.DYNAMIC,
                                                         raster=s90.Raster.EXPERT_GROUPED_M, raster_group_m=8), p1_oai),
        # PAIR units scheduled DYNAMIC: rank 0 of each cluster fetches, rank 1 receives the unit through DSMEM
        ("g1_swiglu_pair_dynamic", dataclasses.replace(pair, scheduler=s90.Scheduler.DYNAMIC), p1),
        ("g1_oai_bias_pair_dynamic_many", Cfg(tile_n=128, work_unit=WorkUnit.PAIR, pair_threshold=200,
                                              scheduler=s90.Scheduler.DYNAMIC), p1_oai),
        ("g2_rowscale_bias_pair_grouped3_dynamic_many", Cfg(tile_n=256, work_unit=WorkUnit.PAIR, pair_threshold=1,
                                                            scheduler=s90.Scheduler.DYNAMIC,
                                                            raster=s90.Raster.GROUPED_M, raster_group_m=3), p2_bias),
        # PaddingRows.SKIP: the warpgroup whose 64 rows of an expert's last m-block are all padding makes no
        # MMAs ("_decode": every tile has at most 3 valid rows, so warpgroup 1 always skips)
        ("g1_swiglu_skip_grouped3_dynamic", Cfg(tile_n=128, scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.GROUPED_M,
                                                raster_group_m=3, padding_rows=SKIP), p1),
        ("g1_oai_bias_skip_dynamic_many", Cfg(tile_n=128, scheduler=s90.Scheduler.DYNAMIC, padding_rows=SKIP), p1_oai),
        ("g2_rowscale_bias_skip_grouped3_dynamic_many", Cfg(tile_n=256, scheduler=s90.Scheduler.DYNAMIC,
                                                            raster=s90.Raster.GROUPED_M, raster_group_m=3,
                                                            padding_rows=SKIP), p2_bias),
        ("g2_rowscale_skip_decode", Cfg(tile_n=256, padding_rows=SKIP), p2),
        # swapped operands (decode kernel): token tiles of 8..64 rows, weight tiles of 64..256 rows
        ("g1_swiglu_swapped16", swapped(16, 128), p1),
        ("g1_gelu_swapped64", swapped(64, 64, tile_k=64), p1_gelu),
        ("g1_oai_bias_swapped32_dynamic", swapped(32, 128, scheduler=s90.Scheduler.DYNAMIC,
                                                  raster=s90.Raster.ALONG_N), p1_oai),
        ("g2_rowscale_bias_swapped16", swapped(16, 256, tile_k=64), p2_bias),
        ("g2_plain_swapped8", swapped(8, 128), p2_plain),
        ("g1_swiglu_swapped16_many", swapped(16, 128), p1),
        ("g2_rowscale_swapped16_dynamic_many", swapped(16, 128, scheduler=s90.Scheduler.DYNAMIC), p2),
        ("g1_swiglu_swapped16_decode", swapped(16, 128), p1),
        ("g2_rowscale_swapped16_decode", swapped(16, 128), p2),
        # wide swapped operands: 128/256-row token tiles whose wgmma N is the unit's valid rows rounded up to
        # token_step (every N size occurs: 1..299 rows per expert in zero_experts, 150 in random, 1200 in one)
        ("g1_swiglu_wide256", wide(256, 128), p1),
        ("g1_gelu_wide128_step16", wide(128, 128, token_step=16), p1_gelu),
        ("g1_oai_bias_wide256_dynamic", wide(256, 128, scheduler=s90.Scheduler.DYNAMIC), p1_oai),
        ("g1_swiglu_wide256_dynamic_many", wide(256, 128, scheduler=s90.Scheduler.DYNAMIC), p1),
        ("g2_rowscale_bias_wide256_dynamic_many", wide(256, 128, scheduler=s90.Scheduler.DYNAMIC), p2_bias),
        ("g2_plain_wide256_n64_along_m", wide(256, 64, raster=s90.Raster.ALONG_M), p2_plain),
        ("g2_rowscale_wide256_one_size", wide(256, 128, token_step=0), p2),
        ("g1_swiglu_wide256_decode", wide(256, 128), p1),
        # 256 weight rows: two wgmma atoms per consumer warpgroup, the 32-row epilogue passes
        ("g1_swiglu_wide128_n256", wide(128, 256), p1_n512),
        ("g1_oai_bias_wide128_n256_dynamic_many", wide(128, 256, scheduler=s90.Scheduler.DYNAMIC), p1_oai_n512),
        ("g2_rowscale_bias_wide128_n256_along_m", wide(128, 256, raster=s90.Raster.ALONG_M), p2_bias),
        ("g2_rowscale_wide128_n256_step16_dynamic_many", wide(128, 256, token_step=16, scheduler=s90.Scheduler.DYNAMIC),
         p2),
        # 160-row token tiles (32-row TMA boxes; an expert's second tile starts 160 rows in), 256 weight rows: 160
        # accumulator registers per thread, the gated epilogue in 32-row passes and the ungated one in 16-row passes
        ("g1_swiglu_wide160_n256", wide(160, 256), p1_n512),
        ("g1_oai_bias_wide160_n256_dynamic_many", wide(160, 256, scheduler=s90.Scheduler.DYNAMIC), p1_oai_n512),
        ("g2_rowscale_bias_wide160_n256_along_m", wide(160, 256, raster=s90.Raster.ALONG_M), p2_bias),
        ("g2_rowscale_wide160_n256_step16_dynamic_many", wide(160, 256, token_step=16, scheduler=s90.Scheduler.DYNAMIC),
         p2),
        ("g1_gelu_wide160_n128", wide(160, 128), p1_gelu),
        ("g2_plain_wide160_n128_decode", wide(160, 128), p2_plain),
        # 288-row token tiles (two wgmma of 144 and up to 144 token rows above 144; "_3blocks": ~288 rows per expert,
        # some above: a second unit), and partial last n-blocks of the wide kernel (N = 320 on 128 weight rows)
        ("g1_swiglu_wide288_3blocks", wide(288, 128), p1),
        ("g1_oai_bias_wide288_dynamic_many", wide(288, 128, scheduler=s90.Scheduler.DYNAMIC), p1_oai),
        ("g2_rowscale_bias_wide288_n320_3blocks", wide(288, 128), p2_n320),
        ("g1_oai_bias_wide288_n320_along_m", wide(288, 128, raster=s90.Raster.ALONG_M), p1_oai_n320),
        ("g2_rowscale_wide288_step16_dynamic_many", wide(288, 128, token_step=16, scheduler=s90.Scheduler.DYNAMIC), p2),
        ("g1_gelu_wide288_n64", wide(288, 64), p1_gelu),
        ("g2_plain_wide288_decode", wide(288, 128), p2_plain),
        ("g2_rowscale_bias_wide256_n320_dynamic", wide(256, 128, scheduler=s90.Scheduler.DYNAMIC), p2_n320),
        # ExpertSplit.EVEN: an expert's rows spread over its tiles in shares of whole TMA boxes (32 rows on the 160- and
        # 288-row tiles, 64 on the 256-row one); "_3blocks" puts experts around one tile's size, "_many" has ~15
        # tiles per expert, and one_expert 1200 rows in 5 tiles of 256 + 176 (288-row tiles)
        ("g1_swiglu_wide288_even_3blocks", wide(288, 128, split=EVEN), p1),
        ("g1_oai_bias_wide288_even_dynamic_many", wide(288, 128, scheduler=s90.Scheduler.DYNAMIC, split=EVEN), p1_oai),
        ("g2_rowscale_bias_wide288_even_n320_3blocks", wide(288, 128, split=EVEN), p2_n320),
        ("g2_rowscale_wide288_even_step16_dynamic_many", wide(288, 128, token_step=16, scheduler=s90.Scheduler.DYNAMIC,
                                                              split=EVEN), p2),
        ("g2_plain_wide288_even_decode", wide(288, 128, split=EVEN), p2_plain),
        ("g1_swiglu_wide160_even_n256", wide(160, 256, split=EVEN), p1_n512),
        ("g2_rowscale_bias_wide160_even_n256_along_m_3blocks", wide(160, 256, raster=s90.Raster.ALONG_M, split=EVEN),
         p2_bias),
        ("g1_gelu_wide256_even_dynamic_many", wide(256, 128, scheduler=s90.Scheduler.DYNAMIC, split=EVEN), p1_gelu),
        # GEMM1 reading the token rows itself (ASource.TOKEN_ROWS: cp.async by the producer warpgroup, the rows
        # of a random permutation of the slots, padding row r reading token r % T)
        ("g1_swiglu_token_rows", dataclasses.replace(single, a_source=TOKEN_ROWS), p1),
        ("g1_oai_bias_token_rows_dynamic_many", dataclasses.replace(dyn, a_source=TOKEN_ROWS), p1_oai),
        ("g1_swiglu_token_rows_n256_grouped3_dynamic_many", Cfg(scheduler=s90.Scheduler.DYNAMIC,
                                                                 raster=s90.Raster.GROUPED_M, raster_group_m=3,
                                                                 a_source=TOKEN_ROWS), p1_n512),
        ("g1_gelu_token_rows_k128_skip", Cfg(tile_n=128, tile_k=128, padding_rows=SKIP, a_source=TOKEN_ROWS), p1_gelu),
        ("g1_swiglu_token_rows_m64_decode", Cfg(tile_m=64, tile_n=128, a_source=TOKEN_ROWS), p1),
        # EpilogueStore.UNDER_NEXT_MAINLOOP: each output tile stored during the next unit's first K tiles (the
        # last one after the loop); CHECK_H / 64 = 4 K tiles against 2-8 epilogue sub-tiles, so both the stores
        # under the K tiles and those after a short mainloop run; SKIP, PAIR, token rows and 64-row tiles beside it
        ("g1_swiglu_under_dynamic", dataclasses.replace(dyn, epilogue_store=UNDER), p1),
        ("g1_oai_bias_under_skip_grouped3_dynamic_many", Cfg(tile_n=128, scheduler=s90.Scheduler.DYNAMIC,
                                                            raster=s90.Raster.GROUPED_M, raster_group_m=3,
                                                            padding_rows=SKIP, epilogue_store=UNDER), p1_oai),
        ("g2_rowscale_bias_under_n256_skip_dynamic_many", Cfg(tile_n=256, scheduler=s90.Scheduler.DYNAMIC,
                                                             padding_rows=SKIP, epilogue_store=UNDER), p2_bias),
        ("g2_plain_under_m64n256", Cfg(tile_m=64, tile_n=256, epilogue_store=UNDER), p2_plain),
        ("g2_rowscale_under_pair", dataclasses.replace(pair, epilogue_store=UNDER), p2),
        ("g1_swiglu_under_token_rows_n256_dynamic_many", Cfg(scheduler=s90.Scheduler.DYNAMIC, a_source=TOKEN_ROWS,
                                                            epilogue_store=UNDER), p1_n512),
        ("g1_gelu_under_decode", dataclasses.replace(single, epilogue_store=UNDER), p1_gelu),
        # EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP: GEMM1 holds (gate, up) words and each sub-tile's activation runs
        # under the next unit's K tiles (the same mix of paths as UNDER_NEXT_MAINLOOP, plus fp16's unpack)
        ("g1_swiglu_act_under_dynamic", dataclasses.replace(dyn, epilogue_store=ACT), p1),
        ("g1_oai_bias_act_under_skip_grouped3_dynamic_many", Cfg(tile_n=128, scheduler=s90.Scheduler.DYNAMIC,
                                                                raster=s90.Raster.GROUPED_M, raster_group_m=3,
                                                                padding_rows=SKIP, epilogue_store=ACT), p1_oai),
        ("g1_swiglu_act_under_n256_dynamic_many", Cfg(scheduler=s90.Scheduler.DYNAMIC, epilogue_store=ACT), p1_n512),
        ("g1_oai_bias_act_under_n256_pair", Cfg(work_unit=WorkUnit.PAIR, pair_threshold=1, epilogue_store=ACT),
         p1_oai_n512),
        ("g1_swiglu_act_under_token_rows_n256_dynamic_many", Cfg(scheduler=s90.Scheduler.DYNAMIC, a_source=TOKEN_ROWS,
                                                                epilogue_store=ACT), p1_n512),
        ("g1_gelu_act_under_m64_decode", Cfg(tile_m=64, tile_n=128, epilogue_store=ACT), p1_gelu),
        ("g1_swiglu_act_under_fp16_many", dataclasses.replace(dyn, epilogue_store=ACT), p1_fp16),
        # a partial last n-block (N = 384 over 256-wide tiles): TMA zero-fills B's missing rows, the bias index is
        # clamped, the C store clips the missing columns
        ("g1_oai_bias_n256_tail_dynamic", Cfg(tile_n=256, scheduler=s90.Scheduler.DYNAMIC, epilogue_store=UNDER),
         p1_oai),
        ("g1_swiglu_n256_tail_skip_grouped3_dynamic_many", Cfg(tile_n=256, scheduler=s90.Scheduler.DYNAMIC,
                                                              raster=s90.Raster.GROUPED_M, raster_group_m=3,
                                                              padding_rows=SKIP, epilogue_store=UNDER), p1),
        ("g1_oai_bias_n256_tail_pair", Cfg(tile_n=256, work_unit=WorkUnit.PAIR, pair_threshold=1), p1_oai),
        ("g1_swiglu_n256_tail_token_rows_dynamic_many", Cfg(tile_n=256, scheduler=s90.Scheduler.DYNAMIC,
                                                           a_source=TOKEN_ROWS, epilogue_store=UNDER), p1),
        ("g1_gelu_n256_tail_act_under", Cfg(tile_n=256, epilogue_store=ACT), p1_gelu),
        ("g2_rowscale_bias_n256_tail_skip_dynamic_many", Cfg(tile_n=256, scheduler=s90.Scheduler.DYNAMIC,
                                                            padding_rows=SKIP, epilogue_store=UNDER), p2_n384),
        # GEMM1's default since v15: EXPERT_GROUPED_M with SKIP and the store under the next mainloop, on the gathered
        # copy and the token rows, with bias, fp16, a partial n-block, and tiles of at most 3 valid rows
        ("g1_swiglu_expert_grouped3_skip_n256_dynamic_many", Cfg(scheduler=DYN, raster=EG, raster_group_m=3,
                                                                padding_rows=SKIP, epilogue_store=UNDER), p1_n512),
        ("g1_oai_bias_expert_grouped2_skip_dynamic", Cfg(tile_n=128, scheduler=DYN, raster=EG, raster_group_m=2,
                                                         padding_rows=SKIP, epilogue_store=UNDER), p1_oai),
        ("g1_swiglu_expert_grouped8_skip_token_rows_n256_dynamic_many", Cfg(
            scheduler=DYN, raster=EG, raster_group_m=8, padding_rows=SKIP, a_source=TOKEN_ROWS,
            epilogue_store=UNDER), p1_n512),
        ("g1_swiglu_expert_grouped3_skip_fp16_dynamic_many", Cfg(tile_n=128, scheduler=DYN, raster=EG,
                                                                raster_group_m=3, padding_rows=SKIP,
                                                                epilogue_store=UNDER), p1_fp16),
        ("g1_gelu_expert_grouped8_skip_n256_tail_dynamic_decode", Cfg(tile_n=256, scheduler=DYN, raster=EG,
                                                                     raster_group_m=8, padding_rows=SKIP,
                                                                     epilogue_store=UNDER), p1_gelu),
        # Scheduler.DYNAMIC_SIDES: the unit order in two halves, one per L2 side (the side map: tests set several);
        # GEMM1's default raster and the token rows, GEMM2 grouped, PAIR clusters, and few units (a short half)
        ("g1_swiglu_sides_expert_grouped3_skip_n256_many", Cfg(scheduler=SIDES, raster=EG, raster_group_m=3,
                                                              padding_rows=SKIP, epilogue_store=UNDER), p1_n512),
        ("g1_oai_bias_sides_token_rows_many", dataclasses.replace(dyn, scheduler=SIDES, a_source=TOKEN_ROWS), p1_oai),
        ("g2_rowscale_bias_sides_grouped3_skip_many", Cfg(tile_n=256, scheduler=SIDES, raster=s90.Raster.GROUPED_M,
                                                          raster_group_m=3, padding_rows=SKIP), p2_bias),
        ("g2_rowscale_sides_pair_many", Cfg(tile_n=128, work_unit=WorkUnit.PAIR, pair_threshold=1, scheduler=SIDES),
         p2),
        ("g1_swiglu_sides", dataclasses.replace(dyn, scheduler=SIDES), p1),
        # the wide tiles reading the token rows themselves (cp.async of each unit's valid rows by the producer
        # warpgroup): the layer's 160-row EVEN tile, and at K = 320 (5 K tiles on 4 stages, so units start at every
        # stage) the 160- and 288-row tiles STATIC with many units per CTA (stop 39's hang needed both)
        ("g1_swiglu_wide160_even_token_rows_n256", dataclasses.replace(wide(160, 256, split=EVEN), a_source=TOKEN_ROWS),
         p1_n512),
        ("g1_swiglu_wide160_even_token_rows_n256_decode", dataclasses.replace(wide(160, 256, split=EVEN),
                                                                              a_source=TOKEN_ROWS), p1_n512),
        ("g1_swiglu_wide160_even_token_rows_n256_k320_many", dataclasses.replace(wide(160, 256, split=EVEN),
                                                                                 a_source=TOKEN_ROWS), p1_n512_k320),
        ("g1_oai_bias_wide288_even_token_rows_k320_many", dataclasses.replace(wide(288, 128, split=EVEN),
                                                                              a_source=TOKEN_ROWS), p1_oai_k320),
        # PaddingRows.FUSE_TAIL (cute_fused_tail_backend.py): an expert's last m-block of <= 64 valid rows rides on
        # the m-block before it (192-row units); STATIC and DYNAMIC, every raster, a partial n-block (tail columns
        # past N), 48-column tail output tiles (tile_n 192, gated), fp16, and tiles that never fuse ("_decode")
        ("g1_swiglu_fuse_tail", Cfg(tile_n=128, padding_rows=FUSE), p1),
        ("g1_swiglu_fuse_tail_expert_grouped3_n256_dynamic_many", Cfg(scheduler=DYN, raster=EG, raster_group_m=3,
                                                                     padding_rows=FUSE), p1_n512),
        ("g1_oai_bias_fuse_tail_n192_dynamic_many", Cfg(tile_n=192, scheduler=DYN, padding_rows=FUSE), p1_oai),
        ("g1_gelu_fuse_tail_fp16_grouped3_dynamic", Cfg(tile_n=128, scheduler=DYN, raster=s90.Raster.GROUPED_M,
                                                       raster_group_m=3, padding_rows=FUSE),
         Problem(G1, 2 * CHECK_I, CHECK_H, CHECK_E, torch.float16, Activation.GELU_GATED)),
        ("g2_rowscale_bias_fuse_tail_n256_tail_dynamic_many", Cfg(tile_n=256, scheduler=DYN, padding_rows=FUSE),
         p2_n384),
        ("g2_rowscale_fuse_tail_expert_grouped2_many", Cfg(tile_n=256, raster=EG, raster_group_m=2, padding_rows=FUSE),
         p2),
        ("g2_plain_fuse_tail_decode", Cfg(tile_n=128, padding_rows=FUSE), p2_plain),
        ("g1_swiglu_fuse_tail_k32_expert_grouped3_n256_dynamic_many", Cfg(tile_k=32, scheduler=DYN, raster=EG,
                                                                         raster_group_m=3, padding_rows=FUSE), p1_n512),
        ("g2_rowscale_bias_fuse_tail_k32_n256_tail_many", Cfg(tile_n=256, tile_k=32, padding_rows=FUSE), p2_n384),
        # PaddingRows.SPLIT_TAIL: an expert of three m-blocks has its tail's columns split over its first two units
        # (a quarter of the weight tile per warpgroup); 192-wide GEMM2 tiles (48-column slices)
        ("g1_swiglu_split_tail_expert_grouped3_n256_dynamic_3blocks", Cfg(scheduler=DYN, raster=EG, raster_group_m=3,
                                                                         padding_rows=SPLIT), p1_n512),
        ("g1_oai_bias_split_tail_dynamic_3blocks", Cfg(tile_n=128, scheduler=DYN, padding_rows=SPLIT), p1_oai),
        ("g2_rowscale_bias_split_tail_n192_3blocks", Cfg(tile_n=192, padding_rows=SPLIT), p2_bias),
        ("g2_rowscale_bias_split_tail_n256_tail_3blocks", Cfg(tile_n=256, padding_rows=SPLIT), p2_n384),
        ("g2_rowscale_split_tail_expert_grouped2_dynamic_many", Cfg(tile_n=256, scheduler=DYN, raster=EG,
                                                                   raster_group_m=2, padding_rows=SPLIT), p2),
        ("g1_gelu_split_tail_fp16_k32_3blocks", Cfg(tile_n=128, tile_k=32, padding_rows=SPLIT),
         Problem(G1, 2 * CHECK_I, CHECK_H, CHECK_E, torch.float16, Activation.GELU_GATED)),
        # DependentLaunch: programmatic dependent launches (griddepcontrol.wait before the first input read), with the
        # first unit's weight tiles prefetched into L2 before the wait; the decode, wide (token rows too) and regular
        # kernels, STATIC and DYNAMIC, and the fused-tail kernel (no prefetch there)
        ("g1_swiglu_swapped16_pdl_prefetch", dataclasses.replace(swapped(16, 128), dependent_launch=PREFETCH), p1),
        ("g2_rowscale_bias_swapped16_pdl", dataclasses.replace(swapped(16, 256, tile_k=64), dependent_launch=PDL),
         p2_bias),
        ("g1_swiglu_wide160_even_token_rows_n256_pdl_prefetch", dataclasses.replace(
            wide(160, 256, split=EVEN), a_source=TOKEN_ROWS, dependent_launch=PREFETCH), p1_n512),
        ("g2_rowscale_wide128_pdl_prefetch_many", dataclasses.replace(wide(128, 128), dependent_launch=PREFETCH), p2),
        ("g1_oai_bias_expert_grouped3_skip_dynamic_pdl_prefetch_many", Cfg(
            tile_n=128, scheduler=DYN, raster=EG, raster_group_m=3, padding_rows=SKIP, epilogue_store=UNDER,
            dependent_launch=PREFETCH), p1_oai),
        ("g2_rowscale_bias_grouped3_skip_dynamic_pdl_prefetch", Cfg(
            tile_n=256, scheduler=DYN, raster=s90.Raster.GROUPED_M, raster_group_m=3, padding_rows=SKIP,
            epilogue_store=UNDER, dependent_launch=PREFETCH), p2_bias),
        ("g1_swiglu_pair_pdl_prefetch", dataclasses.replace(pair, dependent_launch=PREFETCH), p1),
        ("g1_swiglu_token_rows_pdl", dataclasses.replace(single, a_source=TOKEN_ROWS, dependent_launch=PDL), p1),
        ("g2_rowscale_fuse_tail_pdl_many", Cfg(tile_n=256, padding_rows=FUSE, dependent_launch=PDL), p2),
    ]


def swapped(tile_m: int, tile_n: int, tile_k: int = 128, scheduler=None, raster=None):
    """A WEIGHTS_AS_M (decode) configuration."""
    return Cfg(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, operands=s90.Operands.WEIGHTS_AS_M,
               scheduler=scheduler or s90.Scheduler.STATIC, raster=raster or s90.Raster.ALONG_M)


def wide(tile_m: int, tile_n: int, token_step: int = 32, scheduler=None, raster=None, split=None):
    """A wide WEIGHTS_AS_M configuration (token tiles of 128/160/256/288 rows, wgmma N chosen per unit)."""
    return Cfg(tile_m=tile_m, tile_n=tile_n, tile_k=64, operands=s90.Operands.WEIGHTS_AS_M, token_step=token_step,
               scheduler=scheduler or s90.Scheduler.STATIC, raster=raster or s90.Raster.ALONG_N,
               expert_split=split or s90.ExpertSplit.FILL)


BENCH_MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8)}  # H, I, E, top_k


def bench_variants():
    out = []
    for model, (hidden, inter, experts, _) in BENCH_MODELS.items():
        p1 = Problem(G1, 2 * inter, hidden, experts, torch.bfloat16, Activation.SWIGLU)
        p2 = Problem(G2, hidden, inter, experts, torch.bfloat16, None, False, True)
        for tag, problem in (("gemm1", p1), ("gemm2", p2)):
            rm = s90.Raster.ALONG_M
            dyn = s90.Scheduler.DYNAMIC
            out += [
                (f"{model}/{tag}/default", s90.default_config(problem), problem),
                (f"{model}/{tag}/dynamic", s90.default_config(problem, dyn), problem),
                (f"{model}/{tag}/pair", s90.default_config(problem, work_unit=WorkUnit.PAIR), problem),
                (f"{model}/{tag}/n256_along_m", Cfg(tile_n=256, raster=rm), problem),
                (f"{model}/{tag}/n128_pair_along_m", Cfg(tile_n=128, work_unit=WorkUnit.PAIR, raster=rm), problem),
                (f"{model}/{tag}/n128_single", Cfg(tile_n=128), problem),
                # swapped operands (decode): token rows x weight rows x K
                (f"{model}/{tag}/swapped_16x128x128", swapped(16, 128), problem),
                (f"{model}/{tag}/swapped_16x128x128_along_n", swapped(16, 128, raster=s90.Raster.ALONG_N), problem),
                (f"{model}/{tag}/swapped_16x256x64", swapped(16, 256, tile_k=64), problem),
                (f"{model}/{tag}/swapped_16x64x128", swapped(16, 64), problem),
                (f"{model}/{tag}/swapped_16x128x128_dynamic", swapped(16, 128, scheduler=dyn), problem),
                (f"{model}/{tag}/swapped_32x128x128", swapped(32, 128), problem),
                (f"{model}/{tag}/swapped_64x128x128", swapped(64, 128), problem),
                (f"{model}/{tag}/swapped_8x128x128_along_n", swapped(8, 128, raster=s90.Raster.ALONG_N), problem),
                (f"{model}/{tag}/swapped_32x128x128_along_n", swapped(32, 128, raster=s90.Raster.ALONG_N), problem),
                (f"{model}/{tag}/swapped_16x256x64_along_n", swapped(16, 256, tile_k=64, raster=s90.Raster.ALONG_N),
                 problem),
                (f"{model}/{tag}/swapped_16x64x128_along_n", swapped(16, 64, raster=s90.Raster.ALONG_N), problem),
                (f"{model}/{tag}/swapped_64x128x128_along_n", swapped(64, 128, raster=s90.Raster.ALONG_N), problem),
                (f"{model}/{tag}/swapped_64x256x64_along_n", swapped(64, 256, tile_k=64, raster=s90.Raster.ALONG_N),
                 problem),
            ]
    return out


def pingpong_variants():
    """PINGPONG consumers (validated on the H200 2026-11-29: checks, racecheck): checks named x_*, bench rows."""
    pp = s90.Consumers.PINGPONG
    bf = torch.bfloat16
    out = [
        ("x_g1_swiglu_pingpong", Cfg(tile_n=128, consumers=pp), Problem(G1, 2 * CHECK_I, CHECK_H, CHECK_E, bf, Activation.SWIGLU)),
        ("x_g2_rowscale_bias_pingpong_dynamic", Cfg(tile_n=128, consumers=pp, scheduler=s90.Scheduler.DYNAMIC),
         Problem(G2, CHECK_H, CHECK_I, CHECK_E, bf, None, True, True)),
        # "_many": enough rows that every CTA takes several units, so both warpgroups alternate
        ("x_g1_swiglu_pingpong_many", Cfg(tile_n=128, consumers=pp), Problem(G1, 2 * CHECK_I, CHECK_H, CHECK_E, bf, Activation.SWIGLU)),
        ("x_g2_rowscale_bias_pingpong_dynamic_many", Cfg(tile_n=128, consumers=pp, scheduler=s90.Scheduler.DYNAMIC),
         Problem(G2, CHECK_H, CHECK_I, CHECK_E, bf, None, True, True)),
    ]
    for model, (hidden, inter, experts, _) in BENCH_MODELS.items():
        out += [
            (f"{model}/gemm1/n128_pingpong", Cfg(tile_n=128, consumers=pp),
             Problem(G1, 2 * inter, hidden, experts, bf, Activation.SWIGLU)),
            (f"{model}/gemm2/n128_pingpong", Cfg(tile_n=128, consumers=pp),
             Problem(G2, hidden, inter, experts, bf, None, False, True)),
        ]
    return out


# ------------------------------------------------------------------------------------------ build
def build(out_dir: str, keep_ptx: bool) -> None:
    seen = set()
    start = time.time()
    for name, cfg, problem in check_variants() + bench_variants() + pingpong_variants():
        key = s90.kernel_key(cfg, problem)
        if key in seen:
            continue
        seen.add(key)
        t = time.time()
        compiled = s90.compile_kernel(cfg, problem, keep_ptx=keep_ptx)
        s90_export(compiled, key, out_dir, keep_ptx, cfg, problem)
        print(f"built {name:36s} {time.time() - t:5.1f} s  {key.file_stem()}", flush=True)
    print(f"{len(seen)} kernels in {time.time() - start:.1f} s -> {out_dir}")


def s90_export(compiled, key, out_dir, keep_ptx, cfg, problem):
    import importlib

    runtime = importlib.import_module(s90.__name__.rsplit(".", 1)[0] + ".cute_runtime")
    runtime.export_kernel(compiled, key, out_dir, keep_ptx, smem_bytes=s90.smem_bytes(cfg, s90.resolve_stages(cfg)))


# ------------------------------------------------------------------------------------------ routing
def make_counts(kind: str, tokens: int, top_k: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    rows = tokens * top_k
    if kind == "random":
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        return torch.bincount(ids.flatten(), minlength=experts).to(torch.int32)
    if kind == "skewed":  # zipf-like: expert e gets weight 1/(e+1)^1.5
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.5
        ids = torch.multinomial(w, rows, replacement=True, generator=gen)
        return torch.bincount(ids, minlength=experts).to(torch.int32)
    if kind == "zero_experts":  # every other expert empty, odd counts
        counts = torch.zeros(experts, dtype=torch.int32)
        most = max(2, min(300, rows))  # 1..299 rows (fewer for tiny batches)
        counts[1::2] = torch.randint(1, most, (len(counts[1::2]),), generator=gen, dtype=torch.int32)
        return counts
    if kind == "one_expert":
        counts = torch.zeros(experts, dtype=torch.int32)
        counts[experts // 2] = rows
        return counts
    raise ValueError(kind)


def class_masked(counts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The counts one launch of an expert class sees (sm90_grouped_gemm.class_counts): a random half of the experts
    keep their rows, the others get 0 while the row layout (made from `counts`) keeps their rows."""
    keep = torch.randperm(len(counts), generator=gen)[: max(1, len(counts) // 2)]
    masked = torch.zeros_like(counts)
    masked[keep] = counts[keep]
    return masked


def padded_layout(counts: torch.Tensor, max_rows: int):
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    row_offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    row_offsets[1:] = torch.cumsum(padded, 0)
    assert int(row_offsets[-1]) <= max_rows
    return row_offsets


def valid_row_mask(row_offsets: torch.Tensor, counts: torch.Tensor, max_rows: int) -> torch.Tensor:
    """[max_rows] bool on the CPU: True on the valid rows of every expert (not padding)."""
    mask = torch.zeros(max_rows, dtype=torch.bool)
    for e in range(len(counts)):
        mask[int(row_offsets[e]): int(row_offsets[e]) + int(counts[e])] = True
    return mask


# ------------------------------------------------------------------------------------------ run
class Watchdog:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.label = "start"
        self.deadline = time.time() + seconds
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, label: str, seconds: float | None = None):
        self.label = label
        self.deadline = time.time() + (seconds or self.seconds)

    def _watch(self):
        while True:
            time.sleep(0.5)
            if time.time() > self.deadline:
                print(f"WATCHDOG: no progress for {self.seconds:.0f} s in: {self.label}", flush=True)
                os._exit(3)


def call(cfg, problem, a, w, ro, cn, bias, row_scale, out, kdir, token_rows=None):
    """token_rows (ASource.TOKEN_ROWS): (hidden [T, K], a_rows [M], top_k); `a` is then unused."""
    if problem.kind is G1:
        extra = {} if token_rows is None else {"a_rows": token_rows[1], "rows_per_token": token_rows[2]}
        return s90.sm90_grouped_gemm1(a if token_rows is None else token_rows[0], w, ro, cn, problem.activation,
                                      b13=bias, out=out, config=cfg, kernel_directory=kdir, **extra)
    return s90.sm90_grouped_gemm2(a, w, ro, cn, row_scale=row_scale, b2=bias, out=out, config=cfg,
                                  kernel_directory=kdir)


def check_one(name, cfg, problem, routing, kdir, gen, dog) -> dict:
    dev = torch.device("cuda")
    # "_many" variants: ~3 units per CTA on 132 SMs (the persistent loop and pipeline phases wrap);
    # "_decode": 3 tokens, a row or two per expert; "_3blocks": ~288 rows per expert (three 128-row m-blocks, the last
    # with a tail of a few to 64 rows under random routing)
    tokens = (8192 if name.endswith("_many") else 3 if name.endswith("_decode") else 576 if name.endswith("_3blocks")
              else 300)
    top_k, experts = 4, problem.num_experts
    # "class_masked": the layout of a random routing, and a kernel launch that gets the counts of half the experts
    # (one expert class's launch); the other experts' rows must stay unwritten
    layout_counts = make_counts("random" if routing == "class_masked" else routing, tokens, top_k, experts, gen)
    counts = class_masked(layout_counts, gen) if routing == "class_masked" else layout_counts
    max_rows = int(layout_counts.sum()) + experts * (ALIGN - 1)
    ro = padded_layout(layout_counts, max_rows)
    k, n, dt = problem.k, problem.n, problem.dtype
    a = (torch.randn(max_rows, k, generator=gen) * 0.5).to(dt)
    token_rows = None
    if cfg.a_source is not s90.ASource.EXPERT_ORDER_COPY:
        # the valid rows read the slots of a random permutation (slot // top_k = token), padding row r token r % T;
        # `a` becomes the gathered copy the kernel must behave like
        slots = int(layout_counts.sum())
        hidden = (torch.randn(max(1, -(-slots // top_k)), k, generator=gen) * 0.5).to(dt)
        a_rows = torch.full((max_rows,), -1, dtype=torch.int32)
        a_rows[valid_row_mask(ro, layout_counts, max_rows)] = torch.randperm(slots, generator=gen).to(torch.int32)
        a = hidden[torch.where(a_rows >= 0, a_rows // top_k, torch.arange(max_rows) % hidden.shape[0]).long()]
        token_rows = (hidden.cuda(), a_rows.cuda(), top_k)
    w = (torch.randn(experts, n, k, generator=gen) / k**0.5).to(dt)
    bias = (torch.randn(experts, n, generator=gen) * 0.5) if problem.has_bias else None
    row_scale = torch.rand(max_rows, generator=gen) if problem.has_row_scale else None
    if problem.kind is G1:
        ref = grouped_gemm1_reference(a.double(), w.double(), ro, counts, problem.activation,
                                      None if bias is None else bias.double())
        same = grouped_gemm1_reference(a.cuda(), w.cuda(), ro, counts, problem.activation,
                                       None if bias is None else bias.cuda().to(dt)).cpu()
        w_dev = s90.prepack_w13(w.cuda())
    else:
        ref = grouped_gemm2_reference(a.double(), w.double(), ro, counts, None if row_scale is None else row_scale.double(),
                                      None if bias is None else bias.double())
        same = grouped_gemm2_reference(a.cuda(), w.cuda(), ro, counts,
                                       None if row_scale is None else row_scale.cuda().to(dt),
                                       None if bias is None else bias.cuda().to(dt)).cpu()
        w_dev = w.cuda()
    out = torch.full((max_rows, problem.out_n), float("nan"), dtype=dt, device=dev)
    dog.arm(f"{name} / {routing}")
    call(cfg, problem, a.cuda(), w_dev, ro.cuda(), counts.cuda(), None if bias is None else bias.cuda(),
         None if row_scale is None else row_scale.cuda(), out, kdir, token_rows)
    torch.cuda.synchronize()
    out = out.cpu()
    mask = valid_row_mask(ro, counts, max_rows)
    got, want, base = out[mask].double(), ref[mask].double(), same[mask].double()
    unwritten = int(torch.isnan(got).any(dim=1).sum())
    # rows of the experts this launch was given 0 rows (class_masked; else none): any value there was written
    foreign = valid_row_mask(ro, layout_counts, max_rows) & ~mask
    foreign_written = int((~torch.isnan(out[foreign])).any(dim=1).sum())
    denom = want.norm().item() or 1.0
    err = (got - want).norm().item() / denom
    err_same = (base - want).norm().item() / denom
    bound = 2 * err_same + 1e-3
    ok = unwritten == 0 and foreign_written == 0 and err <= bound and bool(torch.isfinite(got).all())
    # a second launch must give the same bits (a moving result is a race)
    out2 = torch.full_like(out, float("nan")).cuda()
    call(cfg, problem, a.cuda(), w_dev, ro.cuda(), counts.cuda(), None if bias is None else bias.cuda(),
         None if row_scale is None else row_scale.cuda(), out2, kdir, token_rows)
    torch.cuda.synchronize()
    stable = bool(torch.equal(out2.cpu()[mask], out[mask]))
    return {"variant": name, "routing": routing, "rows": int(counts.sum()), "err": err, "err_torch_bf16": err_same,
            "unwritten_rows": unwritten, "foreign_rows_written": foreign_written, "repeat_identical": stable,
            "ok": ok and stable}


def run_checks(kdir, dog, only=None, routings=("random", "skewed", "zero_experts", "one_expert"),
               pingpong=True) -> list:
    gen = torch.Generator().manual_seed(1234)
    results = []
    variants = check_variants() + ([v for v in pingpong_variants() if v[0].startswith("x_")] if pingpong else [])
    for name, cfg, problem in variants:
        if only and name not in only:
            continue
        for routing in routings:
            if routing == "class_masked" and not cfg.takes_expert_subsets:
                continue  # (a kernel the layer never gives a subset of the experts)
            r = check_one(name, cfg, problem, routing, kdir, gen, dog)
            results.append(r)
            print(f"check {name:28s} {routing:13s} rows {r['rows']:5d} err {r['err']:.2e} "
                  f"(bf16 torch {r['err_torch_bf16']:.2e}) unwritten {r['unwritten_rows']} "
                  f"foreign {r['foreign_rows_written']} "
                  f"repeat {r['repeat_identical']} {'PASS' if r['ok'] else 'FAIL'}", flush=True)
    return results


def time_graph(fn, copies: int, replays: int = 20) -> float:
    """Median ms of one call: a graph holding `copies` calls (one per rotated input set), replayed."""
    return time_interleaved([fn], copies, replays)[0]


def capture_graph(fn, copies: int, stream=None):
    """A CUDA graph of fn(0), ..., fn(copies - 1) (rotated inputs), after one eager warm-up round (module loads)."""
    stream = stream or torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for c in range(copies):
            fn(c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in range(copies):
            fn(c)
    return graph


def time_interleaved(fns, copies: int, rounds: int, seed: int = 0) -> list[float]:
    """Median ms of one call per fn: one CUDA graph per fn holding `copies` calls (rotated inputs), the
    graphs replayed in `rounds` interleaved rounds (clocks drift with temperature and power over a run, and
    interleaving gives every fn the same conditions; each replay queued behind a short GPU sleep, so that its events
    time the GPU, not the host's launch), each round in its own order (a permutation drawn from
    `seed`): in a fixed order a fn always follows the same neighbour, and one that follows a power-hungry
    kernel runs at lower clocks (the same CuTe kernel in first place, after dense cuBLAS, measured 1.5-6%
    slower than in sixth place: results/pair-ncu-h200-2026-11-29/)."""
    stream = torch.cuda.Stream()
    graphs = [capture_graph(fn, copies, stream) for fn in fns]
    samples = [[] for _ in fns]
    order = list(range(len(graphs)))
    shuffle = random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        for g in order:
            graph = graphs[g]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(QUEUE_SLEEP_CYCLES)  # the GPU waits while the host launches: GPU time only
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples[g].append(start.elapsed_time(end) / copies)
    return [sorted(x)[len(x) // 2] for x in samples]


def run_bench(kdir, dog, tokens_list, pingpong=True) -> list:
    gen = torch.Generator().manual_seed(7)
    dev = torch.device("cuda")
    results = []
    for model, (hidden, inter, experts, top_k) in BENCH_MODELS.items():
        w13_public = (torch.randn(experts, 2 * inter, hidden, device=dev) / hidden**0.5).to(torch.bfloat16)
        w13 = s90.prepack_w13(w13_public)
        w2 = (torch.randn(experts, hidden, inter, device=dev) / inter**0.5).to(torch.bfloat16)
        for tokens in tokens_list:
            copies = 4  # each with its own routing, so that at small T the copies' experts are not all L2-resident
            counts_of = [make_counts("random", tokens, top_k, experts, gen) for _ in range(copies)]
            max_rows = tokens * top_k + experts * (ALIGN - 1)
            ros = [padded_layout(c, max_rows).to(dev) for c in counts_of]
            cns = [c.to(dev) for c in counts_of]
            counts, ro, cn = counts_of[0], ros[0], cns[0]  # copy 0: the one checked
            rows = int(counts.sum())
            active = sum(int((c > 0).sum()) for c in counts_of) / copies  # (bytes: the mean over the copies)
            a1 = [torch.randn(max_rows, hidden, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            a2 = [torch.randn(max_rows, inter, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            o1 = torch.empty(max_rows, inter, device=dev, dtype=torch.bfloat16)
            o2 = torch.empty(max_rows, hidden, device=dev, dtype=torch.bfloat16)
            rs = torch.rand(max_rows, device=dev)
            mask = valid_row_mask(ro, counts, max_rows).to(dev)
            refs = {
                G1: grouped_gemm1_reference(a1[0], w13_public, ro, cn, Activation.SWIGLU)[mask].float(),
                G2: grouped_gemm2_reference(a2[0], w2, ro, cn, rs)[mask].float(),
            }
            extra = [v for v in pingpong_variants() if not v[0].startswith("x_")] if pingpong else []
            for name, cfg, problem in bench_variants() + extra:
                if not name.startswith(model):
                    continue
                if problem.kind is G1:
                    fn = lambda i, cfg=cfg: s90.sm90_grouped_gemm1(a1[i], w13, ros[i], cns[i], Activation.SWIGLU, out=o1, config=cfg, kernel_directory=kdir)  # noqa: E731
                    n, k, out_n = 2 * inter, hidden, inter
                else:
                    fn = lambda i, cfg=cfg: s90.sm90_grouped_gemm2(a2[i], w2, ros[i], cns[i], row_scale=rs, out=o2, config=cfg, kernel_directory=kdir)  # noqa: E731
                    n, k, out_n = hidden, inter, hidden
                dog.arm(f"bench {name} T={tokens}", 2 * dog.seconds)
                ms = time_graph(fn, copies)
                (o1 if problem.kind is G1 else o2).fill_(float("nan"))
                fn(0)
                torch.cuda.synchronize()
                got = (o1 if problem.kind is G1 else o2)[mask].float()
                ref = refs[problem.kind]
                err = ((got - ref).norm() / ref.norm()).item()
                flops = 2.0 * rows * n * k
                bytes_moved = active * n * k * 2 + rows * k * 2 + rows * out_n * 2
                r = {"variant": name, "tokens": tokens, "rows": rows, "active_experts": active, "ms": ms, "err": err,
                     "ok": err < 1e-2,
                     "tflops": flops / ms / 1e9, "tbps": bytes_moved / ms / 1e9,
                     "floor_ms": max(flops / FLOOR_MATMUL_FLOPS, bytes_moved / FLOOR_BANDWIDTH) * 1e3}
                results.append(r)
                print(f"bench {name:36s} T={tokens:5d} rows {rows:6d} {ms * 1e3:9.1f} us "
                      f"{r['tflops']:7.1f} TFLOP/s {r['tbps']:6.2f} TB/s floor {r['floor_ms'] * 1e3:8.1f} us err {err:.1e}", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    b.add_argument("--keep-ptx", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("--kernel-dir", default=None)
    r.add_argument("--json", default=None)
    r.add_argument("--skip-check", action="store_true")
    r.add_argument("--watchdog", type=float, default=60.0, help="seconds one kernel call may take")
    r.add_argument("--skip-bench", action="store_true")
    r.add_argument("--only", nargs="*", default=None, help="check variants to run")
    r.add_argument("--no-pingpong", action="store_true", help="leave out the PINGPONG variants")
    r.add_argument("--routings", nargs="*", default=["random", "skewed", "zero_experts", "one_expert"],
                   choices=["random", "skewed", "zero_experts", "one_expert", "class_masked"])
    r.add_argument("--tokens", type=int, nargs="*", default=[16, 256, 2048, 8192])
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out, args.keep_ptx)
        return 0
    if not torch.cuda.is_available():
        print("hopper_gemm_bench run: needs a CUDA GPU", file=sys.stderr)
        return 2
    dog = Watchdog(args.watchdog)
    report = {"device": torch.cuda.get_device_name(), "checks": [], "bench": []}
    if not args.skip_check:
        report["checks"] = run_checks(args.kernel_dir, dog, args.only, args.routings, not args.no_pingpong)
    if not args.skip_bench:
        report["bench"] = run_bench(args.kernel_dir, dog, args.tokens, not args.no_pingpong)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    failed = [c for c in report["checks"] if not c["ok"]]
    bad_bench = [b["variant"] for b in report["bench"] if not b["ok"]]
    print(f"checks: {len(report['checks']) - len(failed)} pass, {len(failed)} fail; "
          f"bench results off the twin (err >= 1e-2): {bad_bench or 'none'}")
    failed += bad_bench
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
