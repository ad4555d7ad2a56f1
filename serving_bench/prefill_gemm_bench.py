"""Prefill-size grouped GEMMs on the H200, every model preset: CuTe vs Triton vs dense cuBLAS, one run.

For each model and token count: GEMM1 (fused gated activation) and GEMM2 (row scale) of the CuTe kernels
from one or more kernel bundles (labelled, e.g. a baseline bundle and a changed one; `--variants` picks
configurations), the Triton default configuration (and its tiles scheduled STATIC where the default is
DYNAMIC), a cuBLAS batched matmul over the experts at the same mean rows per expert without padding
(dense-bmm: the weight stream of a grouped GEMM, none of its spread), and one dense cuBLAS matmul with the
same total shape ([valid rows, K] x [K, N]: the practical ceiling a grouped GEMM cannot beat). Routing
(`--routing`): `random`, every token picks top_k distinct experts uniformly; `model`, the model's own router
on i.i.d. N(0,1) logits (the layer benchmark's `uniform` cells: group-limited routers such as DeepSeek-V3's
load some experts twice the mean); `balanced`, every expert T*k/E rows (+-1: no spread, and no tail where that
is a multiple of the tile).
Timing (METHOD.md): one CUDA graph per candidate holding 4 calls over 4 rotated input copies; the graphs
are replayed in 15 interleaved rounds (clocks drift with temperature and power during a run; interleaving
gives every candidate the same conditions) and each reports its median. Every grouped result is compared
with a float32 reference on the rows of a few experts before it is timed. `--profile` instead calls each
kernel once without a graph (for ncu). `--sustain SECONDS` then replays each candidate named by
`--sustain-only` (label prefixes; default the CuTe kernels and dense cuBLAS) back to back for that long and
reports its median board power, SM clock and clock event reasons (serving_bench/power.py), and the energy per
useful FLOP: whether a kernel is power-bound, and how it compares with dense cuBLAS at the same power.

    python -m moe2cta.serving_bench.prefill_gemm_bench --bundle base=.kernels/base --bundle new=.kernels/new \\
        --models deepseek-v3 gpt-oss-120b --tokens 2048 8192 --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import torch

from moe2cta.grouped_gemm import l2_sides
from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
from moe2cta.grouped_gemm import triton_grouped_gemm as tg
from moe2cta.grouped_gemm.epilogue import W13Layout
from moe2cta.grouped_gemm.reference import grouped_gemm1_reference, grouped_gemm2_reference
from moe2cta.presets import get_preset
from moe2cta.router import Scoring
from moe2cta.router.reference import route_reference
from moe2cta.serving_bench import l2_sides_probe
from moe2cta.serving_bench.distributions import make_correction_bias
from moe2cta.serving_bench.power import PowerSampler, idle_reading, stream_joules_per_byte, sustain
from moe2cta.serving_bench.hopper_gemm_bench import (
    ALIGN,
    Watchdog,
    capture_graph,
    make_counts,
    padded_layout,
    time_interleaved,
    valid_row_mask,
)

COPIES = 4
ROUNDS = 15
DYN, STATIC, SIDES = s90.Scheduler.DYNAMIC, s90.Scheduler.STATIC, s90.Scheduler.DYNAMIC_SIDES
EVEN = s90.ExpertSplit.EVEN
GROUPED = s90.Raster.GROUPED_M
EXPERT_GROUPED = s90.Raster.EXPERT_GROUPED_M


def variant_configs(problem, rows_per_expert: float | None = None) -> dict:
    """{name: config} of the CuTe kernels timed per GEMM: "default" (what the layer runs for this many rows
    per expert), "static" (the v5 default: STATIC, ALONG_N) and scheduling / raster / unit alternatives of
    the same tile (`--build` compiles the ones a preset bundle does not hold)."""
    base = s90.default_config(problem, s90.Scheduler.STATIC)
    rep = dataclasses.replace
    default = s90.default_config(problem, rows_per_expert=rows_per_expert)
    regular_cfg = s90.regular_config(problem, rows_per_expert=rows_per_expert)
    wide = s90.wide_config(problem)
    wide256n = s90.wide_config(problem, tile_m=128, max_tile_n=256)
    wide256n = wide256n if wide256n is not None and wide256n.tile_n == 256 else None
    token_rows = s90.token_rows_config(problem, rows_per_expert) if problem.kind is s90.GemmStage.GEMM1 else None
    # 128-wide N tiles (twice the units: fewer idle SMs in the last wave where a GEMM has few); None where N is no
    # multiple of 128
    tile_n128 = rep(regular_cfg, tile_n=128, raster=s90.regular_schedule(
        regular_cfg.work_unit, rows_per_expert, n_blocks=-(-problem.n // 128), stage=problem.kind)[1])
    tile_n128 = tile_n128 if regular_cfg.tile_n != 128 and s90.can_implement(tile_n128, problem)[0] else None
    # GEMM1 on 256-wide tiles where N is no multiple of 256 (a partial last n-block; gpt-oss: 22.5 n-blocks against
    # 30 of 192); GEMM2 of that variant: the regular one's
    tail256 = None
    if problem.kind is s90.GemmStage.GEMM2:
        tail256 = regular_cfg
    elif problem.n % 256:
        tail256 = rep(regular_cfg, tile_n=256, raster=s90.regular_schedule(
            regular_cfg.work_unit, rows_per_expert, n_blocks=-(-problem.n // 256), stage=problem.kind)[1])
        tail256 = tail256 if s90.can_implement(tail256, problem)[0] else None
    after = s90.EpilogueStore.AFTER_MAINLOOP  # each tile stored right after its mainloop (the default until v13)
    act = s90.EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP  # GEMM1's activation math under the next mainloop too
    return {
        "default": default,
        # the regular kernel storing each tile right after its mainloop, not under the next one (GEMM1 also on the
        # token rows; GEMM2 of that variant: the regular one's)
        "store_after": rep(regular_cfg, epilogue_store=after),
        "token_rows_store_after": (token_rows and rep(token_rows, epilogue_store=after))
        if problem.kind is s90.GemmStage.GEMM1 else rep(regular_cfg, epilogue_store=after),
        # GEMM1 with its activation math under the next mainloop too (GEMM2: the regular default)
        "activation_under": rep(regular_cfg, epilogue_store=act) if problem.kind is s90.GemmStage.GEMM1
        else regular_cfg,
        "token_rows_activation_under": (token_rows and rep(token_rows, epilogue_store=act))
        if problem.kind is s90.GemmStage.GEMM1 else regular_cfg,
        # GEMM1 reading the token rows itself (ASource.TOKEN_ROWS, what the layer runs at prefill), GEMM2 as the
        # regular default
        "token_rows": token_rows if problem.kind is s90.GemmStage.GEMM1 else regular_cfg,
        # the default GEMM1 (a wide tile at 96-256 rows per expert) reading the token rows itself, GEMM2 the default
        # (None where the default is a decode tile)
        "token_rows_default": s90.token_rows_twin(default, problem) if problem.kind is s90.GemmStage.GEMM1
        else default,
        # the regular (TOKENS_AS_M) kernel the layer would run for this many rows without the wide one
        "regular": regular_cfg,
        # the same raster and padding rows scheduled STATIC (consecutive units, which share a weight tile in the
        # grouped rasters, on consecutive CTAs); and with every padding row multiplied (units of equal length)
        "regular_static": rep(regular_cfg, scheduler=STATIC),
        "regular_static_multiply": rep(regular_cfg, scheduler=STATIC, padding_rows=s90.PaddingRows.MULTIPLY),
        # the same scheduled DYNAMIC_SIDES: each half of the unit order on one L2 partition's SMs (each --side-maps map
        # is timed as its own candidate); GEMM1 also on the token rows (GEMM2 of that variant: regular_sides)
        "regular_sides": rep(regular_cfg, scheduler=SIDES),
        "token_rows_sides": (token_rows and rep(token_rows, scheduler=SIDES))
        if problem.kind is s90.GemmStage.GEMM1 else rep(regular_cfg, scheduler=SIDES),
        # GEMM1 in the raster and padding-row mode of before v15 (ALONG_N / GROUPED_M, MULTIPLY); GEMM2 as regular
        "previous_gemm1": rep(regular_cfg, raster=s90.regular_schedule(
            regular_cfg.work_unit, rows_per_expert, n_blocks=-(-problem.n // regular_cfg.tile_n))[1],
            padding_rows=s90.PaddingRows.MULTIPLY) if problem.kind is s90.GemmStage.GEMM1 else regular_cfg,
        # the wide WEIGHTS_AS_M kernel (None where N fits no wide tile) and alternatives of it
        "wide": wide,
        "wide_step16": wide and rep(wide, token_step=16),
        "wide_step64": wide and rep(wide, token_step=64),
        "wide128": wide and rep(wide, tile_m=128),
        "wide_along_m": wide and rep(wide, raster=s90.Raster.ALONG_M),
        "wide_dynamic": wide and rep(wide, scheduler=DYN),
        # 160-row token tiles (an expert of 128 +- 32 rows in one unit) on up to 256 weight rows
        "wide160": s90.wide_config(problem, tile_m=s90.WIDE160_TILE_M, max_tile_n=256),
        # 288-row token tiles (an expert of 256 +- 32 rows in one unit) on 128 weight rows, a partial last n-block
        # where N is no multiple of 128
        "wide288": s90.wide_config(problem, tile_m=s90.WIDE288_TILE_M, tile_n=s90.WIDE288_TILE_N),
        "wide288_dynamic": s90.wide_config(problem, tile_m=s90.WIDE288_TILE_M, tile_n=s90.WIDE288_TILE_N, scheduler=DYN),
        "wide288_step16": s90.wide_config(problem, tile_m=s90.WIDE288_TILE_M, tile_n=s90.WIDE288_TILE_N, token_step=16),
        # the same tiles with each expert's rows spread evenly over its tiles (ExpertSplit.EVEN: 320 rows as 160 + 160)
        "wide160_even": s90.wide_config(problem, tile_m=s90.WIDE160_TILE_M, max_tile_n=256, expert_split=EVEN),
        "wide288_even": s90.wide_config(problem, tile_m=s90.WIDE288_TILE_M, tile_n=s90.WIDE288_TILE_N,
                                        expert_split=EVEN),
        # the same scheduled DYNAMIC (units of very different lengths where the experts spread: deepseek-v3)
        "wide160_even_dynamic": s90.wide_config(problem, tile_m=s90.WIDE160_TILE_M, max_tile_n=256,
                                                expert_split=EVEN, scheduler=DYN),
        "wide288_even_dynamic": s90.wide_config(problem, tile_m=s90.WIDE288_TILE_M, tile_n=s90.WIDE288_TILE_N,
                                                expert_split=EVEN, scheduler=DYN),
        # 128 token rows x 256 weight rows (two atoms per warpgroup): a regular stage's weight bytes (None where N
        # is no multiple of 256)
        "wide128_n256": wide256n,
        "wide128_n256_along_m": wide256n and rep(wide256n, raster=s90.Raster.ALONG_M),
        "tile_n128": tile_n128,
        # 64-row units (one consumer warpgroup): padding at 64-row granularity, one more weight pass per 64 rows
        "tile_m64": rep(regular_cfg, tile_m=64, padding_rows=s90.PaddingRows.MULTIPLY),
        # an expert's tail of <= 64 rows multiplied with the m-block before it on one weight pass (192-row units);
        # AFTER_MAINLOOP stores (compare with store_after)
        "fuse_tail": _implementable(rep(regular_cfg, padding_rows=s90.PaddingRows.FUSE_TAIL, epilogue_store=after),
                                    problem),
        # the same on 32-deep K tiles (7 stages: 56 KB stages of 64-deep ones leave room for 3 only)
        "fuse_tail_k32": _implementable(rep(regular_cfg, tile_k=32, padding_rows=s90.PaddingRows.FUSE_TAIL,
                                            epilogue_store=after), problem),
        # an expert of three m-blocks with its tail's columns split over its first two units (equal units)
        "split_tail": _implementable(rep(regular_cfg, padding_rows=s90.PaddingRows.SPLIT_TAIL, epilogue_store=after),
                                     problem),
        # store_after with the 3 stages fuse_tail has (what the shallower pipeline alone costs)
        "store_after_stages3": rep(regular_cfg, epilogue_store=after, stages=3),
        "tile_n256_tail": tail256,
        # the regular choice with the other PaddingRows choice (the regular kernel's only)
        "padding_flip": rep(regular_cfg, padding_rows=s90.PaddingRows.MULTIPLY
                            if regular_cfg.padding_rows is s90.PaddingRows.SKIP else s90.PaddingRows.SKIP),
        "static": base,
        "dynamic": rep(base, scheduler=DYN),
        "pair": rep(base, work_unit=s90.WorkUnit.PAIR, pair_threshold=1),
        "along_m_dynamic": rep(base, scheduler=DYN, raster=s90.Raster.ALONG_M),
        "grouped4_dynamic": rep(base, scheduler=DYN, raster=GROUPED, raster_group_m=4),
        "grouped8_dynamic": rep(base, scheduler=DYN, raster=GROUPED, raster_group_m=8),
        "grouped16_dynamic": rep(base, scheduler=DYN, raster=GROUPED, raster_group_m=16),
        "grouped8_static": rep(base, scheduler=STATIC, raster=GROUPED, raster_group_m=8),
        # groups cut at expert boundaries (every m-block of a group reads one weight tile)
        "expert_grouped4_dynamic": rep(base, scheduler=DYN, raster=EXPERT_GROUPED, raster_group_m=4),
        "expert_grouped8_dynamic": rep(base, scheduler=DYN, raster=EXPERT_GROUPED, raster_group_m=8),
        "expert_grouped16_dynamic": rep(base, scheduler=DYN, raster=EXPERT_GROUPED, raster_group_m=16),
        # weight sharing by construction with a tail's all-padding warpgroup idle (GEMM1 and GEMM2; GEMM2's default
        # already skips), on the gathered copy and (GEMM1) on the token rows
        "expert_grouped8_skip": rep(base, scheduler=DYN, raster=EXPERT_GROUPED, raster_group_m=8,
                                    padding_rows=s90.PaddingRows.SKIP),
        "token_rows_expert_grouped8_skip": (token_rows and rep(token_rows, raster=EXPERT_GROUPED, raster_group_m=8,
                                                               padding_rows=s90.PaddingRows.SKIP))
        if problem.kind is s90.GemmStage.GEMM1 else rep(base, scheduler=DYN, raster=EXPERT_GROUPED, raster_group_m=8,
                                                        padding_rows=s90.PaddingRows.SKIP),
        "pair_dynamic": rep(base, work_unit=s90.WorkUnit.PAIR, pair_threshold=1, scheduler=DYN),
        "pair_grouped4_dynamic": rep(base, work_unit=s90.WorkUnit.PAIR, pair_threshold=1, scheduler=DYN,
                                     raster=GROUPED, raster_group_m=4),
        # PAIR units whose all-padding warpgroups skip their MMAs: the two CTAs of a cluster release each stage
        # together, so a tail keeps its partner's pace (GEMM2's default already skips)
        "pair_skip": rep(base, work_unit=s90.WorkUnit.PAIR, pair_threshold=1, padding_rows=s90.PaddingRows.SKIP),
        "pair_dynamic_skip": rep(base, work_unit=s90.WorkUnit.PAIR, pair_threshold=1, scheduler=DYN,
                                 padding_rows=s90.PaddingRows.SKIP),
        "pair_grouped4_dynamic_skip": rep(base, work_unit=s90.WorkUnit.PAIR, pair_threshold=1, scheduler=DYN,
                                          raster=GROUPED, raster_group_m=4, padding_rows=s90.PaddingRows.SKIP),
    }


# Expert classes (a question for the layer, not its policy yet): each expert runs in the launch of the class its
# row count falls in, the classes one after another, each on its own padded layout (the other classes' experts have
# no rows there). A scheme: (variant, fewest rows, most rows) per class; the experts no class takes run "regular".
EXPERT_CLASS_SCHEMES = {
    "w160_w288": (("wide160_even", 1, 160), ("wide288_even", 161, 288)),  # every expert that fits one wide tile
    "w288": (("wide288_even", 1, 288),),
    "w160": (("wide160_even", 1, 160),),
    "tails": (("wide160_even", 129, 160), ("wide288_even", 257, 288)),  # the regular kernel's costliest tails
    "w160_w288_dynamic": (("wide160_even_dynamic", 1, 160), ("wide288_even_dynamic", 161, 288)),
}


def expert_classes(scheme: str, counts: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[(variant, the counts of its experts, 0 elsewhere)] of `scheme` over counts (int32 [E], CPU); classes
    without experts are left out, and "regular" takes every expert no class takes."""
    if scheme not in EXPERT_CLASS_SCHEMES:
        raise ValueError(f"scheme: expected one of {sorted(EXPERT_CLASS_SCHEMES)}, got {scheme!r}")
    taken = torch.zeros_like(counts, dtype=torch.bool)
    classes = []
    for variant, low, high in EXPERT_CLASS_SCHEMES[scheme]:
        mine = (counts >= low) & (counts <= high) & ~taken
        taken |= mine
        classes.append((variant, torch.where(mine, counts, 0)))
    classes.append(("regular", torch.where(taken, 0, counts)))
    return [(v, c) for v, c in classes if int(c.sum()) > 0]


