"""Hopper (sm_90a) grouped GEMM family: the policies that pick a configuration, the kernel key, compile, and the host API.

The configuration layer (enums, Sm90GemmConfig, Sm90Problem, the measured limits, the SMEM model, can_implement) is
sm90_config.py; every public name of it is re-exported here.

Three kernels, each described (warp roles, pipelines, limits) in its own file, which imports the CuTe DSL and
is imported lazily from here: cute_backend.py (token rows as the wgmma M side: 64/128-row tiles, pair
units with weight multicast), cute_fused_tail_backend.py (PaddingRows.FUSE_TAIL: the same with an expert's tail
of <= 64 rows multiplied on the m-block before it) and cute_swapped_backend.py (Operands.WEIGHTS_AS_M: weight rows
as the M side; 8-64 token rows per unit for decode, or "wide" token tiles of 128/160/256/288 rows whose wgmma N is the
unit's valid rows rounded up to `token_step`). This module needs neither a GPU nor the DSL to import.

Host API (semantics of grouped_gemm/reference.py):
  prepack_w13(w13) -> packed            once at weight load: gate/up rows interleaved in chunks of 8
  sm90_grouped_gemm1(a, packed_w13, row_offsets, counts, activation, b13=None, out=None, config=None)
  sm90_grouped_gemm2(a, w2, row_offsets, counts, row_scale=None, b2=None, out=None, config=None)
Kernels come from a `KernelCache` (cute_runtime.py): a prebuilt bundle's kernel from `kernel_dir()` (argument or
$MOE2CTA_KERNEL_DIR read at call time) where the bundle holds it, else JIT where the DSL is installed (also where a
bundle's library cannot be loaded, with a warning); a kernel neither is recorded as
kernel_request(config, problem) in $MOE2CTA_KERNEL_REQUESTS when set, for compile_requests (`aot build --requests`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from . import l2_sides
from .budget import ARCH_LIMITS, Arch, WorkUnit
from .cute_runtime import KernelCache, KernelKey
from .epilogue import Activation, GemmStage, pack_gate_up_rows, parse_epilogue_name
from .operands import require_own_memory
from .sm90_config import (  # the configuration layer, re-exported
    FAMILY, ENTRY_ABI, EPILOGUE_SMEM_STAGES, EPILOGUE_TILE_N, N_TAIL_ALIGN, BARRIER_RESERVE_BYTES, METADATA_RESERVE_BYTES,
    Scheduler, Raster, GROUPED_RASTERS, Consumers, PaddingRows, EpilogueStore, ASource, ExpertSplit, DependentLaunch,
    Operands, SWAPPED_TILE_M, WIDE_TILE_M, WGMMA_MAX_N, WIDE_TILE_N, WIDE_ROW_ALIGN, WIDE_MAX_ACC_ELEMS, WIDE_EPI_PAD,
    SWAPPED_MAX_ROWS_PER_EXPERT, SWAPPED_TILE_M_LIMITS, SWAPPED_TILE_N, SWAPPED_TILE_K, SWAPPED_PRESET_ROWS,
    GROUPED_RASTER_MIN_ROWS, GROUPED_RASTER_GROUP_M, GEMM1_RASTER, GEMM1_EXPERT_GROUPED_MAX_ROWS, ALONG_N_MAX_ROWS,
    ALONG_N_MAX_N_BLOCKS, WIDE_TILE_K, WIDE_TOKEN_STEP, WIDE_MAX_EXPERTS, WIDE_ROWS_PER_EXPERT,
    WIDE_GEMM2_ROWS_PER_EXPERT, WIDE160_ROWS_PER_EXPERT, WIDE160_TILE_M, WIDE288_ROWS_PER_EXPERT, WIDE288_TILE_M,
    WIDE288_TILE_N, WIDE288_MAX_EXPERTS, WIDE288_GEMM2_MIN_K, WIDE288_LONG_K_GEMM2_MIN_K, WIDE288_LONG_K_MAX_ROWS,
    WIDE_EXPERT_SPLIT, row_alignment, wide_token_box, wide_epilogue_rows, wide_epilogue_bytes, Sm90GemmConfig, Sm90Problem,
    FUSED_TAIL_PARTS, unit_rows, smem_bytes, resolve_stages, can_implement, _dtype_name, _memoized,
)

__all__ = [
    "Scheduler",
    "Raster",
    "Consumers",
    "Operands",
    "PaddingRows",
    "EpilogueStore",
    "ASource",
    "ExpertSplit",
    "DependentLaunch",
    "Sm90GemmConfig",
    "Sm90Problem",
    "can_implement",
    "smem_bytes",
    "unit_rows",
    "resolve_stages",
    "default_config",
    "regular_config",
    "default_padding_rows",
    "default_epilogue_store",
    "regular_schedule",
    "swapped_config",
    "wide_config",
    "wide_default",
    "ExpertClass",
    "expert_classes",
    "class_bounds",
    "class_counts",
    "EXPERT_CLASS_MAX_ROWS",
    "EXPERT_CLASSES_GEMM2_MIN_K",
    "default_overrides_tuning",
    "prepack_w13",
    "pack_gate_up_rows",
    "epilogue_operands",
    "KernelBias",
    "kernel_bias",
    "kernel_key",
    "compile_kernel",
    "prepare_device",
    "config_for_rows",
    "persistent_ctas",
    "sm90_grouped_gemm1",
    "sm90_grouped_gemm2",
    "compile_for_preset",
    "compile_requests",
    "kernel_from_key",
    "kernel_request",
    "preset_configs",
]


def _checked_rows_per_expert(rows_per_expert: float | None) -> float | None:
    """rows_per_expert as given (None: unknown), after checking it is a finite number >= 0."""
    if rows_per_expert is None:
        return None
    if isinstance(rows_per_expert, bool) or not isinstance(rows_per_expert, (int, float)):
        raise TypeError(f"rows_per_expert: expected a number (e.g. T * k / E), got {type(rows_per_expert).__name__}")
    if not math.isfinite(rows_per_expert) or rows_per_expert < 0:
        raise ValueError(f"rows_per_expert: expected a finite number >= 0, got {rows_per_expert}")
    return rows_per_expert


def swapped_config(problem: Sm90Problem, rows_per_expert: float) -> Sm90GemmConfig | None:
    """The WEIGHTS_AS_M (decode) kernel for about `rows_per_expert` rows per expert, or None where the
    regular kernel is the better choice (more than SWAPPED_MAX_ROWS_PER_EXPERT rows) or none fits."""
    if rows_per_expert is None:
        raise TypeError("rows_per_expert: expected a number (e.g. T * k / E), got NoneType")
    _checked_rows_per_expert(rows_per_expert)
    if rows_per_expert > SWAPPED_MAX_ROWS_PER_EXPERT:
        return None
    tile_m = next(m for most, m in SWAPPED_TILE_M_LIMITS if rows_per_expert <= most)
    # experts hit: at most one per routed row (T * k = rows_per_expert * E); units = experts hit x n-blocks
    experts_hit = problem.num_experts * min(1.0, rows_per_expert)
    tile_n = SWAPPED_TILE_N
    while tile_n > 64 and experts_hit * (problem.n // tile_n) < ARCH_LIMITS[Arch.SM90].num_sms / 2:
        tile_n //= 2  # e.g. mixtral T=1 GEMM2: 2 experts x 32 n-blocks would leave half the SMs idle
    for tile_n in dict.fromkeys((tile_n, 128, 64)):
        # ALONG_N: the CTAs in flight stream neighbouring weight tiles of one expert (measured 5-10% faster)
        cfg = Sm90GemmConfig(tile_m=tile_m, tile_n=tile_n, tile_k=SWAPPED_TILE_K, raster=Raster.ALONG_N,
                             operands=Operands.WEIGHTS_AS_M)
        if can_implement(cfg, problem)[0]:
            return cfg
    return None


def wide_config(problem: Sm90Problem, tile_m: int = 256, token_step: int = WIDE_TOKEN_STEP,
                scheduler: Scheduler = Scheduler.STATIC, raster: Raster = Raster.ALONG_N,
                max_tile_n: int = 128, tile_n: int | None = None,
                expert_split: ExpertSplit = ExpertSplit.FILL) -> Sm90GemmConfig | None:
    """The wide WEIGHTS_AS_M kernel for `problem`: the most weight rows per unit up to max_tile_n that fit (N must
    be a multiple), or exactly `tile_n` weight rows where given (a partial last n-block where N is no multiple), or
    None where none fits."""
    candidates = (tile_n,) if tile_n is not None else sorted(
        (n for n in WIDE_TILE_N if n <= max_tile_n and problem.n % n == 0), reverse=True)
    for weight_rows in candidates:
        cfg = Sm90GemmConfig(tile_m=tile_m, tile_n=weight_rows, tile_k=WIDE_TILE_K, scheduler=scheduler, raster=raster,
                             operands=Operands.WEIGHTS_AS_M, token_step=token_step, expert_split=expert_split)
        if can_implement(cfg, problem)[0]:
            return cfg
    return None


def wide_default(problem: Sm90Problem, rows_per_expert: float, scheduler: Scheduler | None = None
                 ) -> Sm90GemmConfig | None:
    """The wide kernel where default_config picks it for this estimate (see WIDE160_ROWS_PER_EXPERT,
    WIDE288_ROWS_PER_EXPERT with WIDE288_LONG_K_MAX_ROWS, WIDE_ROWS_PER_EXPERT and WIDE_GEMM2_ROWS_PER_EXPERT), else None."""
    lo, hi = WIDE160_ROWS_PER_EXPERT
    if lo < rows_per_expert <= hi:
        cfg = wide_config(problem, tile_m=WIDE160_TILE_M, scheduler=scheduler or Scheduler.STATIC, max_tile_n=256,
                          expert_split=WIDE_EXPERT_SPLIT)
        if cfg is not None and cfg.tile_n == 256:
            return cfg
    lo, hi = WIDE288_ROWS_PER_EXPERT
    if problem.kind is GemmStage.GEMM2 and problem.k >= WIDE288_LONG_K_GEMM2_MIN_K:
        hi = WIDE288_LONG_K_MAX_ROWS
    if (lo < rows_per_expert <= hi and problem.num_experts <= WIDE288_MAX_EXPERTS
            and (problem.kind is GemmStage.GEMM1 or problem.k >= WIDE288_GEMM2_MIN_K)):
        cfg = wide_config(problem, tile_m=WIDE288_TILE_M, scheduler=scheduler or Scheduler.STATIC,
                          tile_n=WIDE288_TILE_N, expert_split=WIDE_EXPERT_SPLIT)
        if cfg is not None:
            return cfg
    lo, hi = WIDE_ROWS_PER_EXPERT
    if problem.num_experts <= WIDE_MAX_EXPERTS and lo < rows_per_expert <= hi:
        return wide_config(problem, scheduler=scheduler or Scheduler.STATIC)
    lo, hi = WIDE_GEMM2_ROWS_PER_EXPERT
    if problem.kind is GemmStage.GEMM2 and lo < rows_per_expert <= hi:
        return wide_config(problem, tile_m=128, scheduler=scheduler or Scheduler.STATIC)
    return None


# Expert classes: one launch per class of experts by their rows, each on the kernel those rows suit, where the
# 288-row tile alone is refused for having too many experts (WIDE288_MAX_EXPERTS: a spread such as deepseek-v3's gives
# many experts a second tile). Measured (results/deepseek-peer-routing-h200-2026-12-04/run2, deepseek-v3 T=8192, 256
# rows per expert on 256 experts, against the regular kernel, GEMM1 / GEMM2): under the model's own router (0-536 rows
# per expert) 0.970 / 0.988, under a near-balanced one (each token's top-8 uniform, 216-300 rows) 0.877 / 0.965; the
# 288-row tile alone 1.025 / 1.118 and 0.883 / 0.986. GEMM2 only at K >= EXPERT_CLASSES_GEMM2_MIN_K (its wide tiles
# lose at short K, WIDE288_GEMM2_MIN_K).
EXPERT_CLASS_MAX_ROWS = (WIDE160_TILE_M, WIDE288_TILE_M)  # the 160- and 288-row classes; the regular kernel above
EXPERT_CLASSES_GEMM2_MIN_K = 2048


@dataclasses.dataclass(frozen=True)
class ExpertClass:
    """One launch of a GEMM split over expert classes: `config` multiplies the experts of more than the previous
    class's max_rows rows (0 for the first) and at most `max_rows` (None: no upper limit)."""

    config: Sm90GemmConfig
    max_rows: int | None


