"""Portable Triton grouped GEMM over the padded expert-order layout (docs/design.md, "Grouped GEMM").

One kernel family, two entry points:
- GEMM1 (gated): out[r, n] = act(a[r] @ w13[e, n] + b13[e, n], a[r] @ w13[e, I + n] + b13[e, I + n]),
  w13 [E, 2I, H] in either W13Layout: GATE_THEN_UP (public; each program loads the gate block, rows n,
  and the up block, rows I + n, of its N tile into two fp32 accumulators, so no prepacking is needed) or
  CHUNKED (the CuTe kernels' packed layout: one block of 2 * block_n packed rows, one dot into a
  [block_m, 2 * block_n] accumulator whose columns are split into gate and up in registers). The activation
  is applied in registers. A layer can so feed the Triton and CuTe kernels from one packed copy of w13.
  Optional fused gather: with `a_rows` the A rows come from a compact token
  matrix, a[a_rows[r]] (a_rows[r] == -1 loads zeros), which skips materializing the gathered a1.
- GEMM2 (plain): y[r, n] = (a[r] @ w2[e, n] + b2[e, n]) * row_scale[r].

Work decomposition. A tile is (m_tile, n_tile): m_tile is a linear tile index over the experts' valid rows
for tile height block_m (tile_offsets[h_index] is the exclusive prefix sum of ceil(counts / block_m)); the
expert of an m_tile is the number of experts whose tile range ends at or before it (one vector compare over
tile_offsets[1:], loaded once per program). Row of the tile: row_offsets[e] + local_tile * block_m.
The grid is persistent: min(num_SMs * programs_per_sm, a static bound on tiles) programs take the linear
tile ids, STATIC (program p: p, p + programs, ...) or DYNAMIC (the next id from a global atomic counter,
fetched one tile ahead; the host wrapper zeroes a fresh counter for every launch, in stream order, so no
state outlives a launch or a graph replay). The tile count, tile_offsets[h_index, E] * n_tiles, is read on the
device, so there is no host sync and a launch can be captured in a CUDA graph and replayed with
another routing.
Raster: tile ids are grouped by `group_m` m-tiles that sweep all N tiles together (group_m = 1: programs
running together share A rows; large group_m: they share the weight tile of one expert).

Warps and pipelines: no warp specialization; all `num_warps` warps of a program load and multiply. Triton
software-pipelines the K loop `num_stages` deep: with TileLoad.POINTER through async copies (cp.async), with
TileLoad.TMA through bulk tensor copies of host-built tensor descriptors (weights viewed as [E * rows, K];
A as [max_rows, K] unless gathered through a_rows, which stays a pointer load); the "full" side of a stage is
its copy's completion, the "empty" side the completion of the dot that read it. tl.dot lowers to wgmma on
sm_90 for block_m >= 64 and to mma.sync otherwise. Accumulation is fp32; the epilogue (bias, activation,
row scale) runs on the fp32 accumulators and stores in the output dtype.
On sm_90+ the kernel is launched as a programmatic dependent launch: its grid can become resident while the
previous kernel of the stream drains (it waits for that kernel's results with griddepcontrol.wait before
reading anything); decode-sized launches (block_m < 64) also release the next kernel's grid at once, larger
ones as their programs exit. Inside a CUDA graph the edges are kept. This hides the launch gap between the
short kernels of a decode step.

Limits: a and the weights share one dtype in {float16, bfloat16, float32} (float32 multiplies in IEEE
fp32); rows are masked by counts[e], so only valid rows are read (A rows past the count are clamped to the
last valid row) and written (padding rows of `out` keep what they held); block sizes are powers of two,
block_k >= 16; any K and N (tails are masked; TMA: K * element size % 16 == 0, contiguous weights, rows of
A 16-byte aligned, tails zero-filled by the copy engine); 64-bit addressing. The wrapper's default config
estimates T * top_k as max_rows - E * (align - 1) from the `align` it is given (the dispatch's).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types

import torch
import triton
import triton.language as tl

from .epilogue import GATE_UP_CHUNK, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, Activation, GemmStage, W13Layout
from .operands import require_own_memory

__all__ = [
    "DEFAULT_TILE_HEIGHTS",
    "GroupedGemmProblem",
    "TileLoad",
    "TileScheduler",
    "TritonGemmConfig",
    "can_implement",
    "default_config",
    "triton_grouped_gemm1",
    "triton_grouped_gemm2",
]

DEFAULT_TILE_HEIGHTS = (16, 64, 128, 256)
DYNAMIC_MAX_EXPERTS = 16  # prefill tiles of layers with at most this many experts are scheduled DYNAMIC
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DEFAULT_SMEM_PER_BLOCK = 227 * 1024  # H100/H200 opt-in limit; the wrappers read the real device's
_MAX_ACC_REGS_PER_THREAD = 128  # fp32 accumulator registers a thread may hold before spilling is likely
_OAI_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)
_OAI_LIMIT = tl.constexpr(SWIGLU_OAI_LIMIT)
_ACTIVATION_CODE = {Activation.SWIGLU: 0, Activation.GELU_GATED: 1, Activation.SWIGLU_OAI: 2}


class TileScheduler(enum.Enum):
    """How the persistent programs pick their tiles."""

    STATIC = "static"  # program p takes tiles p, p + programs, p + 2 * programs, ...
    # each program takes the next tile from a global atomic counter (fetched one tile ahead), so the tiles
    # that read one weight tile (the m-tiles of one expert) start back to back; every launch gets its own
    # counter, zeroed in stream order
    DYNAMIC = "dynamic"


class TileLoad(enum.Enum):
    """How a program brings its A and weight tiles into shared memory."""

    POINTER = "pointer"  # tl.load of pointer tensors; Triton pipelines them with async copies
    TMA = "tma"  # tensor descriptors (bulk tensor copies, sm_90+) for the weights and, without a_rows, A


@dataclasses.dataclass(frozen=True)
class GroupedGemmProblem:
    """Static facts of one grouped GEMM launch (never the exact token count of a batch).

    n: output columns (I for GEMM1, H for GEMM2); k: reduction length (H for GEMM1, I for GEMM2);
    routed_rows: T * top_k, used only to pick a tokens-per-expert bucket.
    """

    stage: GemmStage
    num_experts: int
    n: int
    k: int
    routed_rows: int
    dtype: torch.dtype = torch.bfloat16
    tile_heights: tuple[int, ...] = DEFAULT_TILE_HEIGHTS
    num_sms: int = 132
    smem_per_block: int = _DEFAULT_SMEM_PER_BLOCK
    w13_layout: W13Layout = W13Layout.GATE_THEN_UP  # GEMM1's weight row order (GEMM2 ignores it)

    @property
    def chunked(self) -> bool:
        """GEMM1 on W13Layout.CHUNKED: one weight tile of 2 * block_n packed rows per K step."""
        return self.stage is GemmStage.GEMM1 and self.w13_layout is W13Layout.CHUNKED

    @property
    def weight_blocks(self) -> int:
        return 2 if self.stage is GemmStage.GEMM1 else 1


@dataclasses.dataclass(frozen=True)
class TritonGemmConfig:
    """One compiled variant. block_m must be one of the dispatch tile heights."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8  # m-tiles that sweep the N tiles together (tile raster)
    programs_per_sm: int = 1  # persistent grid = num_SMs * programs_per_sm (capped by the tile bound)
    tile_load: TileLoad = TileLoad.POINTER
    scheduler: TileScheduler = TileScheduler.STATIC

    def smem_bytes(self, problem: GroupedGemmProblem) -> int:
        elem = torch.finfo(problem.dtype).bits // 8
        per_stage = (self.block_m * self.block_k + problem.weight_blocks * self.block_n * self.block_k) * elem
        # Triton 3.x on sm_90: the wgmma path (block_m >= 64) keeps num_stages buffers of A and B, the
        # mma.sync path (block_m 16) num_stages - 1, with pointer loads and with TMA alike. Checked on
        # compiled kernels; other versions or GPUs may differ slightly (Triton then refuses to launch).
        buffers = self.num_stages if self.block_m >= 64 else max(1, self.num_stages - 1)
        return buffers * per_stage

    def acc_regs_per_thread(self, problem: GroupedGemmProblem) -> int:
        return problem.weight_blocks * self.block_m * self.block_n // (self.num_warps * 32)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def can_implement(config: TritonGemmConfig, problem: GroupedGemmProblem) -> tuple[bool, str]:
    """Whether this config can run this problem; the reason names what is off."""
    if not isinstance(config, TritonGemmConfig):
        return False, f"expected a TritonGemmConfig, got {type(config).__name__}"
    for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m", "programs_per_sm"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int):
            return False, f"{name}: expected an int, got {value!r}"
    if problem.dtype not in _SUPPORTED_DTYPES:
        return False, f"dtype {problem.dtype} not in {_SUPPORTED_DTYPES}"
    if min(problem.num_experts, problem.n, problem.k) < 1 or problem.routed_rows < 0:
        return False, "num_experts, n, k must be >= 1 and routed_rows >= 0"
    if config.block_m not in problem.tile_heights:
        return False, f"block_m {config.block_m} is not a dispatch tile height {problem.tile_heights}"
    for name in ("block_m", "block_n", "block_k", "num_warps", "group_m"):
        if not _is_pow2(getattr(config, name)):
            return False, f"{name} {getattr(config, name)} is not a power of two"
    if config.block_m < 16 or config.block_n < 16 or config.block_k < 16:
        return False, "block_m, block_n, block_k must be >= 16 (tl.dot minimum)"
    if config.num_warps > 16:
        return False, f"num_warps {config.num_warps} > 16"
    if config.num_stages < 1 or config.programs_per_sm < 1:
        return False, "num_stages and programs_per_sm must be >= 1"
    if not isinstance(config.tile_load, TileLoad):
        return False, f"tile_load: expected a TileLoad, got {config.tile_load!r}"
    if not isinstance(config.scheduler, TileScheduler):
        return False, f"scheduler: expected a TileScheduler, got {config.scheduler!r}"
    if config.tile_load is TileLoad.TMA and (problem.k * (torch.finfo(problem.dtype).bits // 8)) % 16:
        return False, f"tile_load TMA needs K * element size divisible by 16 bytes (K = {problem.k})"
    if not isinstance(problem.w13_layout, W13Layout):
        return False, f"w13_layout: expected a W13Layout, got {problem.w13_layout!r}"
    if problem.chunked:
        if problem.n % GATE_UP_CHUNK:
            return False, f"w13_layout chunked needs the intermediate size ({problem.n}) a multiple of {GATE_UP_CHUNK}"
        if config.tile_load is TileLoad.TMA and 2 * config.block_n > 256:
            return False, f"tile_load TMA on chunked w13 loads 2 * block_n = {2 * config.block_n} rows (box limit 256)"
    smem = config.smem_bytes(problem)
    if smem > problem.smem_per_block:
        return False, f"shared memory {smem} B for {config.num_stages} stages > {problem.smem_per_block} B"
    regs = config.acc_regs_per_thread(problem)
    if regs > _MAX_ACC_REGS_PER_THREAD:
        return False, f"{regs} fp32 accumulator registers per thread > {_MAX_ACC_REGS_PER_THREAD}"
    return True, ""


def _expected_active_experts(routed_rows: int, num_experts: int) -> float:
    """Experts with at least one row when routed_rows rows land uniformly on num_experts experts."""
    if routed_rows == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** routed_rows)


def _nearest_height(wanted: int, heights: tuple[int, ...]) -> int:
    """The height of `heights` nearest `wanted` (log scale) among those a tile can be: powers of two >= 16."""
    usable = [h for h in heights if h >= 16 and h & (h - 1) == 0]
    if not usable:
        raise ValueError(f"tile_heights: the Triton GEMMs tile by one of them, a power of two >= 16; got {heights}")
    return min(usable, key=lambda h: (abs(math.log2(h) - math.log2(wanted)), h))


def default_config(problem: GroupedGemmProblem) -> TritonGemmConfig:
    """Analytic choice by rows-per-active-expert bucket (decode / small / prefill), never by exact M.

    Tuned on an H200 (docs/perf-notes-triton.md: qwen3-30b-a3b and mixtral-8x7b, T = 1..4096):
    - decode (< 16 rows per active expert) streams the active experts' weights: block_m 16, block_k 256,
      block_n 64 unless that leaves over half of the SMs without a tile (then 32, 16), TMA weight loads.
    - small (<= 32 rows): 64 x 128 x 64 tiles, pointer loads.
    - prefill (> 32 rows): 128-row tiles with TMA loads; GEMM1 128 x 128 (two accumulators: 128 x 256 of
      gate/up work per tile), GEMM2 128 x 256, 4 stages. At 33-64 rows per expert the 128-row
      tiles read each expert's weights half as often as 64-row tiles and win (deepseek-v3 T=2048, 64 rows:
      GEMM1 -8%, GEMM2 -17%; wide sweep 2026-11-29 in serving_bench/results/validate-h200-2026-11-29/).
      Tiles are scheduled DYNAMIC where that measured faster (docs/perf-notes-triton.md, v4): at most 64
      rows per active expert (deepseek-v3 / gpt-oss T=2048: -2..-8%) or at most DYNAMIC_MAX_EXPERTS experts
      (mixtral GEMM1: -6..-7%); STATIC elsewhere (128-2048 rows on 128-256 experts: DYNAMIC +2..6%).
    Decode and small launch 2 programs per SM even where one fits: the waiting programs start as others
    finish, which evens out the tiles per SM. TMA needs K * element size % 16 == 0, else pointer loads.
    """
    active = max(1.0, _expected_active_experts(problem.routed_rows, problem.num_experts))
    rows_per_active = round(problem.routed_rows / active, 3)  # 4096 rows on 128 experts: 32, not 32.0000001
    tma = TileLoad.TMA
    if rows_per_active < 16:  # exactly 16 rows (gpt-oss, deepseek-v3 at T=512) measured best with 64-row tiles
        block_m = _nearest_height(16, problem.tile_heights)
        m_tiles = active * max(1, math.ceil(rows_per_active / block_m))
        block_n = 16
        for candidate in (64, 32):
            if m_tiles * math.ceil(problem.n / candidate) >= 0.5 * problem.num_sms:
                block_n = candidate
                break
        block_k = 256 if problem.k >= 512 else 128
        config = TritonGemmConfig(block_m, block_n, block_k, 4, 3, group_m=1, programs_per_sm=2, tile_load=tma)
    elif rows_per_active <= 32:
        block_m = _nearest_height(64, problem.tile_heights)
        config = TritonGemmConfig(block_m, 128, 64, 4, 4, group_m=8, programs_per_sm=2)
    else:
        block_m = _nearest_height(128, problem.tile_heights)
        block_n = 128 if problem.stage is GemmStage.GEMM1 else 256
        dynamic = rows_per_active <= 64 or problem.num_experts <= DYNAMIC_MAX_EXPERTS
        config = TritonGemmConfig(block_m, block_n, 64, 8, 4, group_m=8, programs_per_sm=1, tile_load=tma,
                                  scheduler=TileScheduler.DYNAMIC if dynamic else TileScheduler.STATIC)
    fitted = _fit_to_device(config, problem)
    if config.tile_load is TileLoad.TMA and not can_implement(fitted, problem)[0]:
        fitted = _fit_to_device(dataclasses.replace(config, tile_load=TileLoad.POINTER), problem)
    ok, why = can_implement(fitted, problem)
    if not ok:
        raise ValueError(_named_reason(why) or f"tile_heights: no default config fits block_m {fitted.block_m} of "
                         f"{problem.tile_heights} ({why})")
    return fitted


def _named_reason(why: str) -> str | None:
    """can_implement's reason where it is a fact of the problem that no config changes and names its argument
    (w13_layout's chunked order needs I a multiple of 8): the error to raise as it is, else None."""
    return why if why.startswith("w13_layout") else None


def require_distinct_rows(out: torch.Tensor) -> None:
    """ValueError unless the rows of a 2-D `out` with unit column stride lie in memory of their own (row stride at
    least the row length): programs writing rows that share memory would overwrite each other's results."""
    if out.dim() == 2 and out.shape[0] > 1 and out.shape[1] > 0 and out.stride(0) < out.shape[1]:
        raise ValueError(f"out: expected rows of their own memory (row stride >= {out.shape[1]} columns), got strides "
                         f"{tuple(out.stride())}")


def _fit_to_device(config: TritonGemmConfig, problem: GroupedGemmProblem) -> TritonGemmConfig:
    """`config` shrunk until can_implement accepts it: stages, then block_k (shared memory), then block_n and more
    warps (the registers of a tall block_m from custom tile heights). TMA is kept: default_config falls back to
    pointer loads only where the shrunk TMA config still does not fit (K's alignment, the box limit)."""
    while not can_implement(config, problem)[0] and config.num_stages > 2:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    while not can_implement(config, problem)[0] and config.block_k > 32:
        config = dataclasses.replace(config, block_k=config.block_k // 2)
    while not can_implement(config, problem)[0] and config.block_n > 32:
        config = dataclasses.replace(config, block_n=config.block_n // 2)
    while not can_implement(config, problem)[0] and config.num_warps < 8:
        config = dataclasses.replace(config, num_warps=config.num_warps * 2)
    return config


# ----------------------------------------------------------------------------------------------------------
# Kernel (decorated lazily: Triton picks compiled vs interpreted mode when a function is decorated, and we
# read nothing from the environment at import time). The kernel calls only Triton builtins (no jit'd
# helpers of triton.language.standard such as tl.sum or tl.cdiv; its own helpers _add and _gated_activation
# are decorated per mode with it), so it also runs in the interpreter when triton itself was imported in
# compiled mode.


def _add(x, y):  # tl.reduce combine function (decorated per mode with the kernel, see _jitted_kernel)
    return x + y


def _gated_activation(gate, up, ACTIVATION: tl.constexpr):
    """GEMM1's epilogue on fp32 (gate, up) (decorated per mode with a kernel; the token GEMVs use it too)."""
    if ACTIVATION == 0:  # SWIGLU: silu(gate) * up
        result = gate / (1.0 + tl.exp(-gate)) * up
    elif ACTIVATION == 1:  # GELU_GATED: gelu_erf(gate) * up
        result = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:  # SWIGLU_OAI (gpt-oss); a NaN stays NaN, as in torch.clamp (Triton's default min / max drop it)
        gate = tl.minimum(gate, _OAI_LIMIT, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(tl.maximum(up, -_OAI_LIMIT, propagate_nan=tl.PropagateNan.ALL), _OAI_LIMIT,
                        propagate_nan=tl.PropagateNan.ALL)
        result = (up + 1.0) * (gate / (1.0 + tl.exp(gate * -_OAI_ALPHA)))
    return result



def _grouped_gemm_kernel(
    a_ptr, a_rows_ptr, w_ptr, bias_ptr, row_scale_ptr, out_ptr, a_desc, w_desc,
    row_offsets_ptr, counts_ptr, tile_offsets_ptr, counter_ptr,
    num_experts, N, K,
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk, up_offset, w_rows_per_expert,
    stride_be, stride_bn,
    stride_om, stride_on,
    num_programs,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, GATHER: tl.constexpr, ROWS_PER_SOURCE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_E: tl.constexpr, A_TMA: tl.constexpr, W_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr, DYNAMIC: tl.constexpr, W13_CHUNK: tl.constexpr,
):
    if DEPENDENT_LAUNCH >= 1:
        # Programmatic dependent launch (sm_90+): this grid may start while the previous kernel of the
        # stream finishes; wait for its results first.
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:  # decode tiles: let the next kernel's grid start now (else as programs exit)
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    # Tile ends per expert, loaded once: expert(m_tile) = #experts whose tiles end at or before m_tile.
    offs_e = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(tile_offsets_ptr + 1 + offs_e, mask=offs_e < num_experts, other=2147483647)
    m_tiles = tl.load(tile_offsets_ptr + num_experts)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    total_tiles = m_tiles * n_tiles
    tiles_per_group = GROUP_M * n_tiles

    if DYNAMIC:
        tile = tl.atomic_add(counter_ptr, 1)
    else:
        tile = pid
    while tile < total_tiles:
        # the next tile now: the atomic's latency hides behind this tile's work
        if DYNAMIC:
            next_tile = tl.atomic_add(counter_ptr, 1)
        else:
            next_tile = tile + num_programs
        # Raster: GROUP_M m-tiles sweep all N tiles together.
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_size = tl.minimum(m_tiles - first_m, GROUP_M)
        in_group = tile % tiles_per_group
        m_tile = first_m + in_group % group_size
        n_tile = in_group // group_size

        expert = tl.reduce((tile_ends <= m_tile).to(tl.int32), 0, _add)
        local_tile = m_tile - tl.load(tile_offsets_ptr + expert)
        row_base = tl.load(row_offsets_ptr + expert)
        count = tl.load(counts_ptr + expert)

        local_rows = local_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = local_rows < count
        rows = (row_base + tl.minimum(local_rows, count - 1)).to(tl.int64)  # clamped: always a valid row
        if GATHER:
            src_rows = tl.load(a_rows_ptr + rows)  # slot ids: token row = slot // ROWS_PER_SOURCE
            a_row_ok = src_rows >= 0
            a_row_off = (tl.maximum(src_rows, 0) // ROWS_PER_SOURCE).to(tl.int64) * stride_am
        else:
            a_row_off = rows * stride_am

        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < N
        w_n = (offs_n % N).to(tl.int64)  # wrapped, so weight loads need no N mask
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row_off[:, None] + offs_k[None, :] * stride_ak
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        if W13_CHUNK > 0:  # GEMM1 on W13Layout.CHUNKED (the wrapper passes 0 for GATE_THEN_UP and GEMM2)
            # W13Layout.CHUNKED: packed rows [2 * n0, 2 * n0 + 2 * BLOCK_N) hold the gate and up rows of
            # columns [n0, n0 + BLOCK_N): one [BLOCK_K, 2 * BLOCK_N] tile, one dot, split in the epilogue
            offs_p = n_tile * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
            w_p = (offs_p % (2 * N)).to(tl.int64)  # wrapped, like w_n
            wg_ptrs = w_base + w_p[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, 2 * BLOCK_N]
            acc = tl.full((BLOCK_M, 2 * BLOCK_N), 0.0, tl.float32)
            w_row0 = expert * w_rows_per_expert + n_tile * (2 * BLOCK_N)  # in the [E * rows, K] view
        else:
            wg_ptrs = w_base + w_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
            if GATED:
                wu_ptrs = wg_ptrs + up_offset  # rows I + n
                acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            w_row0 = expert * w_rows_per_expert + n_tile * BLOCK_N  # in the [E * rows, K] view of the weights
        a_row0 = row_base + local_tile * BLOCK_M  # first row of the tile (TMA: rows past the end read 0)
        for k0 in range(0, K, BLOCK_K):
            # A tile [BLOCK_M, BLOCK_K]
            if A_TMA:
                a = a_desc.load([a_row0, k0])
            elif EVEN_K:
                if GATHER:
                    a = tl.load(a_ptrs, mask=a_row_ok[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs)
            else:
                k_ok = (k0 + offs_k) < K
                if GATHER:
                    a = tl.load(a_ptrs, mask=a_row_ok[:, None] & k_ok[None, :], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            # weight tiles [BLOCK_K, BLOCK_N] (gate, and up for GEMM1), CHUNKED: one [BLOCK_K, 2 * BLOCK_N]
            if W_TMA:
                wg = tl.trans(w_desc.load([w_row0, k0]))
                if GATED and W13_CHUNK == 0:
                    wu = tl.trans(w_desc.load([w_row0 + N, k0]))
            elif EVEN_K:
                wg = tl.load(wg_ptrs)
                if GATED and W13_CHUNK == 0:
                    wu = tl.load(wu_ptrs)
            else:
                k_ok = (k0 + offs_k) < K
                wg = tl.load(wg_ptrs, mask=k_ok[:, None], other=0.0)
                if GATED and W13_CHUNK == 0:
                    wu = tl.load(wu_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, wg, acc, input_precision=DOT_PRECISION)
            if GATED and W13_CHUNK == 0:
                acc_up = tl.dot(a, wu, acc_up, input_precision=DOT_PRECISION)
                wu_ptrs += BLOCK_K * stride_wk
            a_ptrs += BLOCK_K * stride_ak
            wg_ptrs += BLOCK_K * stride_wk

        # Epilogue on fp32 accumulators.
        if W13_CHUNK > 0:
            # [BLOCK_M, 2 * BLOCK_N] columns (chunk, gate | up, column in chunk) -> gate and up [BLOCK_M, BLOCK_N]
            pairs = tl.permute(tl.reshape(acc, (BLOCK_M, BLOCK_N // W13_CHUNK, 2, W13_CHUNK)), (0, 1, 3, 2))
            acc, acc_up = tl.split(pairs)
            acc = tl.reshape(acc, (BLOCK_M, BLOCK_N))
            acc_up = tl.reshape(acc_up, (BLOCK_M, BLOCK_N))
        if HAS_BIAS:
            b_base = bias_ptr + expert.to(tl.int64) * stride_be
            acc += tl.load(b_base + w_n * stride_bn).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(b_base + (w_n + N) * stride_bn).to(tl.float32)[None, :]
        if GATED:
            result = _gated_activation(acc, acc_up, ACTIVATION)
        else:
            result = acc
        if HAS_ROW_SCALE:
            result = result * tl.load(row_scale_ptr + rows).to(tl.float32)[:, None]
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :].to(tl.int64) * stride_on
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])
        tile = next_tile


def _decorated(fn, namespace: dict, **jit_options):
    """triton.jit of a copy of `fn` whose globals are `namespace` (so its helpers are of the same mode)."""
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__module__, copy.__qualname__ = fn.__module__, fn.__qualname__
    copy.__annotations__ = dict(fn.__annotations__)  # tl.constexpr marks live here
    return triton.jit(copy, **jit_options)


def _decorated_helpers() -> dict:
    """The kernels' helpers (_add, _gated_activation) decorated in the current mode, with this module's globals."""
    namespace = dict(globals())
    helpers = {name: _decorated(globals()[name], namespace) for name in ("_add", "_gated_activation")}
    namespace.update(helpers)
    return helpers


@functools.lru_cache(maxsize=2)
def _jitted_kernel(interpret: bool):
    """The kernel and its combine helper decorated together: triton reads its mode (compiled or
    interpreted) when it decorates, so a process can use both (tests turn the interpreter on per scope)."""
    del interpret  # part of the cache key only
    namespace = dict(globals())
    namespace.update(_decorated_helpers())
    # num_programs varies with the batch; specializing on it (== 1, % 16) would recompile per bucket of T.
    return _decorated(_grouped_gemm_kernel, namespace, do_not_specialize=["num_programs"])


def _interpreting() -> bool:
    """Whether triton runs kernels in the interpreter now (read per call, never at import)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older versions read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os

    # parsed as Triton parses it, and as router.config.triton_interpreting does (the two layers do not import each other)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def _kernel():
    return _jitted_kernel(_interpreting())


@functools.lru_cache(maxsize=16)
def _device_limits(device_index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", _DEFAULT_SMEM_PER_BLOCK)
    return props.multi_processor_count, int(smem)


def _dependent_launch_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA sm_90+ and compiled mode (the interpreter has no grids to overlap)."""
    return device.type == "cuda" and _sm90_or_newer(
        device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9  # asked once per device, not per launch


def _limits_for(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return _device_limits(device.index if device.index is not None else torch.cuda.current_device())
    return 4, _DEFAULT_SMEM_PER_BLOCK  # interpreter on the CPU: a few programs, to exercise the tile loop


# ----------------------------------------------------------------------------------------------------------
# Host wrappers.


def _tile_counter(device: torch.device) -> torch.Tensor:
    """The DYNAMIC scheduler's next-tile counter, zeroed for every launch. Inside a CUDA graph the
    zeroing is the graph's own memset node, so no state outlives a replay: graphs may share a memory pool with any
    other graphs and replay in any order (a per-stream counter made inside a capture lay in pool memory that
    another graph reused as scratch, and its replays then skipped tiles; tests/test_graph_pools.py), and launches
    on concurrent streams never share a counter."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def _check_int32(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != device:
        raise ValueError(f"{name}: expected int32 {list(shape)} on {device}, got {t.dtype} {list(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def _tma_usable(a: torch.Tensor, w: torch.Tensor, gather: bool) -> bool:
    """Tensor descriptors need sm_90+, contiguous weights and 16-byte aligned rows (of a, unless gathered)."""
    if a.device.type == "cuda" and not _sm90_or_newer(
            a.device.index if a.device.index is not None else torch.cuda.current_device()):
        return False
    if not w.is_contiguous() or w.data_ptr() % 16:
        return False
    if not gather and (a.stride(1) != 1 or (a.stride(0) * a.element_size()) % 16 or a.data_ptr() % 16):
        return False
    return True


# default_config and can_implement are pure functions of frozen arguments that every launch asks (tens of us of Python
# per launch between them): memoized for the launches (routed_rows makes a problem per batch size: bounded caches).
@functools.lru_cache(maxsize=1024)
def _memoized_default_config(problem: GroupedGemmProblem) -> TritonGemmConfig:
    return default_config(problem)


@functools.lru_cache(maxsize=1024)
def _memoized_can_implement(config: TritonGemmConfig, problem: GroupedGemmProblem) -> tuple[bool, str]:
    return can_implement(config, problem)


def _launch(
    stage: GemmStage,
    a: torch.Tensor,
    w: torch.Tensor,
    row_offsets: torch.Tensor,
    counts: torch.Tensor,
    tile_offsets: torch.Tensor,
    activation: Activation | None,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    a_rows: torch.Tensor | None,
    out: torch.Tensor | None,
    config: TritonGemmConfig | None,
    tile_heights: tuple[int, ...],
    a_rows_per_source: int = 1,
    w13_layout: W13Layout = W13Layout.GATE_THEN_UP,
    align: int = 128,
) -> torch.Tensor:
    if not isinstance(w13_layout, W13Layout):
        raise TypeError(f"w13_layout: expected a W13Layout, got {w13_layout!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align: expected an int >= 1 (the dispatch's row alignment), got {align!r}")
    w_name = "w13" if stage is GemmStage.GEMM1 else "w2"
    b_name = "b13" if stage is GemmStage.GEMM1 else "b2"
    for name, t in (("a", a), (w_name, w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if a.dim() != 2:
        raise ValueError(f"a: expected 2-D [rows, K], got shape {list(a.shape)}")
    if w.dim() != 3:
        raise ValueError(f"{w_name}: expected 3-D [E, N, K], got shape {list(w.shape)}")
    if a.dtype not in _SUPPORTED_DTYPES or w.dtype != a.dtype:
        raise ValueError(f"a, {w_name}: expected one dtype in {_SUPPORTED_DTYPES}, got {a.dtype} and {w.dtype}")
    device = a.device
    if w.device != device:
        raise ValueError(f"{w_name}: expected device {device}, got {w.device}")
    for name, t in ((b_name, bias), ("row_scale", row_scale), ("a_rows", a_rows), ("out", out)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    num_experts, w_rows, k_dim = w.shape
    if min(w.shape) < 1:
        raise ValueError(f"{w_name}: expected [E, N, K] with every size >= 1, got shape {list(w.shape)}")
    if a.shape[1] != k_dim:
        raise ValueError(f"a: expected {k_dim} columns (K of {w_name}), got {a.shape[1]}")
    if stage is GemmStage.GEMM1:
        if w_rows % 2:
            raise ValueError(f"w13: expected an even row count 2I, got {w_rows}")
        n_dim = w_rows // 2
    else:
        n_dim = w_rows
    tile_heights = tuple(tile_heights)
    if not tile_heights or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in tile_heights):
        raise ValueError(f"tile_heights: expected the dispatch's tile heights (ints >= 1), got {tile_heights!r}")
    _check_int32("row_offsets", row_offsets, (num_experts + 1,), device)
    _check_int32("counts", counts, (num_experts,), device)
    _check_int32("tile_offsets", tile_offsets, (len(tile_heights), num_experts + 1), device)
    if a_rows is not None:
        if a_rows.dim() != 1:
            raise ValueError(f"a_rows: expected 1-D [max_rows], got shape {list(a_rows.shape)}")
        _check_int32("a_rows", a_rows, (a_rows.shape[0],), device)
        max_rows = a_rows.shape[0]
        if isinstance(a_rows_per_source, bool) or not isinstance(a_rows_per_source, int) or not (
                1 <= a_rows_per_source <= 64):
            raise ValueError(f"a_rows_per_source: expected an int in 1..64, got {a_rows_per_source!r}")
    else:
        max_rows = a.shape[0]
    if bias is not None:
        if bias.shape != (num_experts, w_rows) or bias.device != device or not bias.is_floating_point():
            raise ValueError(f"{b_name}: expected float [{num_experts}, {w_rows}] on {device}, got "
                             f"{bias.dtype} {list(bias.shape)} on {bias.device}")
    if row_scale is not None:
        if row_scale.shape != (max_rows,) or row_scale.device != device or not row_scale.is_floating_point():
            raise ValueError(f"row_scale: expected float [{max_rows}] on {device}, got "
                             f"{row_scale.dtype} {list(row_scale.shape)} on {row_scale.device}")
        if not row_scale.is_contiguous():
            raise ValueError("row_scale: expected a contiguous tensor (the kernel reads it with stride 1)")
    if out is None:
        out = torch.empty(max_rows, n_dim, dtype=a.dtype, device=device)
    else:
        if out.shape != (max_rows, n_dim) or out.dtype != a.dtype or out.device != device:
            raise ValueError(f"out: expected {a.dtype} [{max_rows}, {n_dim}] on {device}, got "
                             f"{out.dtype} {list(out.shape)} on {out.device}")
        require_distinct_rows(out)
        require_own_memory(out, a=a, **{w_name: w, "row_offsets": row_offsets, "counts": counts,
                                        "tile_offsets": tile_offsets, b_name: bias, "row_scale": row_scale,
                                        "a_rows": a_rows})

    if config is not None and not isinstance(config, TritonGemmConfig):
        raise TypeError(f"config: expected a TritonGemmConfig or None, got {type(config).__name__}")
    num_sms, smem = _limits_for(device)
    config_given = config
    if config is None:
        # routed_rows estimate for the bucket: max_rows minus the worst-case padding (static facts only).
        problem = GroupedGemmProblem(stage, num_experts, n_dim, k_dim, max(0, max_rows - num_experts * (align - 1)),
                                     a.dtype, tile_heights, num_sms, smem, w13_layout)
        config = _memoized_default_config(problem)
    else:
        problem = GroupedGemmProblem(stage, num_experts, n_dim, k_dim, max_rows, a.dtype, tile_heights, num_sms,
                                     smem, w13_layout)
    if config.tile_load is TileLoad.TMA and config_given is None and not _tma_usable(a, w, a_rows is not None):
        config = dataclasses.replace(config, tile_load=TileLoad.POINTER)  # the heuristic falls back quietly
    if config.tile_load is TileLoad.TMA and a.device.type == "cuda" and not _sm90_or_newer(
            a.device.index if a.device.index is not None else torch.cuda.current_device()):
        raise ValueError("config: tile_load TMA needs an sm_90+ device (tensor descriptors); use TileLoad.POINTER")
    ok, reason = (_memoized_can_implement(config, problem) if isinstance(config, TritonGemmConfig)
                  else can_implement(config, problem))
    if not ok:
        raise ValueError(_named_reason(reason) or f"config: {reason}")
    if max_rows == 0:
        return out

    h_index = tile_heights.index(config.block_m)
    n_tiles = -(-n_dim // config.block_n)
    tile_bound = (-(-max_rows // config.block_m) + num_experts) * n_tiles
    num_programs = max(1, min(num_sms * config.programs_per_sm, tile_bound))
    a_desc = w_desc = None
    if config.tile_load is TileLoad.TMA:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if not w.is_contiguous() or w.data_ptr() % 16:
            raise ValueError(f"{w_name}: tile_load TMA needs a contiguous, 16-byte aligned tensor")
        w_box_rows = 2 * config.block_n if problem.chunked else config.block_n
        w_desc = TensorDescriptor.from_tensor(w.view(num_experts * w_rows, k_dim), [w_box_rows, config.block_k])
        if a_rows is None:
            if a.stride(1) != 1 or (a.stride(0) * a.element_size()) % 16 or a.data_ptr() % 16:
                raise ValueError("a: tile_load TMA needs unit column stride and 16-byte aligned rows")
            a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
    dummy = out  # stands in for absent optional pointers (never read: their constexpr flag is off)
    dummy_counter = row_offsets  # (int32; never touched unless DYNAMIC)
    dependent = _dependent_launch_supported(device)
    # Early release only from decode-sized launches: a dependent grid made resident early waits on the SMs
    # beside a long GEMM (the full layer lost 5-10% at T >= 8192 on an H200 when every launch released early).
    dependent_code = 0 if not dependent else (2 if config.block_m < 64 else 1)
    _kernel()[(num_programs,)](
        a, a_rows if a_rows is not None else dummy, w,
        bias if bias is not None else dummy, row_scale if row_scale is not None else dummy, out,
        a_desc, w_desc,
        row_offsets, counts, tile_offsets[h_index],
        _tile_counter(device) if config.scheduler is TileScheduler.DYNAMIC else dummy_counter,
        num_experts, n_dim, k_dim,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2), n_dim * w.stride(1), w_rows,
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        out.stride(0), out.stride(1),
        num_programs,
        GATED=stage is GemmStage.GEMM1,
        ACTIVATION=_ACTIVATION_CODE[activation] if activation is not None else 0,
        GATHER=a_rows is not None,
        ROWS_PER_SOURCE=a_rows_per_source if a_rows is not None else 1,
        HAS_BIAS=bias is not None,
        HAS_ROW_SCALE=row_scale is not None,
        EVEN_K=k_dim % config.block_k == 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_E=max(16, 1 << (num_experts - 1).bit_length()),
        A_TMA=a_desc is not None, W_TMA=w_desc is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        DEPENDENT_LAUNCH=dependent_code, launch_pdl=dependent,
        DYNAMIC=config.scheduler is TileScheduler.DYNAMIC,
        W13_CHUNK=GATE_UP_CHUNK if problem.chunked else 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def triton_grouped_gemm1(
    a: torch.Tensor,
    w13: torch.Tensor,
    row_offsets: torch.Tensor,
    counts: torch.Tensor,
    tile_offsets: torch.Tensor,
    activation: Activation | str = Activation.SWIGLU,
    b13: torch.Tensor | None = None,
    a_rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: TritonGemmConfig | None = None,
    tile_heights: tuple[int, ...] = DEFAULT_TILE_HEIGHTS,
    a_rows_per_source: int = 1,
    w13_layout: W13Layout = W13Layout.GATE_THEN_UP,
    align: int = 128,
) -> torch.Tensor:
    """GEMM1 with the fused gated activation -> [max_rows, I] in a.dtype (valid rows written).

    a: [max_rows, H] in the padded expert layout, or with `a_rows` ([max_rows] int32, -1 = zeros) the
    compact token matrix [T, H]: row r reads a[a_rows[r] // a_rows_per_source] (pass the dispatch's
    sorted_slots with a_rows_per_source = top_k: no index tensor to build). w13: [E, 2I, H] in `w13_layout`
    (GATE_THEN_UP: gate rows, then up rows; CHUNKED: pack_gate_up_rows of that, the CuTe kernels' layout).
    b13 [E, 2I] is always in the public gate-then-up order. align: the dispatch's row alignment (Dispatch.align),
    for the default config's estimate of the routed rows.

    row_offsets, counts, tile_offsets and a_rows live on the device and are not read here: pass them and
    `tile_heights` from one Dispatch (tile_heights = Dispatch.tile_heights: the kernel reads the row of tile_offsets
    for its block_m, and another dispatch's heights give other tile counts), and a_rows_per_source = the top_k the
    dispatch ran with (every a_rows entry < T * a_rows_per_source).
    """
    return _launch(GemmStage.GEMM1, a, w13, row_offsets, counts, tile_offsets, Activation.parse(activation),
                   b13, None, a_rows, out, config, tile_heights, a_rows_per_source, w13_layout, align)


def triton_grouped_gemm2(
    a: torch.Tensor,
    w2: torch.Tensor,
    row_offsets: torch.Tensor,
    counts: torch.Tensor,
    tile_offsets: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: TritonGemmConfig | None = None,
    tile_heights: tuple[int, ...] = DEFAULT_TILE_HEIGHTS,
    align: int = 128,
) -> torch.Tensor:
    """GEMM2 -> [max_rows, H] in a.dtype: y[r] = (a[r] @ w2[e].T + b2[e]) * row_scale[r] (valid rows written).

    a: [max_rows, I] in the padded expert layout; w2: [E, H, I]; row_scale: [max_rows] float or None. align, the
    dispatch metadata and tile_heights: as in triton_grouped_gemm1.
    """
    return _launch(GemmStage.GEMM2, a, w2, row_offsets, counts, tile_offsets, None, b2, row_scale, None, out,
                   config, tile_heights, align=align)
