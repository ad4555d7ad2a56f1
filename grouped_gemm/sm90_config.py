"""Hopper (sm_90a) grouped GEMM family, its configuration layer: the enums and frozen dataclasses that name one
kernel (Sm90GemmConfig) and one problem (Sm90Problem), the measured limits and thresholds the policies read, the SMEM
model (stages, reserved bytes) and `can_implement`. Pure Python: no GPU, no DSL.

sm90_grouped_gemm.py (the policies that pick a configuration, the kernel key, compile and the host API) re-exports every
public name here, so callers keep one module to import.
"""
from __future__ import annotations

import dataclasses
import enum
import functools

import torch

from .budget import ARCH_LIMITS, Arch, WorkUnit, input_bytes_per_stage, max_stages
from .epilogue import GATE_UP_CHUNK, Activation, GemmStage, epilogue_name

__all__ = [
    "FAMILY", "EPILOGUE_SMEM_STAGES", "EPILOGUE_TILE_N", "N_TAIL_ALIGN", "BARRIER_RESERVE_BYTES",
    "METADATA_RESERVE_BYTES", "Scheduler", "Raster", "GROUPED_RASTERS", "Consumers", "PaddingRows", "EpilogueStore",
    "ASource", "ExpertSplit", "DependentLaunch", "Operands", "SWAPPED_TILE_M", "WIDE_TILE_M", "WGMMA_MAX_N",
    "WIDE_TILE_N", "WIDE_ROW_ALIGN", "WIDE_MAX_ACC_ELEMS", "WIDE_EPI_PAD", "SWAPPED_MAX_ROWS_PER_EXPERT",
    "SWAPPED_TILE_M_LIMITS", "SWAPPED_TILE_N", "SWAPPED_TILE_K", "SWAPPED_PRESET_ROWS", "GROUPED_RASTER_MIN_ROWS",
    "GROUPED_RASTER_GROUP_M", "GEMM1_RASTER", "GEMM1_EXPERT_GROUPED_MAX_ROWS", "ALONG_N_MAX_ROWS",
    "ALONG_N_MAX_N_BLOCKS", "WIDE_TILE_K", "WIDE_TOKEN_STEP", "WIDE_MAX_EXPERTS", "WIDE_ROWS_PER_EXPERT",
    "WIDE_GEMM2_ROWS_PER_EXPERT", "WIDE160_ROWS_PER_EXPERT", "WIDE160_TILE_M", "WIDE288_ROWS_PER_EXPERT",
    "WIDE288_TILE_M", "WIDE288_TILE_N", "WIDE288_MAX_EXPERTS", "WIDE288_GEMM2_MIN_K", "WIDE288_LONG_K_GEMM2_MIN_K",
    "WIDE288_LONG_K_MAX_ROWS", "WIDE_EXPERT_SPLIT", "row_alignment", "wide_token_box", "wide_epilogue_rows", "wide_epilogue_bytes",
    "ENTRY_ABI", "Sm90GemmConfig", "Sm90Problem", "FUSED_TAIL_PARTS", "unit_rows", "smem_bytes", "resolve_stages",
    "can_implement",
]


FAMILY = "sm90_grouped_gemm"
# The entry points' signature, part of every kernel key: 2 = the grid (num_ctas, the device's SMs) is the last
# argument before the stream (1, unversioned: the grid was fixed at 132 CTAs when the kernel was compiled).
ENTRY_ABI = 2
EPILOGUE_SMEM_STAGES = 2
EPILOGUE_TILE_N = 32
# N of a regular kernel whose last n-block is partial: whole gate / up chunk pairs (GEMM1), 16-byte C rows (GEMM2)
N_TAIL_ALIGN = {GemmStage.GEMM1: 2 * GATE_UP_CHUNK, GemmStage.GEMM2: 8}
BARRIER_RESERVE_BYTES = 1024
METADATA_RESERVE_BYTES = 8 * 257  # SMEM copies of row_offsets and counts, up to 256 experts


class Scheduler(enum.Enum):
    STATIC = "static"  # unit = cluster id + i * clusters
    DYNAMIC = "dynamic"  # global atomic counter (rank 0 of each cluster fetches), epoch reset in-kernel
    # DYNAMIC with the unit order in two halves, one per L2 partition of the SMs (l2_sides.py): units that share an
    # operand tile run on one partition's SMs; the regular kernel only
    DYNAMIC_SIDES = "dynamic_sides"


class Raster(enum.Enum):
    ALONG_M = "along_m"  # consecutive units: next m-block, same n-block (weight tile stays in L2)
    ALONG_N = "along_n"  # consecutive units: next n-block, same m-block (token tile stays in L2)
    # groups of `raster_group_m` m-blocks; within a group consecutive units walk its m-blocks (the m-blocks
    # of one expert read the same weight tile at nearly the same time), then the next n-block
    GROUPED_M = "grouped_m"
    # GROUPED_M whose groups never span two experts: each expert's m-blocks are cut into groups of
    # `raster_group_m` (its last group may be short), so every m-block of a group reads the same weight tile
    # one unit after the other (with GROUPED_M a group boundary inside an expert puts its m-blocks a whole
    # group of units apart); SINGLE units only
    EXPERT_GROUPED_M = "expert_grouped_m"


GROUPED_RASTERS = (Raster.GROUPED_M, Raster.EXPERT_GROUPED_M)  # the rasters that take raster_group_m