@_memoized
def expert_classes(problem: Sm90Problem, rows_per_expert: float | None) -> tuple[ExpertClass, ...]:
    """The classes the layer splits this GEMM over for about `rows_per_expert` rows per expert (a host-side
    estimate): the 160-row wide tile up to 160 rows, the 288-row one up to 288 (both ExpertSplit.EVEN), the regular
    default above. Where WIDE288_ROWS_PER_EXPERT rows per expert fall on more than WIDE288_MAX_EXPERTS experts (GEMM2
    at K >= EXPERT_CLASSES_GEMM2_MIN_K); () elsewhere: one launch of default_config. class_counts gives each launch
    its experts' counts (the others' zero), on the device, so every class's kernel must take expert subsets
    (Sm90GemmConfig.takes_expert_subsets)."""
    if not isinstance(problem, Sm90Problem):
        raise TypeError(f"problem: expected an Sm90Problem, got {problem!r}")
    lo, hi = WIDE288_ROWS_PER_EXPERT
    if (rows_per_expert is None or not lo < rows_per_expert <= hi or problem.num_experts <= WIDE288_MAX_EXPERTS
            or (problem.kind is GemmStage.GEMM2 and problem.k < EXPERT_CLASSES_GEMM2_MIN_K)):
        return ()
    regular = default_config(problem, rows_per_expert=rows_per_expert)
    w160 = wide_config(problem, tile_m=WIDE160_TILE_M, max_tile_n=256, expert_split=ExpertSplit.EVEN)
    w288 = wide_config(problem, tile_m=WIDE288_TILE_M, tile_n=WIDE288_TILE_N, expert_split=ExpertSplit.EVEN)
    if (w160 is None or w288 is None or regular.operands is not Operands.TOKENS_AS_M
            or not all(c.takes_expert_subsets for c in (w160, w288, regular))):
        return ()
    return (ExpertClass(w160, EXPERT_CLASS_MAX_ROWS[0]), ExpertClass(w288, EXPERT_CLASS_MAX_ROWS[1]),
            ExpertClass(regular, None))


_CLASS_BOUNDS: dict = {}


def class_bounds(device) -> torch.Tensor:
    """int32 [2] on `device`: EXPERT_CLASS_MAX_ROWS, the boundaries class_counts takes. Made once per device (a
    host-to-device copy: the first call must be outside any graph capture; MoELayer makes it when it is built), then
    shared: read it, never write it."""
    key = l2_sides.device_key(device)
    if key not in _CLASS_BOUNDS:
        _CLASS_BOUNDS[key] = torch.tensor(EXPERT_CLASS_MAX_ROWS, dtype=torch.int32, device=torch.device(*key))
    return _CLASS_BOUNDS[key]