@dataclasses.dataclass
class ClassLaunch:
    """One class of an expert-class scheme: its kernels, its padded layout and its own buffers."""
    cfg1: s90.Sm90GemmConfig
    cfg2: s90.Sm90GemmConfig
    row_offsets: torch.Tensor  # int32 [E+1] on the CPU (the other classes' experts have no rows)
    counts: torch.Tensor  # int32 [E] on the CPU (0 for the other classes' experts)
    row_offsets_dev: torch.Tensor
    counts_dev: torch.Tensor
    a1: list  # COPIES rotated GEMM1 inputs [rows, H]
    a2: list  # COPIES rotated GEMM2 inputs [rows, I]
    row_scale: torch.Tensor
    out1: torch.Tensor
    out2: torch.Tensor


def class_candidates(scheme, label, kdir, preset, counts, weights, cfgs1, cfgs2, dev):
    """[GEMM1 candidate, GEMM2 candidate] of one expert-class scheme, or a string saying why it cannot run. A candidate
    is (name, gemm, fn(copy), check()): fn runs every class's launch; check() poisons the outputs, runs copy 0 and
    returns the largest relative error against the float32 reference on the rows of each class's first two experts."""
    e, h, i = preset.num_experts, preset.hidden, preset.intermediate
    w13, w13_packed, w2, b13, b2 = weights
    p1, p2 = problems_of(preset)
    launches = []
    for variant, cls_counts in expert_classes(scheme, counts):
        cfg1, cfg2 = cfgs1[variant], cfgs2[variant]
        if cfg1 is None or cfg2 is None:
            return f"{variant}: no such configuration for this model"
        if not all((pathlib.Path(kdir) / f"{s90.kernel_key(c, p).file_stem()}.so").exists()
                   for c, p in ((cfg1, p1), (cfg2, p2))):
            return f"{variant}: not in bundle {kdir}"
        rows = int(((cls_counts + ALIGN - 1) // ALIGN * ALIGN).sum())
        ro = padded_layout(cls_counts, rows)
        launches.append(ClassLaunch(
            cfg1, cfg2, ro, cls_counts, ro.to(dev), cls_counts.to(dev),
            [torch.randn(rows, h, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)],
            [torch.randn(rows, i, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)],
            torch.rand(rows, device=dev), torch.empty(rows, i, device=dev, dtype=torch.bfloat16),
            torch.empty(rows, h, device=dev, dtype=torch.bfloat16)))

    def run1(c):
        for x in launches:
            s90.sm90_grouped_gemm1(x.a1[c], w13_packed, x.row_offsets_dev, x.counts_dev, preset.activation, b13=b13,
                                   out=x.out1, config=x.cfg1, kernel_directory=kdir)

    def run2(c):
        for x in launches:
            s90.sm90_grouped_gemm2(x.a2[c], w2, x.row_offsets_dev, x.counts_dev, row_scale=x.row_scale, b2=b2,
                                   out=x.out2, config=x.cfg2, kernel_directory=kdir)

    def checked(run, gemm):
        def check():
            for x in launches:
                (x.out1 if gemm == "gemm1" else x.out2).fill_(float("nan"))
            run(0)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            errors = []
            for x in launches:
                experts = [j for j in range(e) if int(x.counts[j]) > 0][:2]
                ref_counts = torch.zeros_like(x.counts)
                ref_counts[experts] = x.counts[experts]
                check_rows = torch.cat([torch.arange(int(x.row_offsets[j]), int(x.row_offsets[j]) + int(x.counts[j]))
                                        for j in experts]).to(dev)
                if gemm == "gemm1":
                    ref = grouped_gemm1_reference(x.a1[0], w13, x.row_offsets, ref_counts, preset.activation, b13,
                                                  out=torch.zeros(x.out1.shape, device=dev))
                    got = x.out1
                else:
                    ref = grouped_gemm2_reference(x.a2[0], w2, x.row_offsets, ref_counts, x.row_scale, b2,
                                                  out=torch.zeros(x.out2.shape, device=dev))
                    got = x.out2
                errors.append(_rel_err(got[check_rows], ref[check_rows]))
            return float("nan") if any(math.isnan(err) for err in errors) else max(errors)  # (max() drops a NaN)
        return check

    name = f"cute-{label}-classes-{scheme}"
    return [(name, "gemm1", run1, checked(run1, "gemm1")), (name, "gemm2", run2, checked(run2, "gemm2"))]


def _on_side_map(side_map, fn):
    """fn, installing the DYNAMIC_SIDES side map first where there is one (each call, so a graph captures its own)."""
    if side_map is None:
        return fn

    def call(c):
        l2_sides.set_side_map(side_map.device, side_map)
        return fn(c)
    return call


def _implementable(config, problem):
    """config where the kernel family can run it on problem, else None (the variant is skipped)."""
    return config if s90.can_implement(config, problem)[0] else None


def problems_of(preset):
    bf = torch.bfloat16
    return (s90.Sm90Problem(s90.GemmStage.GEMM1, 2 * preset.intermediate, preset.hidden, preset.num_experts, bf,
                            preset.activation, preset.has_bias),
            s90.Sm90Problem(s90.GemmStage.GEMM2, preset.hidden, preset.intermediate, preset.num_experts, bf,
                            None, preset.has_bias, True))


def build(models, out_dir: str, variants=None) -> None:
    """Compile (no GPU) every model's preset kernels plus the variant configurations (those named in `variants`,
    default all) into out_dir."""
    extra = []
    for name in models:
        preset = get_preset(name)
        for problem in problems_of(preset):
            configs = variant_configs(problem)
            chosen = configs.values() if variants is None else [configs[v] for v in variants]
            extra += [(cfg, problem) for cfg in dict.fromkeys(chosen) if cfg is not None]
        written = s90.compile_for_preset(preset, out_dir, extra_configs=extra)
        extra = []
        print(f"{name}: {len(written)} kernels -> {out_dir}", flush=True)
# every valid row of copy 0 is compared against the fp32 reference (before stop 52: the first 3 non-empty experts'
# rows, which a persistent scheduler hands out first, so that the schedule's tail was never checked)


def _weights(preset, dev, gen_seed: int):
    """Public w13 [E, 2I, H], packed w13, w2 [E, H, I] (bf16, generated on the device), biases or None."""
    torch.manual_seed(gen_seed)
    e, h, i = preset.num_experts, preset.hidden, preset.intermediate
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16).mul_(i**-0.5)
    b13 = torch.randn(e, 2 * i, device=dev) * 0.1 if preset.has_bias else None
    b2 = torch.randn(e, h, device=dev) * 0.1 if preset.has_bias else None
    return w13, s90.prepack_w13(w13), w2, b13, b2


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def routed_counts(routing: str, preset, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert (int32 [E], CPU) of one batch: `random` (top_k distinct experts per token, uniform),
    `model` (the preset's router, with a DeepSeek-style correction bias where it has one, on N(0,1) logits) or
    `balanced` (T*k/E rows each; the first T*k % E experts one more)."""
    if routing == "balanced":
        rows, experts = tokens * preset.top_k, preset.num_experts
        return (torch.full((experts,), rows // experts) + (torch.arange(experts) < rows % experts)).to(torch.int32)
    if routing == "random":
        return make_counts("random", tokens, preset.top_k, preset.num_experts, gen)
    logits = torch.randn(tokens, preset.num_experts, generator=gen)
    bias = None
    if preset.routing.scoring is Scoring.SIGMOID_GROUPED:
        bias = make_correction_bias(preset.num_experts, seed=int(torch.randint(1 << 30, (1,), generator=gen)),
                                    device="cpu")
    _, ids = route_reference(logits, preset.routing, bias)
    return torch.bincount(ids.flatten().long(), minlength=preset.num_experts).to(torch.int32)


def run_cell(preset, tokens, bundles, weights, dog, profile: bool, gen, variants=("default",),
             routing: str = "random", paddings: tuple[str, ...] = ("random",), sustain_s: float = 0.0,
             sustain_only: tuple[str, ...] = ("cute", "dense"), class_schemes: tuple[str, ...] = (),
             side_maps: tuple[tuple[str, list[int]], ...] = (("zero", [0]),)) -> list[dict]:
    """Time every candidate on this cell; with several `paddings`, the CuTe and Triton candidates once per
    content of A's padding rows (the valid rows are the same), labelled `<backend>@<padding>` past the first,
    all in the same interleaved rounds (one process: no process-to-process spread between them); per bundle also
    each of `class_schemes` (EXPERT_CLASS_SCHEMES: the experts split over kernels by their rows). A DYNAMIC_SIDES
    variant is timed once per `side_maps` entry (name, side of each SM id), labelled `<variant>[<name>]`."""
    dev = torch.device("cuda")
    e, h, i, k = preset.num_experts, preset.hidden, preset.intermediate, preset.top_k
    w13, w13_packed, w2, b13, b2 = weights
    counts = routed_counts(routing, preset, tokens, gen)
    max_rows = tokens * k + e * (ALIGN - 1)
    ro = padded_layout(counts, max_rows)
    rows = int(counts.sum())
    padded_rows = int(ro[-1])
    zero = torch.zeros(1, dtype=torch.int64)
    tile_offsets = torch.stack(
        [torch.cat([zero, ((counts.long() + t - 1) // t).cumsum(0)]) for t in tg.DEFAULT_TILE_HEIGHTS]
    ).to(torch.int32).to(dev).contiguous()
    ro_d, cn_d = ro.to(dev), counts.to(dev)
    a1 = [torch.randn(max_rows, h, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
    a2 = [torch.randn(max_rows, i, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
    pad = ~valid_row_mask(ro, counts, max_rows).to(dev)
    inputs = {}  # padding -> (A copies of GEMM1, A copies of GEMM2), the same valid rows
    for padding in paddings:
        p1s, p2s = (a1, a2) if not inputs else ([x.clone() for x in a1], [x.clone() for x in a2])
        for x in p1s + p2s:
            if padding == "zero":
                x[pad] = 0
            elif padding == "bits":  # uniformly random 16-bit patterns (what uninitialized memory may hold)
                x[pad] = torch.randint(-32768, 32768, (int(pad.sum()), x.shape[1]), device=dev,
                                       dtype=torch.int16).view(torch.bfloat16)
        inputs[padding] = (p1s, p2s)
    a1, a2 = inputs[paddings[0]]
    token_rows = None
    if any(v.startswith("token_rows") for v in variants):
        # GEMM1 on the token rows: T tokens, the valid rows read a random permutation of the T*k slots (padding
        # row r token r % T, as the kernel reads them); every candidate's A copies become the gathered rows (the
        # same values)
        a_rows = torch.full((max_rows,), -1, dtype=torch.int32)
        a_rows[valid_row_mask(ro, counts, max_rows)] = torch.randperm(rows, generator=gen).to(torch.int32)
        hidden = [torch.randn(tokens, h, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
        a_rows = a_rows.to(dev)
        source = torch.where(a_rows >= 0, a_rows // k, torch.arange(max_rows, device=dev) % tokens).long()
        for x, hc in zip(a1, hidden):
            x.copy_(hc[source])
        token_rows = (hidden, a_rows)
    rs = torch.rand(max_rows, device=dev)
    o1 = torch.empty(max_rows, i, device=dev, dtype=torch.bfloat16)
    o2 = torch.empty(max_rows, h, device=dev, dtype=torch.bfloat16)
    # reference on every valid row (every non-empty expert's)
    nonempty = [x for x in range(e) if int(counts[x]) > 0]
    check_rows = torch.cat([torch.arange(int(ro[x]), int(ro[x]) + int(counts[x])) for x in nonempty]).to(dev)
    ref_counts = counts.clone()
    # (the twin converts one expert at a time to fp32 and writes into an fp32 output)
    ref1 = grouped_gemm1_reference(a1[0], w13, ro, ref_counts, preset.activation, b13,
                                   out=torch.zeros(max_rows, i, device=dev))[check_rows]
    ref2 = grouped_gemm2_reference(a2[0], w2, ro, ref_counts, rs, b2,
                                   out=torch.zeros(max_rows, h, device=dev))[check_rows]
    tcfg1 = tg.default_config(tg.GroupedGemmProblem(s90.GemmStage.GEMM1, e, i, h, rows))
    tcfg2 = tg.default_config(tg.GroupedGemmProblem(s90.GemmStage.GEMM2, e, h, i, rows))
    p1, p2 = problems_of(preset)
    cfgs1, cfgs2 = variant_configs(p1, rows / e), variant_configs(p2, rows / e)
    candidates = []  # (label, gemm, fn(copy index))
    map_tensors = {map_name: l2_sides.set_side_map(dev, sides) for map_name, sides in side_maps}
    custom_checks = {}  # (label, gemm) -> check() of the candidates that write their own outputs
    for label, kdir in bundles:
        for scheme in class_schemes:
            made = class_candidates(scheme, label, kdir, preset, counts, weights, cfgs1, cfgs2, dev)
            if isinstance(made, str):
                print(f"{preset.name:16s} T={tokens:6d} cute-{label}-classes-{scheme}: {made}, skipped", flush=True)
                continue
            for name, gemm, fn, check in made:
                candidates.append((name, gemm, fn))
                custom_checks[name, gemm] = check
        timed = {}  # (GEMM1, GEMM2) configurations -> the variant timing them
        for v in variants:
            name = f"cute-{label}" + ("" if v == "default" else f"-{v}")
            if cfgs1[v] is None or cfgs2[v] is None:
                print(f"{preset.name:16s} T={tokens:6d} {name}: no such configuration for this model, skipped", flush=True)
                continue
            if (cfgs1[v], cfgs2[v]) in timed:
                print(f"{preset.name:16s} T={tokens:6d} {name}: the configurations of {timed[cfgs1[v], cfgs2[v]]}, "
                      "skipped", flush=True)
                continue
            timed[cfgs1[v], cfgs2[v]] = v
            missing = [cfg for cfg, p in ((cfgs1[v], p1), (cfgs2[v], p2))
                       if not (pathlib.Path(kdir) / f"{s90.kernel_key(cfg, p).file_stem()}.so").exists()]
            if missing:
                print(f"{preset.name:16s} T={tokens:6d} {name}: not in bundle {kdir}, skipped", flush=True)
                continue
            maps = [("", None)]
            if SIDES in (cfgs1[v].scheduler, cfgs2[v].scheduler):
                maps = [(f"[{map_name}]", map_tensors[map_name]) for map_name, _ in side_maps]
            for map_tag, side_map in maps:
                if v.startswith("token_rows"):
                    if token_rows is None or len(paddings) > 1:
                        print(f"{preset.name:16s} T={tokens:6d} {name}: one padding only, skipped", flush=True)
                        break
                    hidden, a_rows = token_rows
                    candidates += [
                        (name + map_tag, "gemm1", _on_side_map(side_map, lambda c, kdir=kdir, cfg=cfgs1[v]: (
                            s90.sm90_grouped_gemm1(hidden[c], w13_packed, ro_d, cn_d, preset.activation, b13=b13,
                                                   out=o1, config=cfg, kernel_directory=kdir, a_rows=a_rows,
                                                   rows_per_token=k)))),
                    ]
                    continue
                for padding, (x1, x2) in inputs.items():
                    tag = ("" if padding == paddings[0] else f"@{padding}") + map_tag
                    candidates += [
                        (name + tag, "gemm1", _on_side_map(side_map, lambda c, kdir=kdir, cfg=cfgs1[v], x1=x1: (
                            s90.sm90_grouped_gemm1(x1[c], w13_packed, ro_d, cn_d, preset.activation, b13=b13,
                                                   out=o1, config=cfg, kernel_directory=kdir)))),
                        (name + tag, "gemm2", _on_side_map(side_map, lambda c, kdir=kdir, cfg=cfgs2[v], x2=x2: (
                            s90.sm90_grouped_gemm2(x2[c], w2, ro_d, cn_d, row_scale=rs, b2=b2, out=o2, config=cfg,
                                                   kernel_directory=kdir)))),
                    ]
    static = tg.TileScheduler.STATIC
    for label, t1, t2 in (("triton", tcfg1, tcfg2),  # the default; and its tiles scheduled STATIC
                          ("triton-static", dataclasses.replace(tcfg1, scheduler=static),
                           dataclasses.replace(tcfg2, scheduler=static))):
        if label != "triton" and (t1, t2) == (tcfg1, tcfg2):
            continue
        for padding, (x1, x2) in inputs.items():
            if padding != paddings[0] and label != "triton":
                continue
            tag = "" if padding == paddings[0] else f"@{padding}"
            candidates += [
                (label + tag, "gemm1", lambda c, t1=t1, x1=x1: tg.triton_grouped_gemm1(
                    x1[c], w13, ro_d, cn_d, tile_offsets, preset.activation, b13=b13, out=o1, config=t1)),
                (label + tag, "gemm2", lambda c, t2=t2, x2=x2: tg.triton_grouped_gemm2(
                    x2[c], w2, ro_d, cn_d, tile_offsets, row_scale=rs, b2=b2, out=o2, config=t2)),
            ]
    # the Triton default on the packed w13 (W13Layout.CHUNKED: what a layer that also runs CuTe feeds it)
    candidates.append(("triton-chunked", "gemm1", lambda c: tg.triton_grouped_gemm1(
        a1[c], w13_packed, ro_d, cn_d, tile_offsets, preset.activation, b13=b13, out=o1, config=tcfg1,
        w13_layout=W13Layout.CHUNKED)))
    if token_rows is not None:
        # what the gathered-copy GEMM1 needs first: the layer's gather launch (hidden -> expert order, with GEMM2's
        # row weights and hidden[0] into the padding rows) on the same permutation
        from moe2cta.router import api as router
        from moe2cta.router.reference import Dispatch

        hidden, a_rows = token_rows
        slot_rows = torch.full((tokens * k,), -1, dtype=torch.int32, device=dev)
        valid = a_rows >= 0
        slot_rows[a_rows[valid].long()] = torch.nonzero(valid).flatten().to(torch.int32)
        disp = Dispatch(cn_d, None, ro_d, None, a_rows, slot_rows, ALIGN, ())
        slot_weights = torch.rand(tokens, k, device=dev)
        row_weights = torch.empty(max_rows, device=dev)
        gathered = torch.empty(max_rows, h, device=dev, dtype=torch.bfloat16)
        candidates += [
            ("gather", "gemm1", lambda c: router.gather(hidden[c], disp, k, out=gathered, slot_weights=slot_weights,
                                                        row_weights_out=row_weights,
                                                        padding=router.GatherPadding.TOKEN_ROW)),
            ("row-weights", "gemm1", lambda c: router.scatter_row_weights(slot_weights, disp, row_weights)),
        ]
    dense_w1, dense_w2 = w13[0].t(), w2[0].t()  # [H, 2I], [I, H]
    d1 = torch.empty(rows, 2 * i, device=dev, dtype=torch.bfloat16)
    d2 = torch.empty(rows, h, device=dev, dtype=torch.bfloat16)
    candidates += [
        ("dense-cublas", "gemm1", lambda c: torch.mm(a1[c][:rows], dense_w1, out=d1)),
        ("dense-cublas", "gemm2", lambda c: torch.mm(a2[c][:rows], dense_w2, out=d2)),
    ]
    if rows % e == 0:
        # cuBLAS batched over the experts with the same rows per expert and no padding (rows / E each): every
        # expert's weights streamed once beside its MMAs, as in a grouped GEMM, without the routing's spread
        m = rows // e
        bmm_out1 = torch.empty(e, m, 2 * i, device=dev, dtype=torch.bfloat16)
        bmm_out2 = torch.empty(e, m, h, device=dev, dtype=torch.bfloat16)
        candidates += [
            ("dense-bmm", "gemm1", lambda c: torch.bmm(a1[c][:rows].view(e, m, h), w13.transpose(1, 2), out=bmm_out1)),
            ("dense-bmm", "gemm2", lambda c: torch.bmm(a2[c][:rows].view(e, m, i), w2.transpose(1, 2), out=bmm_out2)),
        ]
    # check every candidate first, then capture one graph per candidate and replay them in interleaved
    # rounds (candidate A, B, C, A, B, C, ...): clocks drift with temperature and power over a run, and
    # interleaving gives every candidate the same conditions (median per candidate)
    errors, raised = {}, {}
    for label, gemm, fn in candidates:
        dog.arm(f"{preset.name} T={tokens} {label} {gemm}", 4 * dog.seconds)
        try:
            if profile:
                fn(0)
                torch.cuda.synchronize()
                continue
            if (label, gemm) in custom_checks:
                errors[(label, gemm)] = custom_checks[label, gemm]()
            elif not label.startswith(("dense", "gather", "row-weights")):
                out = o1 if gemm == "gemm1" else o2
                out.fill_(float("nan"))
                fn(0)
                torch.cuda.synchronize()
                errors[(label, gemm)] = _rel_err(out[check_rows], ref1 if gemm == "gemm1" else ref2)
        except Exception as exc:  # (a kernel a bundle cannot serve, say): that candidate out, the rest timed
            torch.cuda.synchronize()
            text = str(exc).strip()
            raised[(label, gemm)] = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
            print(f"{preset.name:16s} T={tokens:6d} {gemm} {label:30s} not timed: {raised[label, gemm]}", flush=True)
    if profile:
        return []
    failed = [{"model": preset.name, "tokens": tokens, "routing": routing, "gemm": gemm, "backend": label, "ms": None,
               "tflops": None, "err": None, "ok": False, "error": raised[label, gemm]}
              for label, gemm, _ in candidates if (label, gemm) in raised]
    candidates = [c for c in candidates if (c[0], c[1]) not in raised]
    dog.arm(f"{preset.name} T={tokens} timing", 20 * dog.seconds)
    times = time_interleaved([fn for _, _, fn in candidates], COPIES, ROUNDS)
    readings = {}
    idle = None
    if sustain_s > 0:  # power and clock of each named candidate replayed back to back (after the timed rounds)
        sampler = PowerSampler(torch.cuda.current_device())
        limit = sampler.power_limit_w()
        idle = idle_reading(1.0)  # the card at rest first: energies above idle for the weight stream's pJ/byte
        for label, gemm, fn in candidates:
            if label.startswith(sustain_only):
                dog.arm(f"{preset.name} T={tokens} {label} {gemm} sustained", 4 * dog.seconds + sustain_s)
                readings[(label, gemm)] = sustain(capture_graph(fn, COPIES), COPIES, sustain_s, sampler,
                                                  power_limit_w=limit)
    results = []
    for (label, gemm, _), ms in zip(candidates, times):
        n, kk = (2 * i, h) if gemm == "gemm1" else (h, i)
        err = errors.get((label, gemm))
        flops = 2.0 * rows * n * kk
        padding = label.partition("@")[2].partition("[")[0] or paddings[0]  # ("[map]": a side map's tag)
        gemm_like = not label.startswith(("gather", "row-weights"))  # (those two move rows: no FLOPs, no check)
        r = {"model": preset.name, "tokens": tokens, "routing": routing, "padding": padding,
             "busiest": int(counts.max()) * e / rows, "gemm": gemm if gemm_like else None, "backend": label,
             "rows": rows, "padded_rows": padded_rows, "ms": ms, "tflops": flops / ms / 1e9 if gemm_like else None,
             "err": err, "ok": (err is None or err < 1e-2) if gemm_like else None}
        results.append(r)
        rate = f"{r['tflops']:6.1f} TFLOP/s" if gemm_like else "   (no GEMM)"
        print(f"{preset.name:16s} T={tokens:6d} {gemm} {label:30s} {ms * 1e3:9.1f} us {rate} "
              f"rows {rows} padded {padded_rows} err {err if err is None else f'{err:.1e}'}", flush=True)
        reading = readings.get((label, gemm))
        if reading is not None:
            r["sustained"] = reading.to_json() | {"pj_per_flop": reading.joules_per_call() / flops * 1e12}
            print(f"{'':16s} {'':8s} {gemm} {label:30s} sustained {reading.ms_per_call * 1e3:9.1f} us "
                  f"{reading.power_w:6.1f} W (limit {reading.power_limit_w}) {reading.sm_mhz:6.0f} MHz "
                  f"{reading.temperature_c:4.0f} C {r['sustained']['pj_per_flop']:.3f} pJ/FLOP "
                  f"{'|'.join(reading.reasons) or 'no clock event'}", flush=True)
            dense = readings.get(("dense-cublas", gemm))
            if label == "dense-bmm" and dense is not None:
                # the bmm streams every expert's weights, the dense matmul one expert's: the same FLOPs
                extra = (e - 1) * n * kk * 2
                r["stream_pj_per_byte"] = stream_joules_per_byte(reading, dense, extra, idle.power_w) * 1e12
                r["idle_w"] = idle.power_w
                print(f"{'':16s} {'':8s} {gemm} weight stream {r['stream_pj_per_byte']:.1f} pJ/byte above idle "
                      f"({idle.power_w:.0f} W): dense-bmm against dense-cublas, {extra / 1e9:.1f} GB more", flush=True)
    return results + failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", action="append", default=[], metavar="LABEL=DIR",
                        help="a CuTe kernel bundle to time (repeatable)")
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3",
                                                        "gpt-oss-120b", "mixtral-8x7b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--routing", choices=["random", "model", "balanced"], default="random",
                        help="random: top_k distinct experts per token, uniform; model: the model's own router; "
                             "balanced: T*k/E rows per expert")
    parser.add_argument("--padding", choices=["random", "zero", "bits"], nargs="+", default=["random"],
                        help="content of the padding rows of A: N(0,1) values (default), zeros (what the Triton "
                             "layer path multiplies) or random bit patterns (uninitialized memory); several: "
                             "the CuTe and Triton candidates once per content, in the same rounds")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true", help="one eager call per kernel, no timing (for ncu)")
    parser.add_argument("--watchdog", type=float, default=60.0)
    parser.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                        help="after the timed rounds, replay each --sustain-only candidate back to back this long "
                             "and report board power, SM clock and energy per useful FLOP (0: off)")
    parser.add_argument("--sustain-only", nargs="+", default=["cute", "dense"], metavar="PREFIX",
                        help="label prefixes of the candidates --sustain measures")
    names = sorted(variant_configs(problems_of(get_preset("qwen3-30b-a3b"))[0]))
    parser.add_argument("--variants", nargs="+", default=None, choices=names, metavar="VARIANT",
                        help=f"CuTe configurations to time per bundle (default: default), or to compile with --build "
                             f"(default: all), of: {', '.join(names)}")
    parser.add_argument("--expert-classes", nargs="+", default=[], choices=sorted(EXPERT_CLASS_SCHEMES),
                        metavar="SCHEME", help="also time, per bundle, each expert-class scheme (experts split over "
                        f"kernels by their rows): {', '.join(sorted(EXPERT_CLASS_SCHEMES))}")
    parser.add_argument("--side-maps", nargs="+", default=["zero"], metavar="NAME=SPEC",
                        help="the side maps each DYNAMIC_SIDES variant is timed with: SPEC a builtin map "
                             f"({', '.join(l2_sides_probe.BUILTIN_MAPS)}) or an l2_sides_probe JSON; NAME=SPEC or "
                             "just a builtin's name (default: zero, the DYNAMIC order)")
    parser.add_argument("--build", metavar="DIR", default=None, help="compile the kernels (no GPU) into DIR and exit")
    args = parser.parse_args(argv)
    for name in args.models:
        try:
            get_preset(name)
        except ValueError as exc:
            parser.error(f"--models: {exc}")
    if args.sustain < 0 or 0 < args.sustain <= 1.0:
        parser.error(f"--sustain: expected 0 (off) or more than 1 s (the first second settles), got {args.sustain}")
    if args.build:
        build(args.models, args.build, args.variants)
        return 0
    variants = args.variants or ["default"]
    bundles = []
    for spec in args.bundle:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            parser.error(f"--bundle: expected LABEL=DIR, got {spec!r}")
        bundles.append((label, path))
    side_maps = []
    for spec in args.side_maps:
        map_name, _, source = spec.rpartition("=")
        try:
            side_maps.append((map_name or source, l2_sides_probe.load_side_map(source)))
        except ValueError as err:
            parser.error(f"--side-maps: {err}")
    if not torch.cuda.is_available():
        print("prefill_gemm_bench: needs a CUDA GPU (only --build runs without one)", file=sys.stderr)
        return 2
    dog = Watchdog(args.watchdog)
    gen = torch.Generator().manual_seed(11)
    results = []
    for name in args.models:
        preset = get_preset(name)
        weights = _weights(preset, torch.device("cuda"), 5)
        for tokens in args.tokens:
            results += run_cell(preset, tokens, bundles, weights, dog, args.profile, gen, variants, args.routing,
                                tuple(dict.fromkeys(args.padding)), args.sustain, tuple(args.sustain_only),
                                tuple(args.expert_classes), tuple(side_maps))
        del weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    bad = [f"{r['model']} T={r['tokens']} {r['gemm']} {r['backend']}" for r in results if r["ok"] is False]
    print(f"results off the reference: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