class Consumers(enum.Enum):
    COOPERATIVE = "cooperative"  # tile_m / 64 consumer warpgroups split the rows of every tile
    PINGPONG = "pingpong"  # two consumer warpgroups take alternate units: one's epilogue under the other's MMA


class PaddingRows(enum.Enum):
    """What a consumer warpgroup does with its 64 rows of a tile when all of them are padding (the last
    m-block of an expert that holds at most 64 valid rows). COOPERATIVE 128-row tiles only."""

    MULTIPLY = "multiply"  # runs its MMAs like any other warpgroup (the rows are stored but never read)
    # waits on each stage and releases it without MMAs: the other warpgroup has the tensor cores to itself,
    # so such a tile takes about half the MMA time
    SKIP = "skip"
    # SKIP, and an expert's last m-block of at most 64 valid rows is multiplied with the m-block before it: one
    # 192-row unit on one pass of the weight tile, where SKIP streams that weight tile once more for the tail (each
    # of the two warpgroups also takes the tail's rows x half the weight tile; the tail's own unit is empty).
    # cute_fused_tail_backend.py: tile_k 32 or 64, gathered A, AFTER_MAINLOOP stores. Measured 1.02-1.13x the regular
    # kernel with the same stores at 128-512 rows per expert (results/fuse-tail-h200-2026-12-01/): not a default
    FUSE_TAIL = "fuse_tail"
    # SKIP, and an expert of exactly three m-blocks whose last holds at most 64 valid rows has that tail's columns
    # split between its first two units (each 1.25x a plain unit, so the units that share the expert's weight tiles
    # stay in step; a FUSE_TAIL unit is 1.5x its neighbours). Same kernel file and limits, output tiles a multiple of
    # 64 columns. Measured 1.11x the regular kernel with the same stores on deepseek-v3 T=8192: not a default
    SPLIT_TAIL = "split_tail"


class EpilogueStore(enum.Enum):
    """When a COOPERATIVE regular kernel stores a unit's output tile (its registers -> SMEM -> TMA store)."""

    AFTER_MAINLOOP = "after_mainloop"  # right after the unit's mainloop: the tensor cores wait for the stores
    # the tile, converted to C's dtype, stays in registers, and its epilogue sub-tiles are stored one per K tile
    # during the next unit's first K tiles, under its MMAs (the last unit's after the loop)
    UNDER_NEXT_MAINLOOP = "under_next_mainloop"
    # GEMM1 (gated): as UNDER_NEXT_MAINLOOP, but what stays in registers is the tile's gate and up
    # columns (bias added, rounded to C's dtype, as a same-dtype torch run rounds its GEMM output), and each
    # sub-tile's activation math runs under the next unit's MMAs too
    ACTIVATION_UNDER_NEXT_MAINLOOP = "activation_under_next_mainloop"


class ASource(enum.Enum):
    """Where GEMM1's regular (TOKENS_AS_M) or wide WEIGHTS_AS_M kernel reads the token rows from."""

    # the gathered copy [max_rows, K] in padded expert order (router.gather writes it), loaded by TMA
    EXPERT_ORDER_COPY = "copy"
    # the token rows [T, K] themselves: padded row r reads hidden[a_rows[r] // rows_per_token] (a_rows = the
    # dispatch's sorted_slots; padding rows read hidden[r % T]) through cp.async by the producer warpgroup, so the
    # layer runs no gather launch and GEMM1 reads T rows instead of T * k (SINGLE units, tile_k a multiple of 64)
    TOKEN_ROWS = "token_rows"


class ExpertSplit(enum.Enum):
    """How a wide WEIGHTS_AS_M kernel spreads an expert's rows over its ceil(rows / tile_m) token tiles."""

    FILL = "fill"  # tile_m rows per tile, the rest in the last (289 rows on 288-row tiles: 288 + 1)
    # the same share per tile, rounded up to the token tile's TMA box (289 rows: 160 + 129): no tile streams the
    # expert's weights for a few rows, and the tiles of one expert take about the same time
    EVEN = "even"


class DependentLaunch(enum.Enum):
    """How a kernel starts against the previous kernel of its stream (CUDA programmatic dependent launch, sm_90)."""

    STREAM_ORDER = "stream_order"  # a plain launch: its CTAs start once the previous kernel has completed
    # launched with the programmatic-stream-serialization attribute: its CTAs may start while the previous kernel
    # drains (as SMs free up), set up their barriers and descriptors, then wait (griddepcontrol.wait: that kernel
    # completed and its writes are visible) before their first read of any input, and release the next kernel's
    # launch (griddepcontrol.launch_dependents)
    PROGRAMMATIC = "programmatic"
    # PROGRAMMATIC, and before the wait the producer warp prefetches the first `stages` K tiles of its first unit's
    # weight tile into L2 (cp.async.bulk.prefetch.tensor), so the stream of weights starts under the previous
    # kernel's drain. The unit is read from the dispatch metadata before the wait: where a caller's previous kernel
    # still writes it, the guess may be wrong and costs only the prefetch (L2 holds the coherent data; the kernel
    # reads the metadata again after the wait)
    PROGRAMMATIC_WEIGHT_PREFETCH = "programmatic_weight_prefetch"