def class_counts(counts: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """int32 [classes, E]: row c holds counts[e] for the experts of class c (more than bounds[c - 1] rows, at most
    bounds[c]) and 0 for the others, so that each class's launch skips the others' experts. Device work only (a few
    small launches), no host sync."""
    if counts.dtype != torch.int32 or counts.dim() != 1:
        raise TypeError(f"counts: expected int32 [E], got {counts.dtype} {tuple(counts.shape)}")
    if bounds.dtype != torch.int32 or bounds.dim() != 1 or bounds.device != counts.device:
        raise TypeError(f"bounds: expected int32 [classes - 1] on {counts.device} (class_bounds), got {bounds.dtype} "
                        f"{tuple(bounds.shape)} on {bounds.device}")
    num_experts = counts.numel()
    padded = torch.nn.functional.pad(counts, (0, -num_experts % 4))  # each row 16-byte aligned, as a fresh tensor is
    which = torch.bucketize(padded, bounds)  # class of each expert: bounds[c - 1] < count <= bounds[c]
    ids = torch.arange(bounds.numel() + 1, device=counts.device, dtype=which.dtype)
    return torch.where(which[None, :] == ids[:, None], padded[None, :], 0)[:, :num_experts]


@functools.lru_cache(maxsize=4096)  # host-only, per (problem, estimate): cheap on the per-batch path
def default_overrides_tuning(problem: Sm90Problem, rows_per_expert: float | None) -> bool:
    """Whether default_config's choice for this estimate is a WEIGHTS_AS_M kernel, which `moe2cta tune` has no
    candidates for (its entries then hold a regular kernel that the WEIGHTS_AS_M one was measured to beat)."""
    return rows_per_expert is not None and default_config(problem, rows_per_expert=rows_per_expert).operands is (
        Operands.WEIGHTS_AS_M)


def default_padding_rows(problem: Sm90Problem, tile_m: int, consumers: Consumers = Consumers.COOPERATIVE,
                         raster: Raster | None = None) -> PaddingRows:
    """SKIP on 128-row COOPERATIVE tiles for GEMM2, and for GEMM1 in the EXPERT_GROUPED_M raster; MULTIPLY otherwise.
    Measured on the H200 (five presets, T = 2048 / 8192 / 32768):
    - GEMM2 with SKIP 0.972x the time of MULTIPLY (geomean of 15 cells, 13 faster; results/wgmma-fence-h200-2026-11-29/);
    - GEMM1 with SKIP in its default raster of before (ALONG_N / GROUPED_M): -5..+8% by model (deepseek-v3 T=8192
      +7.5%: the tails run ahead of the m-blocks that share their weight tiles, DRAM reads +16%); in
      EXPERT_GROUPED_M 0.953-1.003, geomean about 0.98 (results/expert-grouped-skip-h200-2026-12-01/)."""
    if tile_m != 128 or consumers is not Consumers.COOPERATIVE:
        return PaddingRows.MULTIPLY
    if problem.kind is GemmStage.GEMM2 or raster is Raster.EXPERT_GROUPED_M:
        return PaddingRows.SKIP
    return PaddingRows.MULTIPLY


def default_epilogue_store(consumers: Consumers = Consumers.COOPERATIVE,
                           operands: Operands = Operands.TOKENS_AS_M) -> EpilogueStore:
    """UNDER_NEXT_MAINLOOP wherever it exists (COOPERATIVE TOKENS_AS_M kernels), else AFTER_MAINLOOP. Measured on
    the H200 (results/epilogue-h200-2026-12-01/, 10 cells x 2 GEMMs, interleaved): never slower beyond the noise;
    GEMM2 -8..-15% where its K is short (qwen3 T >= 8192), GEMM1 -0.3..-3.5%. ACTIVATION_UNDER_NEXT_MAINLOOP is not
    a default: GEMM1 -0.6..-0.9% with gathered A and +1.0..+1.5% on the token rows (geomeans of three runs over 10
    cells), for twice the rounding error (results/activation-under-h200-2026-12-01/, docs/perf-notes-sm90.md v14)."""
    if consumers is Consumers.COOPERATIVE and operands is Operands.TOKENS_AS_M:
        return EpilogueStore.UNDER_NEXT_MAINLOOP
    return EpilogueStore.AFTER_MAINLOOP


def regular_schedule(work_unit: WorkUnit, rows_per_expert: float | None,
                     scheduler: Scheduler | None = None, n_blocks: int | None = None,
                     stage: GemmStage | None = None) -> tuple[Scheduler, Raster]:
    """(scheduler, raster) of the regular (TOKENS_AS_M) kernel of GEMM `stage` (None: GEMM2's rule) for about
    `rows_per_expert` rows per expert (None: unknown) on a GEMM of `n_blocks` n-blocks (None: unknown): DYNAMIC for
    SINGLE units, STATIC for PAIR units (PAIR DYNAMIC runs; with its wgmma no longer serialized it ties SINGLE
    DYNAMIC, results/wgmma-fence-h200-2026-11-29/). When DYNAMIC with SINGLE units, GEMM1 takes GEMM1_RASTER
    (EXPERT_GROUPED_M, with PaddingRows.SKIP: default_padding_rows) up to GEMM1_EXPERT_GROUPED_MAX_ROWS rows per
    expert; otherwise GROUPED_M above GROUPED_RASTER_MIN_ROWS rows per expert (or for an unknown estimate), except up
    to ALONG_N_MAX_ROWS rows on at most ALONG_N_MAX_N_BLOCKS n-blocks; else ALONG_N. An explicit `scheduler` is kept.

    The ALONG_N range, measured (results/padding-modes-h200-2026-12-01/): at 256-512 rows per expert on
    12-30 n-blocks ALONG_N ties GROUPED_M where A's padding rows hold activation-like values and is 1-8%
    faster where they hold zeros (GROUPED_M's weight sharing through L2 breaks down there), and GEMM2 gains
    2-6%; with 112 n-blocks (mixtral-8x7b GEMM1) or 1024+ rows per expert GROUPED_M is 3-24% faster."""
    if scheduler is None:
        scheduler = Scheduler.STATIC if work_unit is WorkUnit.PAIR else Scheduler.DYNAMIC
    if (stage is GemmStage.GEMM1 and scheduler is Scheduler.DYNAMIC and work_unit is WorkUnit.SINGLE
            and rows_per_expert is not None and rows_per_expert <= GEMM1_EXPERT_GROUPED_MAX_ROWS):
        return scheduler, GEMM1_RASTER
    few_n_blocks = n_blocks is not None and n_blocks <= ALONG_N_MAX_N_BLOCKS
    grouped = rows_per_expert is None or rows_per_expert > (ALONG_N_MAX_ROWS if few_n_blocks
                                                            else GROUPED_RASTER_MIN_ROWS)
    return scheduler, Raster.GROUPED_M if scheduler is Scheduler.DYNAMIC and grouped else Raster.ALONG_N


@_memoized
def default_config(
    problem: Sm90Problem,
    scheduler: Scheduler | None = None,
    work_unit: WorkUnit = WorkUnit.SINGLE,
    rows_per_expert: float | None = None,
) -> Sm90GemmConfig:
    """Analytic default (docs/perf-notes-sm90.md): with `rows_per_expert` (the caller's host-side estimate,
    e.g. T * k / E) where wide_default measured best, the wide swapped-operand kernel; else at most
    SWAPPED_MAX_ROWS_PER_EXPERT, the swapped-operand decode kernel (swapped_config); otherwise (regular_config)
    128-row tiles with the widest N tile that divides N, SINGLE work units, and (scheduler None) DYNAMIC
    scheduling in the raster of regular_schedule: GEMM1 EXPERT_GROUPED_M with PaddingRows.SKIP up to
    GEMM1_EXPERT_GROUPED_MAX_ROWS rows per expert; else GROUPED_M above GROUPED_RASTER_MIN_ROWS rows per expert (or
    when the estimate is unknown), ALONG_N at or below it. An explicit scheduler is kept (STATIC: ALONG_N raster).

    Measured on the H200 (v2-v3: qwen3-30b-a3b, T = 16..8192; v6: five models, T = 2048..32768, interleaved
    timing): 128x256 beats 128x128; ALONG_N beats ALONG_M by 15-25%; 64-row tiles lose even at decode sizes;
    PAIR units tie SINGLE units (v8, once ptxas no longer serialized their wgmma; they lost up to 25% before). Where an expert spans several m-blocks,
    GROUPED_M + DYNAMIC makes its m-blocks read each weight tile back to back (deepseek-v3 T=8192 GEMM1: 34
    -> 23 GB from DRAM, 8.96 -> 8.31 ms; mixtral T=32768: -17..-25%); with about one m-block per expert,
    ALONG_N + DYNAMIC is best (deepseek-v3 T=2048 GEMM1 4.29 -> 3.94 ms).
    """
    if rows_per_expert is not None and work_unit is WorkUnit.SINGLE:
        swapped = swapped_config(problem, rows_per_expert)  # (checks rows_per_expert)
        wide = wide_default(problem, rows_per_expert, scheduler)
        if wide is not None:
            return wide
        if swapped is not None and scheduler is not Scheduler.DYNAMIC_SIDES:  # (the regular kernel's scheduler only)
            return dataclasses.replace(swapped, scheduler=scheduler or Scheduler.STATIC)
    return regular_config(problem, scheduler, work_unit, rows_per_expert)


@_memoized
def regular_config(problem: Sm90Problem, scheduler: Scheduler | None = None, work_unit: WorkUnit = WorkUnit.SINGLE,
                   rows_per_expert: float | None = None) -> Sm90GemmConfig:
    """The regular (TOKENS_AS_M) kernel default_config falls back to: 128-row tiles, the widest N tile that
    divides N, the schedule of regular_schedule for its n-block count. Where no N tile divides N, the tile with the
    fewest missing columns in a partial last n-block (the wider on a tie). A partial n-block was measured slower
    where a divisor exists (gpt-oss-120b GEMM1 on 256-wide tiles: +0.7..+3.2% against 192-wide,
    results/activation-under-h200-2026-12-01/run4-n-tail/), so it is only the fallback."""
    divisors = [t for t in (256, 192, 128, 64) if problem.n % t == 0]
    partial = sorted((256, 192, 128), key=lambda t: (-problem.n % t, -t))
    for tile_n in divisors or partial:
        tile_scheduler, raster = regular_schedule(work_unit, rows_per_expert, scheduler, -(-problem.n // tile_n),
                                                  problem.kind)
        cfg = Sm90GemmConfig(tile_m=128, tile_n=tile_n, work_unit=work_unit, scheduler=tile_scheduler, raster=raster,
                             raster_group_m=GROUPED_RASTER_GROUP_M,
                             padding_rows=default_padding_rows(problem, 128, raster=raster),
                             epilogue_store=default_epilogue_store())
        ok, why = can_implement(cfg, problem)
        if ok:
            return cfg
    raise ValueError(f"problem: no sm90 configuration fits {problem} (the last candidate's limit: {why})")


# ---------------------------------------------------------------------------------------------- prepack
def prepack_w13(w13: torch.Tensor) -> torch.Tensor:
    """Public w13 [E, 2I, H] (gate rows, then up rows) -> W13Layout.CHUNKED [E, 2I, H] (once at load)."""
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        raise TypeError(f"w13: expected a 3-d tensor [E, 2I, H], got {getattr(w13, 'shape', type(w13))}")
    return pack_gate_up_rows(w13)


@dataclasses.dataclass(frozen=True)
class KernelBias:
    """A bias already in the CuTe kernels' epilogue layout: fp32, contiguous, GEMM1's interleaved like the packed
    w13 (kernel_bias makes it once, at load). The grouped GEMMs of both CuTe families take it in place of the
    public b13 / b2 and then convert nothing per call (the public form costs 1-2 copy launches per GEMM)."""

    stage: GemmStage
    values: torch.Tensor  # [E, N] fp32


def kernel_bias(stage: GemmStage, bias: torch.Tensor) -> KernelBias:
    """The public b13 [E, 2I] (stage GEMM1) or b2 [E, H] (GEMM2) in the kernels' epilogue layout."""
    stage = GemmStage(stage)
    name = "b13" if stage is GemmStage.GEMM1 else "b2"
    if not isinstance(bias, torch.Tensor) or bias.dim() != 2 or not bias.is_floating_point():
        raise TypeError(f"{name}: expected a 2-d floating-point tensor [E, N], got {getattr(bias, 'shape', type(bias))}")
    values = bias.float()
    if stage is GemmStage.GEMM1:
        values = pack_gate_up_rows(values.unsqueeze(-1)).squeeze(-1)
    return KernelBias(stage, values.contiguous())


def epilogue_operands(
    stage: GemmStage, num_experts: int, n: int, rows: int, bias: torch.Tensor | KernelBias | None,
    row_scale: torch.Tensor | None, device: torch.device | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The CuTe kernels' fp32 epilogue operands (sm90 and sm100) from the public ones; None stays None.

    bias: GEMM1's b13 [E, 2I] (returned interleaved like prepack_w13) or GEMM2's b2 [E, H]; n is 2I or H; or a
    KernelBias of this stage (returned as it is: fp32, contiguous).
    row_scale: GEMM2's router weight per row, [rows], floating point.
    device: where the kernel runs (each operand must be there), unless None.
    """
    name = "b13" if stage is GemmStage.GEMM1 else "b2"
    if isinstance(bias, KernelBias):
        if bias.stage is not stage:
            raise ValueError(f"{name}: a KernelBias made for {bias.stage.name}, this is {stage.name}")
        if bias.values.shape != (num_experts, n):
            raise TypeError(f"{name}: expected [{num_experts}, {n}], got {tuple(bias.values.shape)}")
        if bias.values.dtype != torch.float32 or not bias.values.is_contiguous():
            raise TypeError(f"{name}: a KernelBias holds contiguous fp32 values (kernel_bias makes them), got "
                            f"{bias.values.dtype}{'' if bias.values.is_contiguous() else ', not contiguous'}")
        bias = bias.values
    elif bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor [{num_experts}, {n}] or a KernelBias, got "
                            f"{getattr(bias, 'dtype', type(bias).__name__)}")
        if bias.shape != (num_experts, n):
            raise TypeError(f"{name}: expected [{num_experts}, {n}], got {tuple(bias.shape)}")
        bias = kernel_bias(stage, bias).values
    if row_scale is not None:
        if not isinstance(row_scale, torch.Tensor) or not row_scale.is_floating_point():
            raise TypeError(f"row_scale: expected a floating-point tensor [{rows}], got "
                            f"{getattr(row_scale, 'dtype', type(row_scale).__name__)}")
        if row_scale.shape != (rows,):
            raise TypeError(f"row_scale: expected [{rows}], got {tuple(row_scale.shape)}")
        row_scale = row_scale.float().contiguous()
    if device is not None:
        for label, t in ((name, bias), ("row_scale", row_scale)):
            if t is not None and t.device != device:
                raise ValueError(f"{label}: expected device {device}, got {t.device}")
    return bias, row_scale


# ---------------------------------------------------------------------------------------------- compile
@_memoized
def kernel_key(config: Sm90GemmConfig, problem: Sm90Problem) -> KernelKey:
    return KernelKey(
        family=FAMILY,
        arch=Arch.SM90.value,
        dtype=_dtype_name(problem.dtype),
        n=problem.n,
        k=problem.k,
        num_experts=problem.num_experts,
        tile=(config.tile_m, config.tile_n, config.tile_k),
        cluster=(config.cluster_m, 1, 1),
        epilogue=problem.epilogue,
        extra=(("abi", ENTRY_ABI), ("stages", resolve_stages(config)), ("sched", config.scheduler.value),
               ("raster", config.raster.value))
        + ((("group", config.raster_group_m),) if config.raster in GROUPED_RASTERS else ())
        + ((("consumers", config.consumers.value),) if config.consumers is not Consumers.COOPERATIVE else ())
        + ((("operands", config.operands.value),) if config.operands is not Operands.TOKENS_AS_M else ())
        + ((("padding", config.padding_rows.value),) if config.padding_rows is not PaddingRows.MULTIPLY else ())
        + ((("token_step", config.token_step or config.tile_m),) if config.wide else ())
        + ((("split", config.expert_split.value),) if config.expert_split is not ExpertSplit.FILL else ())
        + ((("a_source", config.a_source.value),) if config.a_source is not ASource.EXPERT_ORDER_COPY else ())
        + ((("store", config.epilogue_store.value),) if config.epilogue_store is not EpilogueStore.AFTER_MAINLOOP
           else ())
        + ((("launch", config.dependent_launch.value),) if config.dependent_launch is not DependentLaunch.STREAM_ORDER
           else ()),
    )


def compile_kernel(config: Sm90GemmConfig, problem: Sm90Problem, keep_ptx: bool = False):
    """JIT-compile (CuTe DSL, symbolic M, tvm-ffi ABI) for sm_90a; needs the DSL, not a GPU."""
    ok, why = can_implement(config, problem)
    if not ok:
        raise ValueError(f"config: cannot implement {problem}: {why}")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    dt = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[problem.dtype]
    e, n, k = problem.num_experts, problem.n, problem.k
    m = cute.sym_int()
    a = make_fake_compact_tensor(dt, (m, k), stride_order=(1, 0), assumed_align=16)
    b = make_fake_compact_tensor(dt, (e, n, k), stride_order=(2, 1, 0), assumed_align=16)
    c = make_fake_compact_tensor(dt, (m, problem.out_n), stride_order=(1, 0), assumed_align=16)
    row_offsets = make_fake_compact_tensor(cutlass.Int32, (e + 1,))
    counts = make_fake_compact_tensor(cutlass.Int32, (e,))
    bias = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0))
    row_scale = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),))
    workspace = make_fake_compact_tensor(cutlass.Int32, (l2_sides.workspace_words(config.scheduler),))
    common = dict(
        tile_m=config.tile_m,
        tile_n=config.tile_n,
        tile_k=config.tile_k,
        stages=resolve_stages(config),
        epilogue=problem.activation.value if problem.kind is GemmStage.GEMM1 else "plain",
        has_bias=problem.has_bias,
        has_row_scale=problem.has_row_scale,
        num_experts=e,
        scheduler=config.scheduler.value,
        raster=config.raster.value,
        dependent_launch=config.dependent_launch.value,
    )
    if config.operands is Operands.WEIGHTS_AS_M:
        from .cute_swapped_backend import Sm90SwappedGroupedGemmKernel

        kernel = Sm90SwappedGroupedGemmKernel(**common, token_step=config.token_step,
                                              expert_split=config.expert_split.value, a_source=config.a_source.value)
    elif config.padding_rows in FUSED_TAIL_PARTS:
        from .cute_fused_tail_backend import Sm90FusedTailGroupedGemmKernel

        kernel = Sm90FusedTailGroupedGemmKernel(**common, cluster_m=1, raster_group_m=config.raster_group_m,
                                                tail_parts=FUSED_TAIL_PARTS[config.padding_rows])
    else:
        from .cute_backend import Sm90GroupedGemmKernel

        kernel = Sm90GroupedGemmKernel(**common, cluster_m=config.cluster_m, consumers=config.consumers.value,
                                       raster_group_m=config.raster_group_m, padding_rows=config.padding_rows.value,
                                       a_source=config.a_source.value, epilogue_store=config.epilogue_store.value)
    options = f"--enable-tvm-ffi --gpu-arch {Arch.SM90.value}"
    dump_dir = None
    if keep_ptx:  # the compiler also writes the PTX to a file: keep that out of the working directory
        import shutil
        import tempfile

        dump_dir = tempfile.mkdtemp(prefix="moe2cta-ptx-")
        options += f" --keep-ptx --dump-dir {dump_dir}"
    tail = (row_offsets, counts, bias, row_scale, workspace, cutlass.Int32(0))  # pair_threshold: a runtime value
    num_ctas = (cutlass.Int32(ARCH_LIMITS[Arch.SM90].num_sms),)  # the grid: a runtime value, the device's SMs
    try:
        if config.a_source is not ASource.EXPERT_ORDER_COPY:
            # A is the token matrix [T, K] (T symbolic too) with a_rows [M], and rows_per_token after pair_threshold
            tokens = make_fake_compact_tensor(dt, (cute.sym_int(), k), stride_order=(1, 0), assumed_align=16)
            a_rows = make_fake_compact_tensor(cutlass.Int32, (m,))
            args = (tokens, a_rows, b, c) + tail + (cutlass.Int32(1),) + num_ctas
            return _compile(cute, kernel.call_token_rows, options, args)
        return _compile(cute, kernel, options, (a, b, c) + tail + num_ctas)
    finally:
        if dump_dir is not None:
            shutil.rmtree(dump_dir, ignore_errors=True)


def _compile(cute, entry, options, args):
    """cute.compile of one kernel entry point on fake arguments, with the tvm-ffi environment stream."""
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(entry, *args, make_fake_stream(use_tvm_ffi_env_stream=True), options=options)


# ---------------------------------------------------------------------------------------------- host API
_CACHES: dict = {}  # bundle directory (None: kernel_dir() at call time) -> KernelCache


def _cache_for(directory) -> KernelCache:
    key = None if directory is None else str(directory)
    if key not in _CACHES:
        _CACHES[key] = KernelCache(directory, prefer="bundle")
    return _CACHES[key]


_UNUSED: dict = {}  # device -> (workspace of STATIC launches, dummy bias, dummy row scale): never read or written


def prepare_device(device: torch.device) -> None:
    """Make the tensors every launch on `device` may pass and no kernel reads (STATIC workspace, dummy bias, dummy row
    scale, DYNAMIC_SIDES's side map), once per device. MoELayer calls this when it is built. A first launch inside a
    graph capture would otherwise make them in the capture's memory pool and keep them there, and torch.compile's CUDA
    graph trees (which warm up inside their pool) refuse a pool holding tensors that are not outputs."""
    key = l2_sides.device_key(device)
    device = torch.device(*key)
    if key not in _UNUSED:
        _UNUSED[key] = (torch.empty(4, dtype=torch.int32, device=device),
                        torch.empty(1, 1, dtype=torch.float32, device=device),
                        torch.empty(1, dtype=torch.float32, device=device))
    l2_sides.side_map(device)


_SM_COUNTS: dict = {}  # device -> its SM count


def persistent_ctas(device: torch.device, cluster_m: int) -> int:
    """The persistent grid of one launch: one CTA per SM of `device` (the kernels take up a whole SM), in whole
    clusters. A runtime argument of every sm90 kernel, so that one bundle serves every Hopper part (132 SMs on the
    H100 SXM / H200, 114 on the H100 PCIe, 78 on the H20) with neither a second wave nor idle SMs."""
    key = (device.type, device.index) if isinstance(device, torch.device) else None
    if key not in _SM_COUNTS:  # (checked once per device: the launch path only looks it up)
        try:
            if not isinstance(device, (torch.device, str)):  # (an int means "the current accelerator" to torch)
                raise TypeError(device)
            key = l2_sides.device_key(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"device: expected a CUDA device, got {device!r}") from error
        if key[0] != "cuda":
            raise ValueError(f"device: expected a CUDA device, got {device!r}")
        if key not in _SM_COUNTS:
            _SM_COUNTS[key] = torch.cuda.get_device_properties(torch.device(*key)).multi_processor_count
    if isinstance(cluster_m, bool) or not isinstance(cluster_m, int) or cluster_m not in (1, 2):
        raise ValueError(f"cluster_m: expected 1 or 2 (the sm90 clusters), got {cluster_m!r}")
    return max(cluster_m, _SM_COUNTS[key] // cluster_m * cluster_m)


def _launch_scratch(config, device: torch.device):
    """(workspace, dummy bias, dummy row scale) for one launch.

    A DYNAMIC launch gets its own workspace (unit counter, done count), zeroed here: inside a CUDA graph the zeroing
    is the graph's own memset node, so no state outlives a replay, and graphs may share a memory pool with any other
    graphs and replay in any order (a per-stream counter made once inside a capture lay in pool memory that another
    graph of the same pool reused as scratch: that graph's replays overwrote it and the GEMM skipped its tiles;
    tests/test_graph_pools.py). STATIC launches never touch the workspace, and the dummies are never read (their
    epilogue flags are off): those are made once per device (prepare_device).
    """
    key = (device.type, device.index)
    if key not in _UNUSED:  # (one dict lookup per launch on the hot path)
        prepare_device(device)
        key = l2_sides.device_key(device)
    unused_workspace, dummy_bias, dummy_scale = _UNUSED[key]
    if config.scheduler is Scheduler.DYNAMIC:
        return torch.zeros(4, dtype=torch.int32, device=device), dummy_bias, dummy_scale
    if config.scheduler is Scheduler.DYNAMIC_SIDES:
        return l2_sides.launch_workspace(device), dummy_bias, dummy_scale
    return unused_workspace, dummy_bias, dummy_scale


def _check_common(a, w, row_offsets, counts, name_w):
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        raise TypeError(f"a: expected a 2-d tensor [max_rows, K], got {getattr(a, 'shape', type(a))}")
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"a: expected bfloat16 or float16, got {a.dtype}")
    if not a.is_cuda:
        raise ValueError("a: the sm90 kernels need CUDA tensors")
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype != a.dtype or w.shape[2] != a.shape[1]:
        raise TypeError(f"{name_w}: expected [E, N, {a.shape[1]}] of {a.dtype}, got {getattr(w, 'shape', None)} {getattr(w, 'dtype', None)}")
    if min(w.shape) < 1:
        raise ValueError(f"{name_w}: expected [E, N, K] with every size >= 1, got {tuple(w.shape)}")
    num_experts = w.shape[0]
    for name, t, shape in (("row_offsets", row_offsets, (num_experts + 1,)), ("counts", counts, (num_experts,))):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.shape != shape:
            raise TypeError(f"{name}: expected int32 {list(shape)}, got {getattr(t, 'dtype', type(t).__name__)} "
                            f"{tuple(getattr(t, 'shape', ()))}")
    for name, t in ((name_w, w), ("row_offsets", row_offsets), ("counts", counts)):
        if t.device != a.device:
            raise ValueError(f"{name}: expected device {a.device} (a's), got {t.device}")
    if not (a.is_contiguous() and w.is_contiguous()):
        raise ValueError("a, w: expected contiguous (K-major) tensors")


def check_out(out, rows: int, n_out: int, a: torch.Tensor, **reads) -> None:
    """A caller's `out` for a GEMM of `rows` x `n_out` on `a` (sm90 and sm100): shape, dtype, device, layout, and no
    memory shared with `a` or any other operand the kernel reads (`reads`: name -> tensor or None). Every block of A
    is read by several CTAs while others store C: an overlap would feed them outputs. Spans are compared (first to
    last element), so `out` and an operand interleaved in one buffer without sharing an element are refused too. The
    wrappers check only a caller's `out`, not the one they allocate."""
    if not isinstance(out, torch.Tensor) or out.shape != (rows, n_out) or out.dtype != a.dtype \
            or out.device != a.device or not out.is_contiguous() or out.data_ptr() % 16:
        raise TypeError(f"out: expected a contiguous 16-byte aligned [{rows}, {n_out}] {a.dtype} tensor on {a.device}, "
                        f"got {tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)} on "
                        f"{getattr(out, 'device', None)}")
    require_own_memory(out, a=a, **{name: t.values if isinstance(t, KernelBias) else t for name, t in reads.items()})


_KERNELS_BY_LAUNCH: dict = {}  # (config, problem, directory) -> the kernel: one lookup per launch on the hot path


def _kernel_for(config, problem, directory):
    """The compiled or loaded kernel of (config, problem), after can_implement; memoized per (config, problem,
    directory), so that a forward pays one dict lookup instead of the checks, the key and the cache's lock."""
    launch = (config, problem, None if directory is None else str(directory))
    kernel = _KERNELS_BY_LAUNCH.get(launch)
    if kernel is None:
        ok, why = can_implement(config, problem)
        if not ok:
            raise ValueError(f"config: {why}")
        key = kernel_key(config, problem)
        kernel = _cache_for(directory).get(key, lambda: compile_kernel(config, problem),
                                           request=lambda: kernel_request(config, problem))
        _KERNELS_BY_LAUNCH[launch] = kernel
    return kernel


def _run(config, problem, a, w, out, row_offsets, counts, bias, row_scale, directory=None, a_rows=None,
         rows_per_token=1, align=128):
    if not isinstance(config, Sm90GemmConfig):  # (the memo below hashes it)
        raise TypeError(f"config: expected an Sm90GemmConfig, got {type(config).__name__}")
    kernel = _KERNELS_BY_LAUNCH.get((config, problem, None if directory is None else str(directory)))
    if kernel is None:  # a first launch: the config's check before the arguments' checks, which read its fields
        ok, why = can_implement(config, problem)
        if not ok:
            raise ValueError(f"config: {why}")
    if align != 128 and (isinstance(align, bool) or not isinstance(align, int) or align < 1
                         or align % row_alignment(config)):
        raise ValueError(f"align: expected the dispatch's align, a multiple of the {row_alignment(config)} rows this "
                         f"kernel's expert segments start on (row_alignment), got {align!r}")
    if (a_rows is not None) != (config.a_source is not ASource.EXPERT_ORDER_COPY):
        raise ValueError(f"a_rows: a_source {config.a_source.name} "
                         + ("takes a_rows (the dispatch's sorted_slots)" if a_rows is None else "takes no a_rows"))
    if config.operands is Operands.WEIGHTS_AS_M and out.shape[0] * out.shape[1] > DIRECT_STORE_MAX_ELEMENTS:
        raise ValueError(f"config: a WEIGHTS_AS_M kernel stores C with 32-bit element offsets; C {tuple(out.shape)} "
                         f"has more than 2**31 - 1 elements: take a TOKENS_AS_M config (regular_config)")
    if out.shape[0] == 0:  # no rows: nothing to launch
        return out
    if kernel is None:
        kernel = _kernel_for(config, problem, directory)
    workspace, dummy_bias, dummy_scale = _launch_scratch(config, a.device)
    operands = (a, w) if a_rows is None else (a, a_rows, w)
    tail = (int(config.pair_threshold),) if a_rows is None else (int(config.pair_threshold), int(rows_per_token))
    tail += (persistent_ctas(a.device, config.cluster_m),)
    kernel(
        *operands,
        out,
        row_offsets,
        counts,
        bias if bias is not None else dummy_bias,
        row_scale if row_scale is not None else dummy_scale,
        workspace,
        *tail,
    )
    return out


# Where a layer's GEMM1 reads the token rows itself by default (Gemm1Input.AUTO), measured on the H200
# (docs/perf-notes-sm90.md v12, results/token-rows-h200-2026-12-01): the cp.async A path costs the regular kernel
# up to 17% at high MMA rates, and it saves the gather launch, whose share of the layer grows as GEMM1 narrows
# (the gather moves T * k * H, GEMM1 2 * T * k * H * 2I). Layer, token rows against gathered copy, T = 2048 / 8192 /
# 32768: qwen3-30b-a3b (I 768) -6% / -5% / -12%; qwen3-235b-a22b (I 1536) +1% / +11% / +1%, deepseek-v3 (2048)
# -2% / +2% / +3%, gpt-oss-120b (2880) -1% / +11% / +9%, mixtral-8x7b (14336) +5% / +5% / +6%. Of the wide tiles,
# the 160-row one pays (qwen3-30b T=2048: 0.973, results/wide-token-rows-h200-2026-12-03); the 288-row one does not
# (qwen3-30b T=3072 / 4096: the layer 1.25x the gathered copy's time, results/stop40-h200-2026-12-03).
TOKEN_ROWS_MAX_INTERMEDIATE = 1024


def token_rows_pays(problem: Sm90Problem, rows_per_expert: float | None = None) -> bool:
    """Whether the token rows (ASource.TOKEN_ROWS) measured faster than gather + GEMM1: I <= TOKEN_ROWS_MAX_INTERMEDIATE,
    where GEMM1's default for `rows_per_expert` (None: the regular kernel's) is the regular kernel or the 160-row wide
    tile; the other wide tiles were measured slower on the token rows or not at all."""
    if not isinstance(problem, Sm90Problem):
        raise TypeError(f"problem: expected an Sm90Problem, got {problem!r}")
    if problem.kind is not GemmStage.GEMM1 or problem.out_n > TOKEN_ROWS_MAX_INTERMEDIATE:
        return False
    if rows_per_expert is None:
        return True
    default = default_config(problem, rows_per_expert=rows_per_expert)  # (memoized)
    return not default.wide or default.tile_m == WIDE160_TILE_M


@_memoized
def token_rows_config(problem: Sm90Problem, rows_per_expert: float | None = None) -> Sm90GemmConfig | None:
    """The regular kernel of regular_config reading A from the token rows (ASource.TOKEN_ROWS), or None where
    it cannot (GEMM2, a tile_k that does not divide k)."""
    cfg = dataclasses.replace(regular_config(problem, rows_per_expert=rows_per_expert), a_source=ASource.TOKEN_ROWS)
    return cfg if can_implement(cfg, problem)[0] else None


# The WEIGHTS_AS_M kernels store C by plain st.global with 32-bit element offsets (row * N + column; the regular
# kernel stores by TMA). Their defaults take at most WIDE288_LONG_K_MAX_ROWS rows per expert: at most about 1.3e9
# elements for every preset, but 256 experts with an output width above ~12K would pass 2**31.
DIRECT_STORE_MAX_ELEMENTS = 2**31 - 1


def direct_store_fits(config: Sm90GemmConfig, problem: Sm90Problem, rows: int) -> bool:
    """Whether a launch of `config` with an output of `rows` rows keeps its stores' 32-bit element offsets in range
    (only the WEIGHTS_AS_M kernels store by offset; the regular kernel stores by TMA)."""
    return config.operands is not Operands.WEIGHTS_AS_M or rows * problem.out_n <= DIRECT_STORE_MAX_ELEMENTS


def config_for_rows(problem: Sm90Problem, rows_per_expert: float | None, rows: int) -> Sm90GemmConfig:
    """default_config for a launch whose output has `rows` rows: its choice, unless that is a WEIGHTS_AS_M kernel
    whose 32-bit store offsets `rows` x N would overflow; then the regular kernel."""
    if not isinstance(problem, Sm90Problem):
        raise TypeError(f"problem: expected an Sm90Problem, got {problem!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows: expected an int >= 0 (the output's rows), got {rows!r}")
    config = default_config(problem, rows_per_expert=rows_per_expert)
    if not direct_store_fits(config, problem, rows):
        return regular_config(problem, rows_per_expert=rows_per_expert)
    return config


def _check_a_rows(a_rows, rows_per_token):
    if not isinstance(a_rows, torch.Tensor) or a_rows.dim() != 1 or a_rows.dtype != torch.int32:
        raise TypeError(f"a_rows: expected a 1-d int32 tensor [max_rows] (the dispatch's sorted_slots), got "
                        f"{getattr(a_rows, 'dtype', type(a_rows))} {tuple(getattr(a_rows, 'shape', ()))}")
    if isinstance(rows_per_token, bool) or not isinstance(rows_per_token, int) or rows_per_token < 1:
        raise ValueError(f"rows_per_token: expected an int >= 1 (top-k), got {rows_per_token!r}")
    if not a_rows.is_contiguous() or not a_rows.is_cuda:
        raise ValueError("a_rows: expected a contiguous CUDA tensor")


def sm90_grouped_gemm1(
    a: torch.Tensor,
    packed_w13: torch.Tensor,
    row_offsets: torch.Tensor,
    counts: torch.Tensor,
    activation: Activation = Activation.SWIGLU,
    b13: torch.Tensor | KernelBias | None = None,
    out: torch.Tensor | None = None,
    config: Sm90GemmConfig | None = None,
    kernel_directory=None,
    rows_per_expert: float | None = None,
    a_rows: torch.Tensor | None = None,
    rows_per_token: int = 1,
    align: int = 128,
) -> torch.Tensor:
    """act(a @ w13[e].T + b13[e]) per expert -> [max_rows, I]; packed_w13 from prepack_w13; b13 public [E, 2I]
    or its kernel_bias (made once: no per-call conversion).

    a: the gathered rows [max_rows, H] in padded expert order; or, with a_rows, the token rows [T, H] themselves
    (ASource.TOKEN_ROWS): row r of the expert order is a[a_rows[r] // rows_per_token], a_rows being the dispatch's
    sorted_slots (-1 = padding: reads a[r % T]; every other entry must be below T * rows_per_token) and
    rows_per_token its top-k; the output then has a_rows.shape[0] rows.

    config None: config_for_rows (default_config(problem, rows_per_expert=rows_per_expert), whose host-side
    estimate such as T * k / E picks the decode kernel, None the regular one; the regular kernel where a decode
    kernel's 32-bit store offsets would overflow); with a_rows token_rows_config.

    The dispatch metadata lives on the device and is not read here; as router.dispatch makes it: row_offsets [E + 1]
    multiples of `align` (the dispatch's align, which must be a multiple of the kernel's row_alignment(config): 128
    serves every kernel), counts[e] <= row_offsets[e + 1] - row_offsets[e], row_offsets[E] <= the output's rows."""
    _check_common(a, packed_w13, row_offsets, counts, "packed_w13")
    activation = Activation.parse(activation)
    num_experts, two_i, hidden = packed_w13.shape
    problem = Sm90Problem(GemmStage.GEMM1, two_i, hidden, num_experts, a.dtype, activation, b13 is not None)
    rows = a.shape[0]
    if a_rows is not None:
        _check_a_rows(a_rows, rows_per_token)
        rows = a_rows.shape[0]
        rows_per_expert = _checked_rows_per_expert(rows_per_expert)
        config = config or token_rows_config(problem, rows_per_expert)
        if config is None:
            raise ValueError(f"a_rows: no TOKEN_ROWS configuration fits {problem}")
    config = config or config_for_rows(problem, rows_per_expert, rows)
    bias, _ = epilogue_operands(GemmStage.GEMM1, num_experts, two_i, rows, b13, None, a.device)
    if out is None:
        out = torch.empty(rows, two_i // 2, dtype=a.dtype, device=a.device)
    else:  # (against what the kernel reads: b13 in its epilogue layout)
        check_out(out, rows, two_i // 2, a, packed_w13=packed_w13, row_offsets=row_offsets, counts=counts, b13=bias,
                  a_rows=a_rows)
    if a_rows is not None and a.shape[0] == 0:  # no tokens: every row is padding (never read)
        return out
    return _run(config, problem, a, packed_w13, out, row_offsets, counts, bias, None, kernel_directory, a_rows,
                rows_per_token, align)


def sm90_grouped_gemm2(
    a: torch.Tensor,
    w2: torch.Tensor,
    row_offsets: torch.Tensor,
    counts: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    b2: torch.Tensor | KernelBias | None = None,
    out: torch.Tensor | None = None,
    config: Sm90GemmConfig | None = None,
    kernel_directory=None,
    rows_per_expert: float | None = None,
    align: int = 128,
) -> torch.Tensor:
    """(a @ w2[e].T + b2[e]) * row_scale per expert -> [max_rows, H] (b2 public or its kernel_bias); config None,
    the dispatch metadata and `align` as in sm90_grouped_gemm1."""
    _check_common(a, w2, row_offsets, counts, "w2")
    num_experts, hidden, inter = w2.shape
    problem = Sm90Problem(GemmStage.GEMM2, hidden, inter, num_experts, a.dtype, None, b2 is not None, row_scale is not None)
    config = config or config_for_rows(problem, rows_per_expert, a.shape[0])
    bias, row_scale = epilogue_operands(GemmStage.GEMM2, num_experts, hidden, a.shape[0], b2, row_scale, a.device)
    if out is None:
        out = torch.empty(a.shape[0], hidden, dtype=a.dtype, device=a.device)
    else:
        check_out(out, a.shape[0], hidden, a, w2=w2, row_offsets=row_offsets, counts=counts, row_scale=row_scale, b2=bias)
    return _run(config, problem, a, w2, out, row_offsets, counts, bias, row_scale, kernel_directory, align=align)


# ---------------------------------------------------------------------------------------------- presets
def preset_configs(preset) -> list[tuple[Sm90GemmConfig, Sm90Problem]]:
    """The kernels a model preset needs: GEMM1 and GEMM2, each as default_config picks it for every
    rows-per-expert range (swapped decode kernels at SWAPPED_PRESET_ROWS, ALONG_N, EXPERT_GROUPED_M and GROUPED_M
    regular kernels, and the choice for an unknown estimate), plus STATIC and PAIR alternatives (tuning, pinning), and
    GEMM1's regular SINGLE kernels reading the token rows (ASource.TOKEN_ROWS)."""
    dtype = torch.bfloat16
    gemm1 = Sm90Problem(GemmStage.GEMM1, 2 * preset.intermediate, preset.hidden, preset.num_experts, dtype,
                        preset.activation, preset.has_bias)
    gemm2 = Sm90Problem(GemmStage.GEMM2, preset.hidden, preset.intermediate, preset.num_experts, dtype,
                        None, preset.has_bias, True)
    out = []
    for problem in (gemm1, gemm2):
        configs = [default_config(problem, rows_per_expert=rows)
                   for rows in (*SWAPPED_PRESET_ROWS, *WIDE_ROWS_PER_EXPERT, *WIDE160_ROWS_PER_EXPERT,
                                *WIDE288_ROWS_PER_EXPERT, WIDE288_LONG_K_MAX_ROWS, GROUPED_RASTER_MIN_ROWS, None)]
        configs += [cfg for cfg in (wide_default(problem, 24),) if cfg is not None]  # GEMM2 at 16-32 rows
        # every decode tile, also where a wide kernel is the default (pinning, tuning)
        configs += [cfg for cfg in (swapped_config(problem, rows) for rows in SWAPPED_PRESET_ROWS) if cfg is not None]
        configs += [default_config(problem, Scheduler.STATIC), default_config(problem, work_unit=WorkUnit.PAIR)]
        configs += [cfg for cfg in (wide_config(problem),) if cfg is not None]  # whatever the policy says
        configs.append(regular_config(problem, rows_per_expert=GROUPED_RASTER_MIN_ROWS))  # ALONG_N regular
        configs += [c.config for c in expert_classes(problem, WIDE288_ROWS_PER_EXPERT[1])]  # (E > WIDE288_MAX_EXPERTS)
        # GEMM1: every regular (and 160-row wide) kernel also on the token rows (what Gemm1Input.AUTO runs)
        configs += [twin for twin in (token_rows_twin(cfg, problem) for cfg in configs) if twin is not None]
        for cfg in configs:
            if (cfg, problem) not in out:
                out.append((cfg, problem))
    return out


@_memoized
def token_rows_twin(config: Sm90GemmConfig, problem: Sm90Problem) -> Sm90GemmConfig | None:
    """`config` reading the token rows itself (ASource.TOKEN_ROWS), or None where it cannot (decode tiles, GEMM2)."""
    if not isinstance(config, Sm90GemmConfig) or not isinstance(problem, Sm90Problem):
        raise TypeError(f"config, problem: expected an Sm90GemmConfig and an Sm90Problem, got {config!r}, {problem!r}")
    if config.operands is not Operands.TOKENS_AS_M and not config.wide:
        return None
    twin = dataclasses.replace(config, a_source=ASource.TOKEN_ROWS)
    return twin if can_implement(twin, problem)[0] else None


def compile_for_preset(preset, out_dir, keep_ptx: bool = False, extra_configs=()) -> list:
    """Compile and export every kernel of `preset` (plus `extra_configs` [(config, problem)]) into out_dir."""
    pairs = dict.fromkeys(list(preset_configs(preset)) + list(extra_configs))  # each kernel once
    return [_export(config, problem, out_dir, keep_ptx) for config, problem in pairs]


def kernel_request(config: Sm90GemmConfig, problem: Sm90Problem) -> dict:
    """What compile_requests needs to build this kernel elsewhere (cute_runtime's requests file)."""
    from .cute_runtime import make_request

    return make_request(FAMILY, config, problem)


def kernel_from_key(key: KernelKey) -> tuple[Sm90GemmConfig, Sm90Problem]:
    """The (config, problem) whose kernel_key is `key`, pair_threshold (a runtime value) at its default: a bundle's
    manifest says enough about each kernel to build it again (`python -m moe2cta.aot requests --from-bundle`).
    ValueError where `key` is no key this family makes."""
    if key.family != FAMILY:
        raise ValueError(f"key: expected a {FAMILY} key, got family {key.family!r}")
    extra = {item[0]: item[1] for item in key.extra if isinstance(item, tuple) and len(item) == 2}
    stage, activation, has_row_scale, has_bias = parse_epilogue_name(key.epilogue)
    dtype = {_dtype_name(d): d for d in (torch.bfloat16, torch.float16)}.get(key.dtype)
    if (dtype is None or len(key.tile) != 3 or len(key.cluster) != 3 or key.cluster[0] not in (1, 2)
            or "stages" not in extra):
        raise ValueError(f"key: {key.file_stem()} is no {FAMILY} key")
    try:
        config = Sm90GemmConfig(
            tile_m=key.tile[0], tile_n=key.tile[1], tile_k=key.tile[2], stages=extra["stages"],
            work_unit=WorkUnit.PAIR if key.cluster[0] == 2 else WorkUnit.SINGLE,
            scheduler=Scheduler(extra.get("sched", Scheduler.STATIC.value)),
            raster=Raster(extra.get("raster", Raster.ALONG_N.value)),
            raster_group_m=extra.get("group", GROUPED_RASTER_GROUP_M),
            consumers=Consumers(extra.get("consumers", Consumers.COOPERATIVE.value)),
            operands=Operands(extra.get("operands", Operands.TOKENS_AS_M.value)),
            padding_rows=PaddingRows(extra.get("padding", PaddingRows.MULTIPLY.value)),
            token_step=extra.get("token_step", 0),
            expert_split=ExpertSplit(extra.get("split", ExpertSplit.FILL.value)),
            a_source=ASource(extra.get("a_source", ASource.EXPERT_ORDER_COPY.value)),
            epilogue_store=EpilogueStore(extra.get("store", EpilogueStore.AFTER_MAINLOOP.value)),
            dependent_launch=DependentLaunch(extra.get("launch", DependentLaunch.STREAM_ORDER.value)),
        )
        problem = Sm90Problem(stage, key.n, key.k, key.num_experts, dtype, activation, has_bias, has_row_scale)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"key: {key.file_stem()}: {exc}") from None
    ok, reason = can_implement(config, problem)
    if not ok:
        raise ValueError(f"key: {key.file_stem()}: {reason}")
    if kernel_key(config, problem) != key:
        raise ValueError(f"key: {key.file_stem()} names no kernel this family builds (read back as "
                         f"{kernel_key(config, problem).file_stem()})")
    return config, problem


def compile_requests(requests, out_dir, keep_ptx: bool = False) -> list:
    """Compile and export the kernels of `requests` (kernel_request dicts, e.g. cute_runtime.read_requests(path)'s
    "request" entries) into out_dir; a request of another family or that no longer describes a kernel it can
    implement is a ValueError that says which."""
    from .cute_runtime import requested_kernels

    pairs = requested_kernels(requests, FAMILY, Sm90GemmConfig, Sm90Problem, can_implement)
    return [_export(config, problem, out_dir, keep_ptx) for config, problem in pairs]


def _export(config: Sm90GemmConfig, problem: Sm90Problem, out_dir, keep_ptx: bool):
    from .cute_runtime import export_kernel

    return export_kernel(
        compile_kernel(config, problem, keep_ptx=keep_ptx),
        kernel_key(config, problem),
        out_dir,
        keep_ptx,
        smem_bytes=smem_bytes(config, resolve_stages(config)),
        info={"config": _config_json(config), "problem": _problem_json(problem)},
    )


def _config_json(config: Sm90GemmConfig) -> dict:
    return {
        "tile": [config.tile_m, config.tile_n, config.tile_k],
        "stages": resolve_stages(config),
        "work_unit": config.work_unit.value,
        "scheduler": config.scheduler.value,
        "raster": config.raster.value,
        "pair_threshold": config.pair_threshold,
        "raster_group_m": config.raster_group_m,
        "consumers": config.consumers.value,
        "operands": config.operands.value,
        "padding_rows": config.padding_rows.value,
        "token_step": config.token_step,
        "expert_split": config.expert_split.value,
        "a_source": config.a_source.value,
        "epilogue_store": config.epilogue_store.value,
        "dependent_launch": config.dependent_launch.value,
    }


def _problem_json(problem: Sm90Problem) -> dict:
    return {
        "kind": problem.kind.value,
        "n": problem.n,
        "k": problem.k,
        "num_experts": problem.num_experts,
        "dtype": _dtype_name(problem.dtype),
        "epilogue": problem.epilogue,
    }