class Operands(enum.Enum):
    """Which side of the wgmma the token rows are (the kernel family file of each: see the module docstring)."""

    TOKENS_AS_M = "tokens_as_m"  # cute_backend.py: 64/128-row token tiles x tile_n weight rows
    WEIGHTS_AS_M = "weights_as_m"  # cute_swapped_backend.py (decode): tile_n weight rows x 8..64 token rows


SWAPPED_TILE_M = (8, 16, 32, 64)  # token rows per unit with WEIGHTS_AS_M (the wgmma N size)
# WEIGHTS_AS_M "wide" token tiles: wgmma N per unit = valid rows rounded up to token_step. 160 holds a whole expert
# of 128 +- 32 rows (T * k / E = 128 under a near-uniform routing) in one unit, where 128-row tiles give every expert
# above 128 rows a second unit that streams its weights once more for a few rows; 288 does the same for 256 +- 32
# rows on 128 weight rows (a unit above 144 rows as two wgmma: 144 token rows, then the rest)
WIDE_TILE_M = (128, 160, 256, 288)
WGMMA_MAX_N = 256  # token rows of one wgmma; a wide tile of more takes two per unit above its half
WIDE_TILE_N = (64, 128, 256)  # weight rows of a wide unit: two consumer warpgroups of 1 or 2 wgmma atoms (64: one)
WIDE_ROW_ALIGN = 64  # row_offsets of a wide kernel must be multiples of it (every TMA box of a token tile starts there)
WIDE_MAX_ACC_ELEMS = 256 * 160  # tile_n * tile_m of a wide unit: 160 fp32 accumulator registers per consumer thread
WIDE_EPI_PAD = 8  # elements of padding per row of the wide epilogue's SMEM staging tile (cute_swapped_backend.py)
# Defaults of the swapped (decode) kernel, measured on the H200 (docs/perf-notes-sm90.md, v5): it beats the
# regular kernel up to ~32 rows per expert; token tiles of 16 rows up to 8 rows per expert on average, 32 up
# to 16 and 64 up to 32, so that almost every expert fits one tile (a second tile streams the expert's
# weights again). Weight tiles of 128 rows, halved while the units would fill less than half the SMs.
SWAPPED_MAX_ROWS_PER_EXPERT = 32
SWAPPED_TILE_M_LIMITS = ((8, 16), (16, 32), (32, 64))  # (most rows per expert on average, token tile)
SWAPPED_TILE_N = 128
SWAPPED_TILE_K = 128
# rows per expert at which preset bundles hold swapped_config's choice (every tile_m; the narrow weight
# tiles of batches that hit few experts)
SWAPPED_PRESET_ROWS = (1 / 256, 1 / 64, 1 / 16, 1 / 4, 8, 16, 32)
# Regular-kernel raster (docs/perf-notes-sm90.md v6, v10): GROUPED_M in groups of 8 m-blocks above 128 rows per
# expert on average (experts of several m-blocks), ALONG_N at or below; also ALONG_N up to ALONG_N_MAX_ROWS rows
# per expert where a GEMM has at most ALONG_N_MAX_N_BLOCKS n-blocks (the n-blocks of one m-block then run
# together, and the expert's next m-block reads the same weight tiles soon after)
GROUPED_RASTER_MIN_ROWS = 128
GROUPED_RASTER_GROUP_M = 8
# GEMM1 (SINGLE units, DYNAMIC) up to GEMM1_EXPERT_GROUPED_MAX_ROWS rows per expert (docs/perf-notes-sm90.md v15):
# EXPERT_GROUPED_M in groups of GROUPED_RASTER_GROUP_M with PaddingRows.SKIP. Each alone moves GEMM1 by -5..+8%
# depending on the model; together they measured 0.95-1.00 at 64-512 rows per expert in two runs: a tail unit that
# skips half its MMAs runs ahead of the m-blocks sharing its weight tile, and only the expert-grouped order keeps
# those m-blocks' loads together in L2 anyway. At 1024+ rows per expert, where tails are a few % of the MMAs, they
# measured 0.99-1.00 (one run) and the layer 1-2% slower (two A/B runs): the rule of GEMM2 applies there.
GEMM1_RASTER = Raster.EXPERT_GROUPED_M
GEMM1_EXPERT_GROUPED_MAX_ROWS = 512
ALONG_N_MAX_ROWS = 512
ALONG_N_MAX_N_BLOCKS = 32
# Wide WEIGHTS_AS_M kernel (cute_swapped_backend.py): 128/160/256/288-row token tiles, wgmma N = valid rows rounded up
# to 32, 128 weight rows (two consumer warpgroups), STATIC, ALONG_N. Where default_config picks it (measured on the
# H200, docs/perf-notes-sm90.md v9; GEMM bench of five presets at T = 512..32768):
# - layers of at most WIDE_MAX_EXPERTS experts at WIDE_ROWS_PER_EXPERT rows per expert, outside the ranges of the
#   160- and 288-row tiles below (measured at mixtral-8x7b T=512, 128 rows: GEMM1 -12%, GEMM2 -34% against the regular
#   kernel, whose second m-block per expert streams the expert's 235 MB of weights from DRAM again); on 128-256
#   experts the regular kernel stays 0-9% ahead there;
# - GEMM2 at WIDE_GEMM2_ROWS_PER_EXPERT rows per expert, 128-row token tiles (qwen3 T=512, 32 rows: -22% / -9%
#   against the swapped decode kernel), where GEMM1 keeps the decode kernel (equal or better);
# - any layer at WIDE160_ROWS_PER_EXPERT rows per expert where N is a multiple of 256: 160-row token tiles on 256
#   weight rows, one unit per expert of up to 160 rows (docs/perf-history.md stop 34, results/wide160-h200-2026-12-03;
#   model routing, 128 rows per expert, GEMM1 / GEMM2 against the kernels the layer ran: qwen3-235b T=2048 -16% /
#   -11%, qwen3-30b T=2048 -12% (against its token-row GEMM1) / -10%, mixtral-8x7b T=512 -9% / -6% against the
#   256-row wide tile). The 128-row regular tiles give every expert above 128 rows a second unit that streams its
#   weights again for a few rows (uniform routing: half the experts); the 128 x 256 wide tile does the same, and the
#   256 x 128 one re-reads each expert's token tile once per 128 weight rows.
WIDE_TILE_K = 64
WIDE_TOKEN_STEP = 32
WIDE_MAX_EXPERTS = 16
WIDE_ROWS_PER_EXPERT = (SWAPPED_MAX_ROWS_PER_EXPERT, 192)  # (lowest exclusive, highest inclusive), tile_m 256
WIDE_GEMM2_ROWS_PER_EXPERT = (16, SWAPPED_MAX_ROWS_PER_EXPERT)  # tile_m 128
# tile_m 160, tile_n 256 (run 5 of those results, qwen3 at 96 / 144 / 176 rows per expert: 0.97-0.99 / 0.80-0.89 /
# 1.16-1.29x the regular kernel's time: experts above 160 rows need a second unit)
WIDE160_ROWS_PER_EXPERT = (96, 144)
WIDE160_TILE_M = 160
# tile_m 288, tile_n 128 (a partial last n-block where N is no multiple of 128), STATIC, token_step 32, at
# WIDE288_ROWS_PER_EXPERT rows per expert on at most WIDE288_MAX_EXPERTS experts; GEMM2 only at K >= WIDE288_GEMM2_MIN_K
# (results/wide288-h200-2026-12-03, model routing, against the regular kernel, GEMM1 / GEMM2):
# - 160-256 rows per expert: gpt-oss-120b 0.87 / 0.89 (160), 0.88 / 0.92 (192), 0.94 / 0.96 (224), 0.91 / 0.93 (256);
#   qwen3-235b GEMM1 0.86 / 0.90 / 0.97 / 0.91, qwen3-30b GEMM1 0.94 / 1.00 / 0.96 (192-256); mixtral-8x7b (256)
#   0.92 / 0.73; every expert in one unit (the 160-row tile at 160 rows: 0.97 / 1.13 and 0.99 / 1.00).
# - 288 rows: 1.03-1.08 (half the experts need a second unit), 320: 1.20 / 1.28; the range ends at 256.
# - GEMM2 at short K loses (qwen3-235b K 1536: 1.03, qwen3-30b K 768: 1.10 at 256 rows): a wide unit's epilogue runs
#   between mainloops, which few K tiles do not hide.
# - deepseek-v3 T=8192 (256 experts; the bench's routing spreads them over 0-539 rows, so many need a second unit):
#   1.09 / 1.10.
# - GEMM2 at K >= WIDE288_LONG_K_GEMM2_MIN_K up to WIDE288_LONG_K_MAX_ROWS rows per expert (two tiles; results/
#   even-split-h200-2026-12-03, 512 rows): mixtral-8x7b (K 14336) 0.85; at shorter K it loses (qwen3-235b K 1536: 1.11,
#   qwen3-30b K 768: 1.25). GEMM1 at 512 rows: 0.98-1.00 (qwen3, mixtral), left to the regular kernel.
WIDE288_ROWS_PER_EXPERT = (144, 256)
WIDE288_TILE_M = 288
WIDE288_TILE_N = 128
WIDE288_MAX_EXPERTS = 128
WIDE288_GEMM2_MIN_K = 2880
WIDE288_LONG_K_GEMM2_MIN_K = 8192
WIDE288_LONG_K_MAX_ROWS = 576
# how the 160- and 288-row tiles the policy picks spread an expert's rows over its tiles: EVEN (same results, against
# FILL with the same tiles: 320 rows per expert -8.5% / -19%, deepseek-v3 T=8192 -2.2% / -3.1%, no change where no
# expert needs a second tile)
WIDE_EXPERT_SPLIT = ExpertSplit.EVEN


def row_alignment(config: "Sm90GemmConfig") -> int:
    """What every expert's first row (row_offsets[e]) must be a multiple of for `config`'s kernel: the regular kernel's
    m-block (tile_m), a wide tile's TMA box start (WIDE_ROW_ALIGN), a decode tile's token rows (its tile_m)."""
    if config.operands is Operands.WEIGHTS_AS_M:
        return WIDE_ROW_ALIGN if config.wide else config.tile_m
    return config.tile_m


def wide_token_box(tile_m: int) -> int:
    """Rows per TMA box of a wide token tile: 64, or 32 where tile_m is no multiple of 64 (160: an expert's second
    token tile then starts 160 rows in, a multiple of the box)."""
    return 64 if tile_m % 64 == 0 else 32


def wide_epilogue_rows(tile_m: int, tile_n: int, gated: bool) -> int:
    """Token rows per pass of the wide epilogue's staging tile [rows][output columns + pad] (a divisor of tile_m): 64,
    or 32 for 256 weight rows or a tile_m of no multiple of 64, and 16 for the ungated output of a 160 x 256 tile
    (its 53 KB stages leave room for 4 only beside a tile of at most 16 x 256 or 32 x 128 outputs)."""
    if tile_m % 64 and tile_n > 128 and not gated:
        return 16
    return 32 if tile_n > 128 or tile_m % 64 else 64


def wide_epilogue_bytes(tile_m: int, tile_n: int) -> int:
    """SMEM of the wide epilogue's staging tile, the larger of a gated (tile_n / 2 output columns) and an ungated
    (tile_n) GEMM's: the stage count depends on the configuration only."""
    return max(wide_epilogue_rows(tile_m, tile_n, gated) * (tile_n // (2 if gated else 1) + WIDE_EPI_PAD) * 2
               for gated in (False, True))


@dataclasses.dataclass(frozen=True)
class Sm90GemmConfig:
    """Static choices of one sm90 grouped GEMM kernel (the token count is never one of them)."""

    tile_m: int = 128  # token rows per CTA: 64 (one consumer warpgroup) or 128 (two); WEIGHTS_AS_M: 8..64
    tile_n: int = 256  # weight rows per CTA tile (GEMM1: gate+up interleaved, output tile_n / 2)
    tile_k: int = 64
    stages: int = 0  # 0: as many as the SMEM budget allows (at most 8)
    work_unit: WorkUnit = WorkUnit.SINGLE  # PAIR: (2,1,1) clusters, B multicast for experts >= threshold
    scheduler: Scheduler = Scheduler.STATIC
    raster: Raster = Raster.ALONG_N
    pair_threshold: int = 256  # runtime: experts with at least this many rows use pair units
    raster_group_m: int = 8  # m-blocks per raster group (Raster.GROUPED_M / EXPERT_GROUPED_M only)
    consumers: Consumers = Consumers.COOPERATIVE
    operands: Operands = Operands.TOKENS_AS_M
    padding_rows: PaddingRows = PaddingRows.MULTIPLY
    # WEIGHTS_AS_M wide token tiles (tile_m in WIDE_TILE_M): the granularity of the per-unit wgmma N (0: tile_m,
    # one size); decode tiles take 0
    token_step: int = 0
    expert_split: ExpertSplit = ExpertSplit.FILL  # wide tiles only
    a_source: ASource = ASource.EXPERT_ORDER_COPY
    epilogue_store: EpilogueStore = EpilogueStore.AFTER_MAINLOOP
    dependent_launch: DependentLaunch = DependentLaunch.STREAM_ORDER

    def __post_init__(self):
        # ints only: 64.0 or True would hash and compare equal to 64 or 1, and the memoized can_implement /
        # kernel_key would then serve one's answer for the other (values are can_implement's to judge)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {value!r}")

    @property
    def wide(self) -> bool:
        """A WEIGHTS_AS_M configuration with a wide token tile (several consumer warpgroups, N per unit)."""
        return self.operands is Operands.WEIGHTS_AS_M and self.tile_m in WIDE_TILE_M

    @property
    def cluster_m(self) -> int:
        return 2 if self.work_unit is WorkUnit.PAIR else 1

    @property
    def takes_expert_subsets(self) -> bool:
        """Whether one launch may multiply a subset of the experts, the others given 0 rows by `counts` while
        row_offsets keeps their rows (one launch per expert class, sm90_grouped_gemm.expert_classes): it then stores
        none of those rows and streams none of those experts' weights. WEIGHTS_AS_M kernels count their token tiles
        from the counts; the regular kernel skips a unit with no valid row where a unit has one CTA and COOPERATIVE
        consumers (cute_backend.py); the fused-tail kernels do not."""
        if self.operands is Operands.WEIGHTS_AS_M:
            return True
        return (self.cluster_m == 1 and self.consumers is Consumers.COOPERATIVE
                and self.padding_rows not in (PaddingRows.FUSE_TAIL, PaddingRows.SPLIT_TAIL))


_INT_FIELDS = ("tile_m", "tile_n", "tile_k", "stages", "pair_threshold", "raster_group_m", "token_step")
_ENUM_FIELDS = (("work_unit", WorkUnit), ("scheduler", Scheduler), ("raster", Raster), ("consumers", Consumers),
                ("operands", Operands), ("padding_rows", PaddingRows), ("expert_split", ExpertSplit),
                ("a_source", ASource), ("epilogue_store", EpilogueStore), ("dependent_launch", DependentLaunch))


@dataclasses.dataclass(frozen=True)
class Sm90Problem:
    """Static facts of one grouped GEMM: n = weight rows (GEMM1: 2I), k = reduction length."""

    kind: GemmStage
    n: int
    k: int
    num_experts: int
    dtype: torch.dtype = torch.bfloat16
    activation: Activation | None = None  # GEMM1 only
    has_bias: bool = False
    has_row_scale: bool = False  # GEMM2 only

    def __post_init__(self):
        if not isinstance(self.kind, GemmStage):
            raise TypeError(f"kind: expected a GemmStage, got {self.kind!r}")
        for name in ("n", "k", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")

    @property
    def out_n(self) -> int:
        return self.n // 2 if self.kind is GemmStage.GEMM1 else self.n

    @property
    def epilogue(self) -> str:
        return epilogue_name(self.kind, self.activation, self.has_row_scale, self.has_bias)


def _memoized(fn):
    """`fn` cached on its arguments. can_implement, the config policies and kernel_key are pure functions of frozen
    configurations and problems that the layer calls for every GEMM of every forward (3-25 us of Python each);
    arguments that cannot be hashed bypass the cache, so their errors are fn's own."""
    cached = functools.lru_cache(maxsize=4096)(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return cached(*args, **kwargs)
        except TypeError:  # unhashable arguments (or fn's own TypeError, which the direct call raises again)
            return fn(*args, **kwargs)

    wrapper.cache_clear = cached.cache_clear
    return wrapper


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


FUSED_TAIL_PARTS = {PaddingRows.FUSE_TAIL: 1, PaddingRows.SPLIT_TAIL: 2}  # units that share an expert's tail


def unit_rows(config: Sm90GemmConfig) -> int:
    """A rows one unit's MMA covers: tile_m, or tile_m + 64 where a unit may take a tail (FUSE_TAIL, SPLIT_TAIL)."""
    return config.tile_m + 64 if config.padding_rows in FUSED_TAIL_PARTS else config.tile_m


def smem_bytes(config: Sm90GemmConfig, stages: int) -> int:
    """SMEM one CTA uses: `stages` A+B stages, the epilogue staging buffers, barriers."""
    per_stage = input_bytes_per_stage(unit_rows(config), config.tile_n, config.tile_k, 2, WorkUnit.SINGLE, Arch.SM90)
    return stages * per_stage + _reserved_bytes(config)


def _reserved_bytes(config: Sm90GemmConfig) -> int:
    if config.operands is Operands.WEIGHTS_AS_M:  # one more metadata array (token tiles)
        # decode: no SMEM epilogue; wide: a staging tile of wide_epilogue_rows tokens x (output columns + pad)
        epi = wide_epilogue_bytes(config.tile_m, config.tile_n) + 128 if config.wide else 0
        return BARRIER_RESERVE_BYTES + METADATA_RESERVE_BYTES * 3 // 2 + 2 * 1024 + epi
    if config.consumers is Consumers.PINGPONG:  # each warpgroup its own epilogue buffers of 64 rows
        epi = 2 * 64 * EPILOGUE_TILE_N * 2 * EPILOGUE_SMEM_STAGES
    else:  # the tile's rows (FUSE_TAIL: 64 rows per warpgroup, two)
        epi = config.tile_m * EPILOGUE_TILE_N * 2 * EPILOGUE_SMEM_STAGES
    # + alignment padding of the three 1 KiB-aligned buffers
    return epi + BARRIER_RESERVE_BYTES + METADATA_RESERVE_BYTES + 3 * 1024


def resolve_stages(config: Sm90GemmConfig) -> int:
    """The stage count the kernel is compiled with (config.stages, or the most that fit, capped at 8)."""
    if config.stages:
        return config.stages
    # each CTA keeps the whole B tile even in a pair (multicast), so SINGLE accounting holds for both
    per_stage = input_bytes_per_stage(unit_rows(config), config.tile_n, config.tile_k, 2, WorkUnit.SINGLE, Arch.SM90)
    return min(8, max_stages(per_stage, _reserved_bytes(config), Arch.SM90))


@_memoized
def can_implement(config: Sm90GemmConfig, problem: Sm90Problem) -> tuple[bool, str]:
    """(True, "") when this kernel can run `problem` with `config`, else (False, why)."""
    if not isinstance(config, Sm90GemmConfig):
        return False, f"config: expected Sm90GemmConfig, got {type(config).__name__}"
    if not isinstance(problem, Sm90Problem):
        return False, f"problem: expected Sm90Problem, got {type(problem).__name__}"
    for name, kind in _ENUM_FIELDS:
        if not isinstance(getattr(config, name), kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            return False, f"{name}: expected {article} {kind.__name__}, got {getattr(config, name)!r}"
    if problem.dtype not in (torch.bfloat16, torch.float16):
        return False, f"dtype: expected bfloat16 or float16, got {problem.dtype}"
    swapped = config.operands is Operands.WEIGHTS_AS_M
    if isinstance(config.token_step, bool) or not isinstance(config.token_step, int) or config.token_step < 0:
        return False, f"token_step: expected an int >= 0, got {config.token_step!r}"
    if config.token_step and not config.wide:
        return False, (f"token_step: only WEIGHTS_AS_M token tiles of {WIDE_TILE_M} rows take one "
                       f"(got {config.token_step})")
    if not isinstance(config.expert_split, ExpertSplit):
        return False, f"expert_split: expected an ExpertSplit, got {config.expert_split!r}"
    if config.expert_split is not ExpertSplit.FILL and not config.wide:
        return False, f"expert_split: only WEIGHTS_AS_M token tiles of {WIDE_TILE_M} rows take {config.expert_split}"
    if swapped:
        if config.tile_m not in SWAPPED_TILE_M + WIDE_TILE_M:
            return False, (f"tile_m: expected one of {SWAPPED_TILE_M + WIDE_TILE_M} token rows with WEIGHTS_AS_M, "
                           f"got {config.tile_m}")
        if config.wide:
            if config.tile_n not in WIDE_TILE_N:
                return False, (f"tile_n: a wide WEIGHTS_AS_M tile takes {WIDE_TILE_N} weight rows (two consumer "
                               f"warpgroups of one or two 64-row wgmma atoms), got {config.tile_n}")
            if config.tile_n * config.tile_m > WIDE_MAX_ACC_ELEMS:
                return False, (f"tile_m: a wide tile of {config.tile_n} weight rows takes at most "
                               f"{WIDE_MAX_ACC_ELEMS // config.tile_n} token rows (fp32 accumulator registers), got "
                               f"{config.tile_m}")
            step = config.token_step or config.tile_m
            if step % 8 or config.tile_m % step:
                return False, f"token_step: expected a multiple of 8 dividing tile_m {config.tile_m}, got {step}"
            if config.tile_m > WGMMA_MAX_N and step % 16:
                return False, (f"token_step: a tile of {config.tile_m} token rows multiplies a unit above "
                               f"{config.tile_m // 2} rows as two wgmma (a multiple of 8 rows each): expected a "
                               f"multiple of 16, got {step}")
        elif config.tile_n % 64 or not 64 <= config.tile_n <= 256:
            return False, f"tile_n: WEIGHTS_AS_M takes 64, 128, 192 or 256 weight rows (wgmma M), got {config.tile_n}"
        if config.work_unit is not WorkUnit.SINGLE or config.consumers is not Consumers.COOPERATIVE:
            return False, "operands: WEIGHTS_AS_M runs SINGLE work units with COOPERATIVE consumers"
    elif config.tile_m not in (64, 128):
        return False, f"tile_m: expected 64 or 128, got {config.tile_m}"
    if config.tile_k not in (32, 64, 128):
        return False, f"tile_k: expected 32, 64 or 128, got {config.tile_k}"
    if swapped and config.wide and config.a_source is ASource.EXPERT_ORDER_COPY and config.tile_k > 64:
        # the gathered token tile arrives as 64-row TMA boxes, staged box after box; the wgmma reads it through the
        # whole tile's K-major layout, which matches that staging only for one 64-column swizzle atom of K
        return False, (f"tile_k: a wide WEIGHTS_AS_M tile on the gathered copy takes tile_k 32 or 64 (its 64-row token "
                       f"boxes are staged per box), got {config.tile_k}")
    if config.tile_n % 16 or not 16 <= config.tile_n <= 256:
        return False, f"tile_n: expected a multiple of 16 in [16, 256], got {config.tile_n}"
    out_tile_n = config.tile_n // 2 if problem.kind is GemmStage.GEMM1 else config.tile_n
    if not swapped:  # (WEIGHTS_AS_M stores from registers: no SMEM epilogue tile to divide)
        if out_tile_n < 16:  # (an 8-column output tile is narrower than the MMA's output atom: does not compile)
            return False, f"tile_n: output tile {out_tile_n} is below 16 columns (GEMM1's is tile_n / 2)"
        if out_tile_n % EPILOGUE_TILE_N and out_tile_n > EPILOGUE_TILE_N:
            return False, f"tile_n: output tile {out_tile_n} must be a multiple of {EPILOGUE_TILE_N}"
        if out_tile_n < EPILOGUE_TILE_N and EPILOGUE_TILE_N % out_tile_n:
            return False, f"tile_n: output tile {out_tile_n} must divide {EPILOGUE_TILE_N}"
    tail_align = N_TAIL_ALIGN[problem.kind]
    if problem.n % config.tile_n and ((swapped and not config.wide) or problem.n % tail_align):
        # the regular and the wide kernel take a partial last n-block (TMA zero-fills B's rows past N, and C's
        # columns past N are not stored); the decode kernel does not
        return False, (f"n: {problem.n} is not a multiple of tile_n {config.tile_n}"
                       + (" (WEIGHTS_AS_M decode tiles take whole n-blocks only)" if swapped and not config.wide
                          else f" (a partial last n-block needs n a multiple of {tail_align})"))
    if problem.kind is GemmStage.GEMM1:
        if problem.activation is None:
            return False, "activation: GEMM1 needs an Activation"
        if problem.has_row_scale:
            return False, "row_scale: only GEMM2 takes a row scale"
        if (problem.n // 2) % GATE_UP_CHUNK:
            return False, f"n: intermediate size {problem.n // 2} must be a multiple of {GATE_UP_CHUNK}"
    elif problem.activation is not None:
        return False, "activation: GEMM2 takes no activation"
    if problem.k % 8:
        return False, f"k: {problem.k} must be a multiple of 8 (16-byte TMA rows)"
    if config.work_unit is WorkUnit.PAIR and config.scheduler in (Scheduler.DYNAMIC, Scheduler.DYNAMIC_SIDES) and (
            config.consumers is Consumers.PINGPONG):
        return False, "scheduler: DYNAMIC with PAIR units needs COOPERATIVE consumers"
    if config.scheduler is Scheduler.DYNAMIC_SIDES and (swapped or config.padding_rows in FUSED_TAIL_PARTS):
        return False, "scheduler: DYNAMIC_SIDES is implemented for the regular TOKENS_AS_M kernel only"
    if problem.num_experts > 256:
        return False, f"num_experts: at most 256 (SMEM metadata copy), got {problem.num_experts}"
    if config.consumers is Consumers.PINGPONG and config.tile_m * config.tile_n > 128 * 128:
        return False, (f"consumers: PINGPONG keeps a whole {config.tile_m}x{config.tile_n} accumulator in one "
                       "warpgroup; at most 128x128 fits its registers")
    if config.raster in GROUPED_RASTERS:
        if swapped:
            return False, f"raster: {config.raster.name} is implemented for TOKENS_AS_M only"
        if config.raster is Raster.EXPERT_GROUPED_M and config.work_unit is not WorkUnit.SINGLE:
            return False, "raster: EXPERT_GROUPED_M needs SINGLE work units (PAIR units span two m-blocks)"
        if not 1 <= config.raster_group_m <= 64:
            return False, f"raster_group_m: expected 1..64 m-blocks per group, got {config.raster_group_m}"
    if config.padding_rows is PaddingRows.SKIP and (
            swapped or config.consumers is not Consumers.COOPERATIVE or config.tile_m != 128):
        return False, ("padding_rows: SKIP needs COOPERATIVE consumers on 128-row TOKENS_AS_M tiles (two warpgroups "
                       "of 64 rows)")
    if config.padding_rows in FUSED_TAIL_PARTS and (
            swapped or config.consumers is not Consumers.COOPERATIVE or config.tile_m != 128
            or config.work_unit is not WorkUnit.SINGLE or config.tile_k not in (32, 64)
            or out_tile_n % (32 * FUSED_TAIL_PARTS[config.padding_rows])
            or config.a_source is not ASource.EXPERT_ORDER_COPY
            or config.epilogue_store is not EpilogueStore.AFTER_MAINLOOP):
        # (each warpgroup of a fused unit stores a slice of out_tile_n / (2 * parts) columns of the tail rows, in
        # sub-tiles of at least 16 columns: 8-column ones were measured wrong, gpt-oss GEMM1 on 192-wide SPLIT_TAIL)
        name = config.padding_rows.name
        return False, (f"padding_rows: {name} needs SINGLE units of COOPERATIVE 128-row TOKENS_AS_M tiles with "
                       f"tile_k 32 or 64, an output tile of a multiple of {32 * FUSED_TAIL_PARTS[config.padding_rows]} "
                       f"columns (got {out_tile_n}: each warpgroup of a fused unit stores a slice of a tail's "
                       "columns), gathered A and AFTER_MAINLOOP stores (the accumulators leave no registers for a held "
                       "tile)")
    if config.pair_threshold < 0:
        return False, f"pair_threshold: expected >= 0, got {config.pair_threshold}"
    if not isinstance(config.a_source, ASource):
        return False, f"a_source: expected an ASource, got {config.a_source!r}"
    if config.a_source is ASource.TOKEN_ROWS:
        if (swapped and not config.wide) or config.work_unit is not WorkUnit.SINGLE or (
                config.consumers is not Consumers.COOPERATIVE):
            return False, ("a_source: TOKEN_ROWS runs the regular (TOKENS_AS_M) kernel with SINGLE work units and "
                           "COOPERATIVE consumers, or a wide WEIGHTS_AS_M one")
        if problem.kind is not GemmStage.GEMM1:
            return False, "a_source: TOKEN_ROWS is GEMM1's (GEMM2 reads GEMM1's output, already in expert order)"
        if config.tile_k % 64 or problem.k % config.tile_k:
            return False, (f"a_source: TOKEN_ROWS copies whole 64-column slices: tile_k must be a multiple of 64 "
                           f"dividing k, got tile_k {config.tile_k}, k {problem.k}")
    if not isinstance(config.epilogue_store, EpilogueStore):
        return False, f"epilogue_store: expected an EpilogueStore, got {config.epilogue_store!r}"
    if config.epilogue_store is not EpilogueStore.AFTER_MAINLOOP and (
            swapped or config.consumers is not Consumers.COOPERATIVE):
        return False, (f"epilogue_store: {config.epilogue_store.name} is the regular (TOKENS_AS_M) kernel's with "
                       "COOPERATIVE consumers (PINGPONG overlaps by taking alternate units)")
    if config.epilogue_store is EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP and problem.kind is not GemmStage.GEMM1:
        return False, "epilogue_store: ACTIVATION_UNDER_NEXT_MAINLOOP defers GEMM1's gated activation (GEMM2 has none)"
    if not isinstance(config.dependent_launch, DependentLaunch):
        return False, f"dependent_launch: expected a DependentLaunch, got {config.dependent_launch!r}"
    if config.dependent_launch is DependentLaunch.PROGRAMMATIC_WEIGHT_PREFETCH and config.padding_rows in FUSED_TAIL_PARTS:
        return False, (f"dependent_launch: PROGRAMMATIC_WEIGHT_PREFETCH is implemented for the regular and the swapped "
                       f"kernels, not {config.padding_rows.name}'s (PROGRAMMATIC is)")
    stages = resolve_stages(config)
    if stages < 2:
        return False, f"stages: only {stages} fit in SMEM for tile {config.tile_m}x{config.tile_n}x{config.tile_k}"
    if smem_bytes(config, stages) > ARCH_LIMITS[Arch.SM90].smem_per_cta:
        return False, f"stages: {stages} stages need {smem_bytes(config, stages)} bytes of SMEM"
    return True, ""
