"""Blackwell (sm_100a) persistent grouped GEMM over experts in CuTe DSL: 2-CTA pairs, TMEM, CLC.

Problem (docs/design.md): for every local expert e, rows [row_offsets[e], row_offsets[e] + counts[e]) of
A [max_rows, K] (K-major, padded expert order) times B[e] [N, K] (K-major), fp32 accumulation, fused
epilogue, output C [max_rows, N_out] in A's dtype. GEMM1 (gated, N = 2I on the packed w13 of
sm90_grouped_gemm.prepack_w13: 8 gate rows then the matching 8 up rows, repeated) writes act(gate, up) with
N_out = I; GEMM2 writes (acc + b2[e]) * row_scale[r]. One launch covers all experts; which tiles exist is
decided on the device from row_offsets / counts (no host sync, CUDA-graph capturable).

Work units (budget.WorkUnit):
- PAIR: a (2,1,1) cluster runs tcgen05.mma.cta_group::2 on a 256-row tile: CTA v holds rows
  [128v, 128v+128) of A and columns [BN/2 v, BN/2 (v+1)) of B in its SMEM (32 KiB per CTA per 64-deep
  stage at BN=256 instead of 48), and 128 rows x BN fp32 of the accumulator in its TMEM.
- SINGLE: one CTA, tcgen05.mma.cta_group::1 on a 128-row tile (the fallback for experts with few rows).
PTX forbids cta_group::1 and ::2 in one kernel, so a PAIR kernel never runs single tiles: with a
pair_threshold the host launches the PAIR kernel for experts with counts >= threshold and the SINGLE
kernel for the others (each kernel skips the other's experts, read on the device).

Tiles: candidate tile c starts at row 128c (row_offsets are multiples of 128). It is live when its row is
the start of a work-unit tile of its expert e ((row - row_offsets[e]) % tile_m == 0), below
row_offsets[e] + counts[e], and counts[e] is in the kernel's [rows_lo, rows_hi) range. A PAIR tile may
run past its expert's padded rows into the next expert's: those A rows are read but the CTA that owns
them (a whole 128-row half) does not store. N tiles: N / BN (N % BN == 0).

Warp roles (224 threads per CTA):
- warps 0-3 epilogue: tcgen05.ld of their 32 TMEM lanes (one row each), bias, gated activation or row
  scale in fp32, convert, write the row into an SMEM sub-tile, one thread TMA-stores each sub-tile.
- warp 4 MMA: in the pair's leader CTA one elected thread issues tcgen05.mma (cta_group::2 for a PAIR).
- warp 5 TMA: loads A and B K-stages (2-CTA partitioned loads for a PAIR, arriving on the leader's
  barrier).
- warp 6 scheduler (first CTA of the cluster): clusterlaunchcontrol.try_cancel for the next cluster id
  (clc_request / clc_work, the family's own); the response is multicast to both CTAs, so the pair always
  works on one consistent tile.
Pipelines:
- mainloop (PipelineTmaUmma, `stages` deep): full = A and B bytes of both CTAs landed; empty = the
  MMAs that read the stage completed (tcgen05.commit).
- accumulator (PipelineUmmaAsync, `accumulator_slots` deep, 2 x BN <= 512 TMEM columns): full = the
  tile's last MMA completed; empty = every epilogue warp of both CTAs finished its tcgen05.ld.
- scheduler (PipelineClcFetchAsync, 1 deep): full = the CLC response (16 B) arrived; empty = every warp
  of the cluster read it.
- epilogue store (PipelineTmaStore, epi_buffers deep): an SMEM sub-tile is rewritten only after its TMA
  store read it.
TMEM: allocated by epilogue warp 0 (tcgen05.alloc.cta_group::2 for a PAIR, both CTAs), released after
the last tile (relinquish + dealloc).

Limits: bf16/fp16 in, fp32 accumulation, K % tile_k == 0, K % 8 == 0, N % tile_n == 0, gated N tiles a
multiple of 16 (the gate/up chunks) and tile_n / 2 % epi_n == 0, row_offsets multiples of 128.

Nothing here imports cutlass or tvm_ffi at import time; the kernel class is built on first use.
"""

import dataclasses
import functools
import math
import re
import shutil

import torch

from .budget import (
    ARCH_LIMITS,
    Arch,
    WorkUnit,
    barrier_bytes,
    epilogue_smem_bytes,
    input_bytes_per_stage,
    max_stages,
    tmem_allocation_columns,
    tmem_columns,
)
from .epilogue import (
    GATE_UP_CHUNK,
    SWIGLU_OAI_ALPHA,
    SWIGLU_OAI_LIMIT,
    Activation,
    GemmStage,
    epilogue_name,
    parse_epilogue_name,
)
# one host-side epilogue operand layout for both CuTe families
from .l2_sides import device_key
from .sm90_grouped_gemm import KernelBias, check_out, epilogue_operands, kernel_bias  # noqa: F401 (kernel_bias: the layer)

__all__ = [
    "Sm100Problem",
    "Sm100GemmConfig",
    "ResourceUse",
    "CompileReport",
    "can_implement",
    "resource_use",
    "default_config",
    "kernel_key",
    "compile_kernel",
    "compile_for_preset",
    "prepare_device",
    "compile_requests",
    "kernel_from_key",
    "kernel_request",
    "ptx_report",
    "tile_plan",
    "sm100_grouped_gemm1",
    "sm100_grouped_gemm2",
]

FAMILY = "sm100_grouped_gemm"
ROW_GRANULE = 128  # candidate tiles start every 128 rows: the padded layout's smallest alignment
ROWS_PER_CTA = 128  # TMEM lanes: one CTA holds 128 accumulator rows (PAIR and SINGLE)
SMEM_ALIGN = 1024
SCHEDULER_SMEM_BYTES = 64  # CLC response + TMEM base address next to the barriers
EXTRA_BARRIERS = 3  # CLC full/empty + TMEM dealloc handshake
NO_UPPER_BOUND = 2**31 - 1
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclasses.dataclass(frozen=True)
class Sm100Problem:
    """Static facts of one grouped GEMM (never M: the row count is symbolic in every kernel)."""

    stage: GemmStage
    n: int  # accumulator columns (GEMM1: 2I)
    k: int
    num_experts: int
    dtype: str = "bfloat16"
    activation: Activation | None = None  # GEMM1 only
    has_bias: bool = False
    has_row_scale: bool = False  # GEMM2 only

    def __post_init__(self):
        if not isinstance(self.stage, GemmStage):
            raise TypeError(f"stage: expected a GemmStage, got {self.stage!r}")
        for name in ("n", "k", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES.values())}, got {self.dtype!r}")
        if self.stage is GemmStage.GEMM1:
            object.__setattr__(self, "activation", Activation.parse(self.activation or Activation.SWIGLU))
            if self.has_row_scale:
                raise ValueError("has_row_scale: GEMM1 takes no row scale (apply router weights in GEMM2)")
        elif self.activation is not None:
            raise ValueError(f"activation: GEMM2 has no activation, got {self.activation!r}")

    @property
    def out_columns(self) -> int:
        return self.n // 2 if self.stage is GemmStage.GEMM1 else self.n

    @property
    def epilogue_name(self) -> str:
        return epilogue_name(self.stage, self.activation, self.has_row_scale, self.has_bias)


@dataclasses.dataclass(frozen=True)
class Sm100GemmConfig:
    """Static choices of the kernel. tile_n / tile_k: accumulator tile of the whole work unit.

    stages 0 means as many as fit in SMEM. pair_threshold (PAIR only): experts with fewer rows run in a
    second, SINGLE launch (0: every expert runs pairs). epi_n: output columns per epilogue sub-tile.
    """

    unit: WorkUnit = WorkUnit.PAIR
    tile_n: int = 256
    tile_k: int = 64
    stages: int = 0
    accumulator_slots: int = 2
    pair_threshold: int = 0
    epi_n: int = 32
    epi_buffers: int = 2

    def __post_init__(self):
        if not isinstance(self.unit, WorkUnit):
            raise TypeError(f"unit: expected a WorkUnit, got {self.unit!r}")
        for name in ("tile_n", "tile_k", "accumulator_slots", "epi_n", "epi_buffers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        for name in ("stages", "pair_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")

    @property
    def tile_m(self) -> int:
        """Rows of one work-unit tile (PAIR: both CTAs)."""
        return 2 * ROWS_PER_CTA if self.unit is WorkUnit.PAIR else ROWS_PER_CTA

    @property
    def tile(self) -> tuple[int, int, int]:
        return (self.tile_m, self.tile_n, self.tile_k)

    @property
    def cluster(self) -> tuple[int, int, int]:
        return (2, 1, 1) if self.unit is WorkUnit.PAIR else (1, 1, 1)

    def single_fallback(self) -> "Sm100GemmConfig":
        """The SINGLE config that runs the experts under pair_threshold (same tile_n, tile_k, epilogue)."""
        return dataclasses.replace(self, unit=WorkUnit.SINGLE, stages=0, pair_threshold=0)


@dataclasses.dataclass(frozen=True)
class ResourceUse:
    """What one CTA of the kernel uses (the planner reads the same numbers from budget.py)."""

    stages: int
    a_stage_bytes: int
    b_stage_bytes: int
    bookkeeping_bytes: int
    epilogue_bytes: int
    smem_bytes: int
    tmem_columns: int
    tmem_alloc_columns: int


def _elem_bytes(problem: Sm100Problem) -> int:
    return 2  # bf16 / fp16 only


def resource_use(config: Sm100GemmConfig, problem: Sm100Problem) -> ResourceUse:
    """SMEM and TMEM of one CTA, in the order the kernel allocates them (1024-B aligned pieces)."""
    e = _elem_bytes(problem)
    stage = input_bytes_per_stage(config.tile_m, config.tile_n, config.tile_k, e, config.unit, Arch.SM100)
    a_stage = ROWS_PER_CTA * config.tile_k * e
    epi = epilogue_smem_bytes(ROWS_PER_CTA, config.epi_n, e, config.epi_buffers)
    stages = config.stages
    if stages == 0:  # as many as fit next to the epilogue buffers and the (1 KiB-aligned) barriers
        stages = max_stages(stage, _bookkeeping(2, config) + epi, Arch.SM100, barrier_bytes_per_stage=0)
        while stages > 1 and _bookkeeping(stages, config) + epi + stages * stage > ARCH_LIMITS[Arch.SM100].smem_per_cta:
            stages -= 1
    book = _bookkeeping(stages, config)
    columns = tmem_columns(config.tile_n, config.accumulator_slots)
    return ResourceUse(
        stages=stages,
        a_stage_bytes=a_stage,
        b_stage_bytes=stage - a_stage,
        bookkeeping_bytes=book,
        epilogue_bytes=epi,
        smem_bytes=book + stages * stage + epi,
        tmem_columns=columns,
        tmem_alloc_columns=tmem_allocation_columns(columns),
    )


def _bookkeeping(stages: int, config: Sm100GemmConfig) -> int:
    raw = barrier_bytes(stages, config.accumulator_slots, EXTRA_BARRIERS) + SCHEDULER_SMEM_BYTES
    return math.ceil(raw / SMEM_ALIGN) * SMEM_ALIGN


def can_implement(config: Sm100GemmConfig, problem: Sm100Problem) -> tuple[bool, str]:
    """(True, "") when the kernel can run `problem` with `config`, else (False, reason)."""
    if not isinstance(config, Sm100GemmConfig):
        return False, f"expected an Sm100GemmConfig, got {type(config).__name__}"
    if not isinstance(problem, Sm100Problem):
        return False, f"problem: expected Sm100Problem, got {type(problem).__name__}"
    c, p = config, problem
    if c.tile_n % 16 or not 32 <= c.tile_n <= 256:
        return False, f"tile_n {c.tile_n}: tcgen05.mma takes N in [32, 256], a multiple of 16"
    if c.unit is WorkUnit.PAIR and c.tile_n % 32:
        return False, f"tile_n {c.tile_n}: a PAIR splits B over two CTAs, needs a multiple of 32"
    if c.tile_k not in (64, 128):
        return False, f"tile_k {c.tile_k}: expected 64 or 128 (128-byte swizzled K-major stages)"
    if p.k % c.tile_k:
        return False, f"K={p.k}: must be a multiple of tile_k {c.tile_k}"
    if p.n % c.tile_n:
        return False, f"N={p.n}: must be a multiple of tile_n {c.tile_n}"
    out_tile = c.tile_n // 2 if p.stage is GemmStage.GEMM1 else c.tile_n
    if p.stage is GemmStage.GEMM1 and c.tile_n % (2 * GATE_UP_CHUNK):
        return False, f"gated N tile {c.tile_n}: must hold whole gate/up chunks of {2 * GATE_UP_CHUNK} columns"
    if out_tile % c.epi_n or c.epi_n % 8:
        return False, f"epi_n {c.epi_n}: must divide the output tile ({out_tile} columns) and be a multiple of 8"
    if p.stage is GemmStage.GEMM1 and (2 * c.epi_n) % (2 * GATE_UP_CHUNK):
        return False, f"epi_n {c.epi_n}: a gated sub-tile needs whole gate/up chunks"
    if c.pair_threshold and c.unit is not WorkUnit.PAIR:
        return False, "pair_threshold: only a PAIR config has a single-CTA fallback"
    use = resource_use(c, p)
    if use.stages < 2:
        return False, f"stages: {use.stages} fit in SMEM, need >= 2"
    if use.smem_bytes > ARCH_LIMITS[Arch.SM100].smem_per_cta:
        return False, f"SMEM {use.smem_bytes} B > {ARCH_LIMITS[Arch.SM100].smem_per_cta} B per CTA"
    if use.tmem_alloc_columns > ARCH_LIMITS[Arch.SM100].tmem_columns:
        return False, f"TMEM {use.tmem_columns} columns ({c.accumulator_slots} slots x {c.tile_n}) > 512"
    ctas_per_sm = SMEM_PER_SM // (use.smem_bytes + SMEM_RESERVED_PER_CTA)
    if ctas_per_sm > 1 and ctas_per_sm * use.tmem_alloc_columns > ARCH_LIMITS[Arch.SM100].tmem_columns:
        # the persistent CTAs that fit an SM by SMEM would together allocate more than its TMEM: a later one waits in
        # its allocation until an earlier one ends (or worse); keep those that share an SM within its 512 columns
        return False, (f"stages: {use.stages} stages leave {use.smem_bytes} B of SMEM, so {ctas_per_sm} CTAs would "
                       f"share an SM, each allocating {use.tmem_alloc_columns} of its 512 TMEM columns: use more "
                       "stages (0: as many as fit)")
    if c.accumulator_slots > 2:
        return False, f"accumulator_slots {c.accumulator_slots}: 1 or 2"
    if c.unit is WorkUnit.PAIR and c.pair_threshold > 0:  # the experts below the threshold run on the SINGLE twin
        ok, why = can_implement(c.single_fallback(), p)
        if not ok:
            return False, f"pair_threshold {c.pair_threshold}: the SINGLE launch of the smaller experts cannot run: {why}"
    return True, ""


_TILE_NS = (256, 224, 192, 160, 128, 96, 64)
_EPI_NS = (32, 16, 8)  # epilogue sub-tile widths, widest first (GEMM1's 48 / 80 / 112-column output tiles take 16)
SMEM_PER_SM = 228 * 1024  # B200: shared memory of one SM, all resident CTAs together
SMEM_RESERVED_PER_CTA = 1024  # what the driver keeps of it per resident CTA


def default_config(problem: Sm100Problem, unit: WorkUnit = WorkUnit.PAIR, pair_threshold: int = 0) -> Sm100GemmConfig:
    """The widest N tile that divides N and fits, with the widest epilogue sub-tile that divides its output (analytic
    default; moe2cta.planner may choose otherwise). ValueError with the last reason where none fits."""
    why = ""
    for tile_n in _TILE_NS:
        for epi_n in _EPI_NS:
            config = Sm100GemmConfig(unit=unit, tile_n=tile_n, epi_n=epi_n,
                                     pair_threshold=pair_threshold if unit is WorkUnit.PAIR else 0)
            ok, why = can_implement(config, problem)
            if ok:
                return config
    raise ValueError(f"problem: no sm_100 tile fits N={problem.n}, K={problem.k} (the narrowest tried: {why})")


def kernel_key(config: Sm100GemmConfig, problem: Sm100Problem):
    from .cute_runtime import KernelKey

    use = resource_use(config, problem)
    return KernelKey(
        family=FAMILY,
        arch=Arch.SM100.value,
        dtype=problem.dtype,
        n=problem.n,
        k=problem.k,
        num_experts=problem.num_experts,
        tile=config.tile,
        cluster=config.cluster,
        epilogue=problem.epilogue_name,
        extra=(
            ("stages", use.stages),
            ("acc", config.accumulator_slots),
            ("epi", config.epi_n, config.epi_buffers),
        ),
    )


def tile_plan(row_offsets, counts, config: Sm100GemmConfig, max_rows: int, rows_lo: int = 0,
              rows_hi: int = NO_UPPER_BOUND) -> list[tuple[int, int, tuple[bool, ...]]]:
    """Python twin of the kernel's tile decode: [(expert, first row, does CTA v store)] of the live tiles.

    Candidate c starts at row 128c; see the module docstring. Used by the tests to check that every valid
    row is stored exactly once and no other expert's rows are written, without a GPU.
    """
    offsets, sizes = [int(x) for x in row_offsets], [int(x) for x in counts]
    num_experts = len(sizes)
    ctas = 2 if config.unit is WorkUnit.PAIR else 1
    plan = []
    for candidate in range((max_rows + ROW_GRANULE - 1) // ROW_GRANULE):
        row0 = candidate * ROW_GRANULE
        lo, hi = 0, num_experts + 1
        for _ in range(max(1, math.ceil(math.log2(num_experts + 1)))):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if offsets[mid] <= row0 else (lo, mid)
        expert = min(lo, num_experts - 1)
        start, count = offsets[expert], sizes[expert]
        live = lo < num_experts and row0 < start + count and (row0 - start) % config.tile_m == 0
        if live and rows_lo <= count < rows_hi:
            stores = tuple(row0 + v * ROWS_PER_CTA < start + count for v in range(ctas))
            plan.append((expert, row0, stores))
    return plan


# ----------------------------------------------------------------------------------------------------------
# The kernel (built on first use: needs nvidia-cutlass-dsl)
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.blackwell_helpers as sm100_utils
    import cutlass.memory
    import cutlass.tensor_utils
    from cutlass.cute.nvgpu import cpasync, tcgen05
    from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
    from cutlass.utils.gemm.sm100 import transform_partitioned_tensor_layout
    from cutlass.utils.static_persistent_tile_scheduler import WorkTileInfo

    Int32, Float32 = cutlass.Int32, cutlass.Float32

    class Sm100GroupedGemmKernel:
        """Static choices in __init__; __call__ builds TMA atoms, scheduler and grid; kernel() runs it."""

        def __init__(self, config: Sm100GemmConfig, problem: Sm100Problem):
            self.config, self.problem = config, problem
            use = resource_use(config, problem)
            self.stages = use.stages
            self.resources = use
            self.pair = config.unit is WorkUnit.PAIR
            self.cta_group = tcgen05.CtaGroup.TWO if self.pair else tcgen05.CtaGroup.ONE
            self.cluster_mn = (2, 1) if self.pair else (1, 1)
            self.mma_tiler = (config.tile_m, config.tile_n, config.tile_k)
            self.cta_tile = (ROWS_PER_CTA, config.tile_n, config.tile_k)
            self.gated = problem.stage is GemmStage.GEMM1
            self.activation = problem.activation.value if self.gated else "none"
            self.has_bias = problem.has_bias
            self.has_row_scale = problem.has_row_scale
            self.num_experts = problem.num_experts
            self.n, self.k = problem.n, problem.k
            self.out_n = problem.out_columns
            self.out_tile_n = config.tile_n // 2 if self.gated else config.tile_n
            self.epi_n = config.epi_n
            self.acc_sub_n = 2 * config.epi_n if self.gated else config.epi_n
            self.num_subtiles = self.out_tile_n // self.epi_n
            self.slots = config.accumulator_slots
            self.epi_buffers = config.epi_buffers
            self.search_steps = max(1, math.ceil(math.log2(problem.num_experts + 1)))
            self.acc_dtype = Float32
            self.epilogue_warps = (0, 1, 2, 3)
            self.mma_warp, self.tma_warp, self.sched_warp = 4, 5, 6
            self.threads = 32 * 7
            self.epi_bar_id, self.tmem_alloc_bar_id, self.tmem_dealloc_bar_id = 1, 2, 3

        @cute.jit
        def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, row_offsets: cute.Tensor,
                     counts: cute.Tensor, bias: cute.Tensor, row_scale: cute.Tensor, rows_lo: Int32,
                     rows_hi: Int32, stream):
            self.ab_dtype = a.element_type
            self.c_dtype = c.element_type
            rows = a.shape[0]
            # A (M, K, 1), B (N, K, E), C (M, N_out): K-major views for TMA
            mA = cute.make_tensor(a.iterator, cute.make_layout((rows, self.k, 1), stride=(self.k, 1, 0)))
            mB = cute.make_tensor(b.iterator, cute.make_layout((self.n, self.k, self.num_experts),
                                                               stride=(self.k, 1, self.n * self.k)))
            mC = cute.make_tensor(c.iterator, cute.make_layout((rows, self.out_n), stride=(self.out_n, 1)))
            tiled_mma = sm100_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.ab_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                self.acc_dtype, self.cta_group, self.mma_tiler[:2])
            self.cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((*self.cluster_mn, 1)),
                                                         (tiled_mma.thr_id.shape,))
            a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, self.stages)
            b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, self.stages)
            self.epi_tile = (ROWS_PER_CTA, self.epi_n)
            c_smem = sm100_utils.make_smem_layout_epi(self.c_dtype, cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, self.epi_tile,
                                                      self.epi_buffers)
            a_one = cute.slice_(a_smem, (None, None, None, 0))
            b_one = cute.slice_(b_smem, (None, None, None, 0))
            tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
                sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_mn, tiled_mma.thr_id), mA, a_one,
                self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape)
            tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
                sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_mn, tiled_mma.thr_id), mB, b_one,
                self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape)
            tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mC, cute.select(c_smem, mode=[0, 1]), self.epi_tile)
            cta_pair = cute.size(tiled_mma.thr_id.shape)
            self.tma_bytes = (cute.size_in_bytes(self.ab_dtype, a_one) + cute.size_in_bytes(self.ab_dtype, b_one)) * cta_pair
            # candidate tiles: one per 128 rows (x2 CTAs for a pair), N / BN columns of tiles
            m_ctas = (rows + ROW_GRANULE - 1) // ROW_GRANULE * cta_pair
            grid = (m_ctas, self.n // self.config.tile_n, 1)  # m_ctas is a multiple of the cluster's M (cta_pair)
            self.kernel(tiled_mma, tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c, row_offsets, counts,
                        bias, row_scale, rows_lo, rows_hi, rows, self.cluster_layout_vmnk, a_smem, b_smem,
                        c_smem).launch(
                grid=grid, block=[self.threads, 1, 1], cluster=(*self.cluster_mn, 1), stream=stream)

        # ---- scheduling: cluster launch control (CLC) over a grid of one cluster per candidate tile, along M.
        # A cluster starts on the tile of its own block index. The scheduler warp of its first CTA then asks
        # clusterlaunchcontrol.try_cancel for a cluster that was launched but has not started; the hardware answers
        # with that cluster's first CTA coordinates in a 16-byte SMEM response (multicast to every CTA of the
        # cluster, arriving on each CTA's barrier), or with "none left". A CTA's tile is those coordinates plus its
        # rank along M, so the two CTAs of a pair always hold the same work unit. (Ours: the DSL's
        # ClcDynamicPersistentTileScheduler is deprecated, to be removed from the wheel; same instructions.)
        def clc_initial_work(self):
            bidx, bidy, bidz = cute.arch.block_idx()
            return WorkTileInfo((bidx, bidy, bidz), cutlass.Boolean(True))

        def clc_request(self, mbarrier_ptr, response_ptr):
            """One elected thread of the calling warp asks for the next cluster's tile, answered on mbarrier_ptr."""
            with cute.arch.elect_one():
                cute.arch.issue_clc_query(mbarrier_ptr, response_ptr)

        def clc_work(self, response_ptr, cta_rank_m: Int32):
            """The work in the response (read after the response barrier's wait). The fence orders this generic-proxy
            read before the next query's async-proxy write of the response."""
            m_idx, n_idx, l_idx, valid = cute.arch.clc_response(response_ptr)
            cute.arch.fence_proxy("async.shared", space="cta")
            return WorkTileInfo((m_idx + cta_rank_m, n_idx, l_idx), valid)

        @cute.jit
        def locate(self, row_offsets: cute.Tensor, counts: cute.Tensor, candidate: Int32, rows_lo: Int32,
                   rows_hi: Int32):
            """Candidate tile -> (live, expert, first row, end of the expert's valid rows)."""
            row0 = candidate * ROW_GRANULE
            lo = Int32(0)
            hi = Int32(self.num_experts + 1)
            for _ in cutlass.range_constexpr(self.search_steps):  # largest e with row_offsets[e] <= row0
                mid = (lo + hi) // 2
                if row_offsets[mid] <= row0:
                    lo = mid
                else:
                    hi = mid
            expert = cutlass.min(lo, Int32(self.num_experts - 1))
            start = row_offsets[expert]
            count = counts[expert]
            valid_end = start + count
            live = (lo < self.num_experts) & (row0 < valid_end) & ((row0 - start) % self.config.tile_m == 0)
            live = live & (count >= rows_lo) & (count < rows_hi)
            return live, expert, row0, valid_end

        @cute.kernel
        def kernel(self, tiled_mma: cute.TiledMma, tma_atom_a: cute.CopyAtom, mA: cute.Tensor,
                   tma_atom_b: cute.CopyAtom, mB: cute.Tensor, tma_atom_c: cute.CopyAtom, mC: cute.Tensor,
                   row_offsets: cute.Tensor, counts: cute.Tensor, bias: cute.Tensor, row_scale: cute.Tensor,
                   rows_lo: Int32, rows_hi: Int32, rows: Int32, cluster_layout_vmnk: cute.Layout,
                   a_smem: cute.ComposedLayout,
                   b_smem: cute.ComposedLayout, c_smem: cute.ComposedLayout):
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            if warp == self.tma_warp:
                cpasync.prefetch_descriptor(tma_atom_a)
                cpasync.prefetch_descriptor(tma_atom_b)
                cpasync.prefetch_descriptor(tma_atom_c)
            cta_pair = cute.size(tiled_mma.thr_id.shape)
            bidx, _, _ = cute.arch.block_idx()
            v = bidx % cta_pair  # this CTA's half of a pair (0 for a single)
            is_leader = v == 0
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cluster_coord = cluster_layout_vmnk.get_flat_coord(rank)

            @cute.struct
            class Storage:
                ab_mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                acc_mbar: cute.struct.MemRange[cutlass.Int64, self.slots * 2]
                tmem_dealloc_mbar: cutlass.Int64
                tmem_base: cutlass.Int32
                clc_mbar: cute.struct.MemRange[cutlass.Int64, 2]
                clc_response: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 4], 16]

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(Storage)
            ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.ab_mbar.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                tx_count=self.tma_bytes, cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True,
            ).make_participants()
            acc_pipeline = pipeline.PipelineUmmaAsync.create(
                barrier_storage=storage.acc_mbar.data_ptr(), num_stages=self.slots,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(self.epilogue_warps) * cta_pair),
                cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True)
            cluster_size = cute.size(self.cluster_mn)
            clc_pipeline = pipeline.PipelineClcFetchAsync.create(
                barrier_storage=storage.clc_mbar.data_ptr(), num_stages=1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 32 * (1 + cluster_size * (len(self.epilogue_warps) + 2))),
                tx_count=16, cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True)
            tmem = cutlass.memory.TmemAllocator(
                storage.tmem_base.ptr,
                barrier_for_retrieve=pipeline.NamedBarrier(
                    barrier_id=self.tmem_alloc_bar_id, num_threads=32 * (len(self.epilogue_warps) + 1)),
                allocator_warp_id=self.epilogue_warps[0], is_two_cta=self.pair,
                two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr)
            pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

            sA = smem.allocate_tensor(element_type=self.ab_dtype, layout=a_smem.outer, byte_alignment=SMEM_ALIGN,
                                      swizzle=a_smem.inner)
            sB = smem.allocate_tensor(element_type=self.ab_dtype, layout=b_smem.outer, byte_alignment=SMEM_ALIGN,
                                      swizzle=b_smem.inner)
            sC = smem.allocate_tensor(element_type=self.c_dtype, layout=c_smem.outer, byte_alignment=SMEM_ALIGN,
                                      swizzle=c_smem.inner)
            a_mask = b_mask = None
            if cutlass.const_expr(self.pair):
                a_mask = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cluster_coord, mcast_mode=2)
                b_mask = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cluster_coord, mcast_mode=1)

            # (bM, bK, RestM, RestK, RestL) over the whole A; a tile's rows are set by domain_offset below
            thr_mma = tiled_mma.get_slice(v)
            gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
            tBsB, tBgB = cpasync.tma_partition(
                tma_atom_b, cluster_coord[1], cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape),
                cute.group_modes(sB, 0, 3), cute.group_modes(thr_mma.partition_B(gB), 0, 3))
            tCrA = tiled_mma.make_fragment_A(sA)
            tCrB = tiled_mma.make_fragment_B(sB)
            acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
            tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.slots))
            k_tiles = self.k // self.config.tile_k

            pipeline_init_wait(cluster_shape_mn=self.cluster_mn)
            clc_response = storage.clc_response.data_ptr()
            cta_rank_m = Int32(bidx % cta_pair)  # this CTA's rank along M in its cluster
            work = self.clc_initial_work()
            clc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)

            if warp == self.tma_warp:  # ---- TMA producer
                while work.is_valid_tile:
                    coord = work.tile_idx
                    live, expert, row0, _ = self.locate(row_offsets, counts, coord[0] // cta_pair, rows_lo, rows_hi)
                    if live:
                        gA = cute.local_tile(cute.domain_offset((row0, 0, 0), mA),
                                             cute.slice_(self.mma_tiler, (None, 0, None)), (0, None, 0))
                        tAsA, tAgA = cpasync.tma_partition(
                            tma_atom_a, cluster_coord[2],
                            cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape),
                            cute.group_modes(sA, 0, 3), cute.group_modes(thr_mma.partition_A(gA), 0, 3))
                        tBgB_tile = tBgB[(None, coord[1], None, expert)]
                        for kt in cutlass.range(k_tiles, unroll=1):
                            handle = ab_producer.acquire_and_advance()
                            cute.copy(tma_atom_a, tAgA[(None, kt)], tAsA[(None, handle.index)],
                                      tma_bar_ptr=handle.barrier, mcast_mask=a_mask)
                            cute.copy(tma_atom_b, tBgB_tile[(None, kt)], tBsB[(None, handle.index)],
                                      tma_bar_ptr=handle.barrier, mcast_mask=b_mask)
                    clc_pipeline.consumer_wait(clc_state)
                    work = self.clc_work(clc_response, cta_rank_m)
                    clc_pipeline.consumer_release(clc_state)
                    clc_state.advance()
                ab_producer.tail()

            if warp == self.sched_warp:  # ---- CLC scheduler (first CTA of the cluster)
                if rank == 0:
                    clc_producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.ProducerConsumer, 1)
                    while work.is_valid_tile:
                        clc_pipeline.producer_acquire(clc_producer)
                        self.clc_request(clc_pipeline.producer_get_barrier(clc_producer), clc_response)
                        clc_producer.advance()
                        clc_pipeline.consumer_wait(clc_state)
                        work = self.clc_work(clc_response, cta_rank_m)
                        clc_pipeline.consumer_release(clc_state)
                        clc_state.advance()
                    clc_pipeline.producer_tail(clc_producer)

            if warp == self.mma_warp:  # ---- MMA issuer
                tmem.wait_for_alloc()
                tCtAcc_base = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), tCtAcc_fake.layout)
                acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.slots)
                while work.is_valid_tile:
                    live, _, _, _ = self.locate(row_offsets, counts, work.tile_idx[0] // cta_pair, rows_lo, rows_hi)
                    if live:
                        tCtAcc = tCtAcc_base[(None, None, None, acc_state.index)]
                        if is_leader:
                            acc_pipeline.producer_acquire(acc_state)
                            for kt in cutlass.range(k_tiles, unroll=1):
                                handle = ab_consumer.wait_and_advance()
                                tiled_mma.set(tcgen05.Field.ACCUMULATE, kt != 0)
                                stage = (None, None, None, handle.index)
                                cute.gemm(tiled_mma, tCtAcc, tCrA[stage], tCrB[stage], tCtAcc)
                                handle.release()
                            acc_pipeline.producer_commit(acc_state)
                        acc_state.advance()
                    clc_pipeline.consumer_wait(clc_state)
                    work = self.clc_work(clc_response, cta_rank_m)
                    clc_pipeline.consumer_release(clc_state)
                    clc_state.advance()
                acc_pipeline.producer_tail(acc_state)

            if warp < self.mma_warp:  # ---- epilogue warps
                tmem.allocate(self.resources.tmem_alloc_columns)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
                tCtAcc = transform_partitioned_tensor_layout(cute.make_tensor(tmem_ptr, tCtAcc_fake.layout))
                acc_tile = (ROWS_PER_CTA, self.acc_sub_n)
                tAcc_epi = cute.flat_divide(tCtAcc, acc_tile)  # (128, SUB, 1, subtiles, slots)
                t2r = tcgen05.make_tmem_copy(
                    sm100_utils.get_tmem_load_op(self.cta_tile, cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, self.c_dtype,
                                                 self.acc_dtype, acc_tile, self.pair),
                    tAcc_epi[(None, None, 0, 0, 0)])
                thr_t2r = t2r.get_slice(tidx)
                tTR_tAcc = thr_t2r.partition_S(tAcc_epi)
                tTR_cAcc = thr_t2r.partition_D(cute.make_identity_tensor(acc_tile))
                r_acc = cute.make_rmem_tensor(tTR_cAcc.shape, self.acc_dtype)
                my_row = tTR_cAcc[0][0]  # 32x32b loads: each thread owns one TMEM lane = one row
                r_out = cute.make_rmem_tensor(self.epi_n, self.c_dtype)
                r_val = cute.make_rmem_tensor(self.epi_n, self.acc_dtype)
                store_pipeline = pipeline.PipelineTmaStore.create(
                    num_stages=self.epi_buffers,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(self.epilogue_warps)))
                epi_barrier = pipeline.NamedBarrier(barrier_id=self.epi_bar_id, num_threads=32 * len(self.epilogue_warps))
                acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.slots)
                buffer = Int32(0)
                while work.is_valid_tile:
                    coord = work.tile_idx
                    live, expert, row0, valid_end = self.locate(row_offsets, counts, coord[0] // cta_pair, rows_lo, rows_hi)
                    if live:
                        cta_row0 = row0 + v * ROWS_PER_CTA
                        stores = cta_row0 < valid_end  # a whole 128-row half past the expert is not written
                        global_row = cta_row0 + my_row
                        scale = Float32(1.0)
                        if cutlass.const_expr(self.has_row_scale):
                            if global_row < rows:
                                scale = Float32(row_scale[global_row])
                        # (128, epi_n, N_out / epi_n) output sub-tiles of this CTA's rows
                        gC = cute.flat_divide(cute.domain_offset((cta_row0, 0), mC), self.epi_tile)[(None, None, 0, None)]
                        bSG_sC, bSG_gC = cpasync.tma_partition(
                            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), cute.group_modes(gC, 0, 2))
                        acc_pipeline.consumer_wait(acc_state)
                        for sub in cutlass.range_constexpr(self.num_subtiles):
                            cute.copy(t2r, tTR_tAcc[(None, None, None, 0, sub, acc_state.index)], r_acc)
                            if cutlass.const_expr(sub == self.num_subtiles - 1):
                                cute.arch.fence_view_async_tmem_load()
                                with cute.arch.elect_one():
                                    acc_pipeline.consumer_release(acc_state)
                            acc_col0 = coord[1] * self.config.tile_n + sub * self.acc_sub_n
                            self.apply_epilogue(r_acc, r_val, bias, expert, acc_col0, scale)
                            r_out.store(r_val.load().to(self.c_dtype))
                            cute.autovec_copy(r_out, sC[(my_row, None, buffer)])
                            cute.arch.fence_proxy("async.shared", space="cta")
                            epi_barrier.arrive_and_wait()
                            if warp == self.epilogue_warps[0]:
                                if stores:
                                    out_col_tile = coord[1] * self.num_subtiles + sub
                                    cute.copy(tma_atom_c, bSG_sC[(None, buffer)], bSG_gC[(None, out_col_tile)])
                                store_pipeline.producer_commit()
                                store_pipeline.producer_acquire()
                            epi_barrier.arrive_and_wait()
                            buffer = (buffer + 1) % self.epi_buffers
                        acc_state.advance()
                    clc_pipeline.consumer_wait(clc_state)
                    work = self.clc_work(clc_response, cta_rank_m)
                    clc_pipeline.consumer_release(clc_state)
                    clc_state.advance()
                store_pipeline.producer_tail()
                tmem.relinquish_alloc_permit()
                tmem.free(tmem_ptr)

        @cute.jit
        def apply_epilogue(self, r_acc: cute.Tensor, r_val: cute.Tensor, bias: cute.Tensor, expert: Int32,
                           acc_col0: Int32, scale: Float32):
            """fp32 math of one sub-tile row: acc (acc_sub_n columns) -> values (epi_n columns)."""
            if cutlass.const_expr(self.has_bias):
                for i in cutlass.range_constexpr(self.acc_sub_n):
                    r_acc[i] = r_acc[i] + Float32(bias[expert, acc_col0 + i])
            if cutlass.const_expr(self.gated):
                # packed w13: per 16 accumulator columns, 8 gate then the matching 8 up
                for i in cutlass.range_constexpr(self.epi_n):
                    chunk, j = i // GATE_UP_CHUNK, i % GATE_UP_CHUNK
                    gate = r_acc[2 * GATE_UP_CHUNK * chunk + j]
                    up = r_acc[2 * GATE_UP_CHUNK * chunk + GATE_UP_CHUNK + j]
                    r_val[i] = self.gated_activation(gate, up)
            else:
                for i in cutlass.range_constexpr(self.epi_n):
                    r_val[i] = r_acc[i] * scale

        @cute.jit
        def gated_activation(self, gate: Float32, up: Float32) -> Float32:
            result = gate
            if cutlass.const_expr(self.activation == Activation.SWIGLU.value):
                result = gate / (1.0 + cute.math.exp(-gate, fastmath=True)) * up
            elif cutlass.const_expr(self.activation == Activation.GELU_GATED.value):
                result = 0.5 * gate * (1.0 + cute.math.erf(gate * 0.7071067811865476)) * up
            else:
                g = cutlass.min(gate, Float32(SWIGLU_OAI_LIMIT))
                u = cutlass.max(cutlass.min(up, Float32(SWIGLU_OAI_LIMIT)), Float32(-SWIGLU_OAI_LIMIT))
                result = (u + 1.0) * (g / (1.0 + cute.math.exp(-SWIGLU_OAI_ALPHA * g, fastmath=True)))
            return result

    return Sm100GroupedGemmKernel


# ----------------------------------------------------------------------------------------------------------
# Compiling (CPU is enough: CUTE_DSL_ARCH / --gpu-arch sm_100a on fake tensors with a symbolic M)
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What the compiler produced: dynamic SMEM of the launch (host IR) and the tcgen05.alloc columns (PTX)."""

    smem_bytes: int | None
    tmem_alloc_columns: int | None
    instructions: dict  # PTX mnemonic -> count, for the checks CI runs


PTX_MNEMONICS = (
    "tcgen05.mma.cta_group::1",
    "tcgen05.mma.cta_group::2",
    "tcgen05.alloc.cta_group::1",
    "tcgen05.alloc.cta_group::2",
    "tcgen05.dealloc",
    "tcgen05.ld",
    "tcgen05.commit",
    "clusterlaunchcontrol.try_cancel",
    "clusterlaunchcontrol.query_cancel",
    "cp.async.bulk.tensor",
)


def ptx_report(ptx: str) -> dict:
    """{mnemonic: occurrences} of the instructions this family must contain."""
    return {m: len(re.findall(re.escape(m) + r"[.\s]", ptx)) for m in PTX_MNEMONICS}


def _ptx_tmem_alloc_columns(ptx: str) -> int | None:
    """Column count of tcgen05.alloc: an immediate, or a register set by the nearest mov before it."""
    match = re.search(r"tcgen05\.alloc\.[^\n]*\],\s*(%r\d+|\d+);", ptx)
    if match is None:
        return None
    operand = match.group(1)
    if operand.isdigit():
        return int(operand)
    movs = re.findall(r"mov\.b32\s+" + re.escape(operand) + r",\s*(\d+);", ptx[: match.start()])
    return int(movs[-1]) if movs else None


_LAUNCH_STRUCT = "struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def _ir_launch_smem_bytes(ir_text: str) -> int | None:
    """Dynamic SMEM bytes the host code passes to the launch (field 2 of the launch config struct)."""
    for gep in re.finditer(r"(%\d+) = llvm\.getelementptr (%\d+)\[0, 2\] [^\n]*" + re.escape(_LAUNCH_STRUCT), ir_text):
        name = gep.group(1)
        store = re.search(r"llvm\.store (%\d+), " + re.escape(name) + r" : i64", ir_text[gep.end():])
        if store is None:
            continue
        before = ir_text[: gep.start()]
        consts = re.findall(re.escape(store.group(1)) + r" = llvm\.mlir\.constant\((\d+) : i64\)", before)
        if consts:
            return int(consts[-1])
    return None


def _cutlass_dtype(name: str):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def compile_kernel(config: Sm100GemmConfig, problem: Sm100Problem, *, keep_ptx: bool = False,
                   dump_dir: str | None = None, tvm_ffi: bool = True):
    """Compile for sm_100a (no GPU needed). Returns (compiled, CompileReport).

    The compiled function is called as f(a, w, out, row_offsets, counts, bias, row_scale, rows_lo, rows_hi)
    on the current stream; bias [E, N] (packed like w13 for GEMM1) and row_scale [max_rows] are fp32, and
    1-element placeholders when the epilogue has none.
    """
    ok, reason = can_implement(config, problem)
    if not ok:
        raise ValueError(f"config: cannot run {problem} with {config}: {reason}")
    import tempfile

    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dtype = _cutlass_dtype(problem.dtype)
    rows = cute.sym_int()
    e, n, k = problem.num_experts, problem.n, problem.k
    a = make_fake_tensor(dtype, (rows, k), (k, 1), assumed_align=16)
    w = make_fake_tensor(dtype, (e, n, k), (n * k, k, 1), assumed_align=16)
    out = make_fake_tensor(dtype, (rows, problem.out_columns), (problem.out_columns, 1), assumed_align=16)
    row_offsets = make_fake_tensor(cutlass.Int32, (e + 1,), (1,), assumed_align=4)
    counts = make_fake_tensor(cutlass.Int32, (e,), (1,), assumed_align=4)
    bias = make_fake_tensor(cutlass.Float32, (e, n) if problem.has_bias else (1,), (n, 1) if problem.has_bias else (1,))
    row_scale = make_fake_tensor(cutlass.Float32, (rows,) if problem.has_row_scale else (1,), (1,))
    kernel = _kernel_class()(config, problem)
    keep_dir = dump_dir or (tempfile.mkdtemp(prefix="moe2cta_sm100_") if keep_ptx else None)
    options = f"--gpu-arch {Arch.SM100.value}"
    if tvm_ffi:
        options += " --enable-tvm-ffi"
    if keep_ptx:
        options += f" --keep-ptx --dump-dir {keep_dir}"
    compiled = cute.compile(kernel, a, w, out, row_offsets, counts, bias, row_scale, cutlass.Int32(0),
                            cutlass.Int32(NO_UPPER_BOUND), make_fake_stream(use_tvm_ffi_env_stream=True),
                            options=options)
    ptx = _compiled_ptx(compiled) if keep_ptx else ""
    if keep_ptx and dump_dir is None:  # the PTX text stays on the compiled object
        shutil.rmtree(keep_dir, ignore_errors=True)
    report = CompileReport(
        smem_bytes=_ir_launch_smem_bytes(str(compiled.ir_module)),
        tmem_alloc_columns=_ptx_tmem_alloc_columns(ptx) if ptx else None,
        instructions=ptx_report(ptx) if ptx else {},
    )
    return compiled, report


def _compiled_ptx(compiled) -> str:
    ptx = getattr(compiled, "__ptx__", None)
    if ptx:
        return ptx
    artifact = getattr(getattr(compiled, "artifacts", None), "PTX", None) or ""
    if artifact and "\n" not in artifact:
        import pathlib

        path = pathlib.Path(artifact)
        return path.read_text() if path.exists() else ""
    return artifact


def preset_problems(preset, dtype: str = "bfloat16") -> tuple[Sm100Problem, Sm100Problem]:
    """(GEMM1, GEMM2) of a moe2cta.presets.ModelPreset; GEMM2 scales rows by the router weights."""
    gemm1 = Sm100Problem(GemmStage.GEMM1, 2 * preset.intermediate, preset.hidden, preset.num_experts, dtype,
                         activation=preset.activation, has_bias=preset.has_bias)
    gemm2 = Sm100Problem(GemmStage.GEMM2, preset.hidden, preset.intermediate, preset.num_experts, dtype,
                         has_bias=preset.has_bias, has_row_scale=True)
    return gemm1, gemm2


def preset_configs(preset, dtype: str = "bfloat16"):
    """[(problem, config)] the bundle builds: GEMM1 and GEMM2, each as PAIR and as SINGLE."""
    out = []
    for problem in preset_problems(preset, dtype):
        for unit in (WorkUnit.PAIR, WorkUnit.SINGLE):
            out.append((problem, default_config(problem, unit)))
    return out


def compile_for_preset(preset, out_dir=None, keep_ptx: bool = False, dtype: str = "bfloat16"):
    """Compile every sm_100a kernel a model needs. Returns [(KernelKey, compiled or exported path)].

    With out_dir the kernels are exported there (cute_runtime.export_kernel, PTX beside them with
    keep_ptx); the manifest records the compile's SMEM and TMEM next to the resource model's numbers.
    """
    return [_build(config, problem, out_dir, keep_ptx) for problem, config in preset_configs(preset, dtype)]


def kernel_request(config: Sm100GemmConfig, problem: Sm100Problem) -> dict:
    """What compile_requests needs to build this kernel elsewhere (cute_runtime's requests file)."""
    from .cute_runtime import make_request

    return make_request(FAMILY, config, problem)


def kernel_from_key(key) -> tuple[Sm100GemmConfig, Sm100Problem]:
    """The (config, problem) whose kernel_key is `key`, pair_threshold (a runtime value) at 0: a bundle's manifest
    says enough about each kernel to build it again. ValueError where `key` is no key this family makes."""
    if key.family != FAMILY:
        raise ValueError(f"key: expected a {FAMILY} key, got family {key.family!r}")
    extra = {item[0]: item[1:] for item in key.extra if isinstance(item, tuple) and len(item) >= 2}
    stage, activation, has_row_scale, has_bias = parse_epilogue_name(key.epilogue)
    try:
        config = Sm100GemmConfig(unit=WorkUnit.PAIR if tuple(key.cluster) == (2, 1, 1) else WorkUnit.SINGLE,
                                 tile_n=key.tile[1], tile_k=key.tile[2], stages=extra["stages"][0],
                                 accumulator_slots=extra["acc"][0], epi_n=extra["epi"][0], epi_buffers=extra["epi"][1])
        problem = Sm100Problem(stage, key.n, key.k, key.num_experts, key.dtype, activation, has_bias, has_row_scale)
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise ValueError(f"key: {key.file_stem()} is no {FAMILY} key ({exc})") from None
    ok, reason = can_implement(config, problem)
    if not ok:
        raise ValueError(f"key: {key.file_stem()}: {reason}")
    if kernel_key(config, problem) != key:
        raise ValueError(f"key: {key.file_stem()} names no kernel this family builds (read back as "
                         f"{kernel_key(config, problem).file_stem()})")
    return config, problem


def compile_requests(requests, out_dir, keep_ptx: bool = False) -> list:
    """Compile and export the kernels of `requests` (kernel_request dicts) into out_dir; returns [(KernelKey, path)].
    A request of another family, or one this family cannot implement, is a ValueError that says which."""
    from .cute_runtime import requested_kernels

    pairs = requested_kernels(requests, FAMILY, Sm100GemmConfig, Sm100Problem, can_implement)
    return [_build(config, problem, out_dir, keep_ptx) for config, problem in pairs]


def _build(config: Sm100GemmConfig, problem: Sm100Problem, out_dir, keep_ptx: bool):
    """(key, compiled) without out_dir, else (key, exported library path) with the resource numbers in the manifest."""
    from . import cute_runtime

    key = kernel_key(config, problem)
    compiled, report = compile_kernel(config, problem, keep_ptx=keep_ptx)
    if out_dir is None:
        return key, compiled
    use = resource_use(config, problem)
    info = {
        "unit": config.unit.value,
        "smem_bytes_compiled": report.smem_bytes,
        "smem_bytes_model": use.smem_bytes,
        "tmem_alloc_columns_compiled": report.tmem_alloc_columns,
        "tmem_alloc_columns_model": use.tmem_alloc_columns,
        "stages": use.stages,
        "ptx_instructions": report.instructions,
    }
    return key, cute_runtime.export_kernel(compiled, key, out_dir, keep_ptx, smem_bytes=report.smem_bytes, info=info)


# ----------------------------------------------------------------------------------------------------------
# Host API (semantics of grouped_gemm/reference.py; weights packed by sm90_grouped_gemm.prepack_w13)
# ----------------------------------------------------------------------------------------------------------

DEFAULT_PAIR_THRESHOLD = ROWS_PER_CTA + 1  # an expert that fits one 128-row CTA tile runs single
_CACHE = None
_SCRATCH: dict = {}


def _kernel_cache():
    global _CACHE
    if _CACHE is None:
        from .cute_runtime import KernelCache

        _CACHE = KernelCache(prefer="bundle")  # as sm90: a prebuilt kernel where the bundle has it, else JIT
    return _CACHE


def _check_inputs(a, w, row_offsets, counts, name_w: str) -> None:
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        raise TypeError(f"a: expected a 2-d tensor [max_rows, K], got {getattr(a, 'shape', type(a))}")
    if a.dtype not in _DTYPES:
        raise TypeError(f"a: expected bfloat16 or float16, got {a.dtype}")
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype != a.dtype or w.shape[2] != a.shape[1]:
        raise TypeError(
            f"{name_w}: expected [E, N, {a.shape[1]}] of {a.dtype}, got {getattr(w, 'shape', None)} {getattr(w, 'dtype', None)}"
        )
    num_experts = w.shape[0]
    if not isinstance(row_offsets, torch.Tensor) or row_offsets.dtype != torch.int32 or row_offsets.shape != (num_experts + 1,):
        raise TypeError(f"row_offsets: expected int32 [{num_experts + 1}], got {getattr(row_offsets, 'dtype', None)} "
                        f"{tuple(getattr(row_offsets, 'shape', ()))}")
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32 or counts.shape != (num_experts,):
        raise TypeError(f"counts: expected int32 [{num_experts}], got {getattr(counts, 'dtype', None)} "
                        f"{tuple(getattr(counts, 'shape', ()))}")
    if min(w.shape) < 1:
        raise ValueError(f"{name_w}: expected [E, N, K] with every size >= 1, got {tuple(w.shape)}")
    for name, t in ((name_w, w), ("row_offsets", row_offsets), ("counts", counts)):
        if t.device != a.device:
            raise ValueError(f"{name}: expected device {a.device} (a's), got {t.device}")
    if not (a.is_contiguous() and w.is_contiguous()):
        raise ValueError("a, w: expected contiguous (K-major) tensors")
    if a.data_ptr() % 16 or w.data_ptr() % 16:
        raise ValueError("a, w: expected 16-byte aligned data (TMA)")
    if not a.is_cuda:
        raise ValueError("a: the sm100 kernels need CUDA tensors")
    major, minor = torch.cuda.get_device_capability(a.device)
    if major != 10:
        raise RuntimeError(f"a: the sm100 kernels need an sm_100 GPU (B200/GB200), this device is sm_{major}{minor}")


def prepare_device(device) -> None:
    """Make the dummy that launches on `device` pass for an absent bias or row scale (never read), once per device.
    MoELayer calls this when it is built: a first launch inside a graph capture would otherwise make it in the
    capture's memory pool and keep it there (torch.compile's CUDA graph trees refuse that)."""
    device = torch.device(*device_key(device))  # with its index, as the launches' a.device
    if device not in _SCRATCH:
        _SCRATCH[device] = torch.zeros(1, dtype=torch.float32, device=device)


def _launch(config, problem, a, w, out, row_offsets, counts, bias, row_scale):
    ok, reason = can_implement(config, problem)
    if not ok:
        raise ValueError(f"config: {reason}")
    if a.device not in _SCRATCH:
        prepare_device(a.device)
    dummy = _SCRATCH[a.device]
    if a.shape[0] == 0:  # no rows: nothing to launch (a grid of 0 CTAs is not a valid launch)
        return out
    launches = [(config, 0, NO_UPPER_BOUND)]
    if config.unit is WorkUnit.PAIR and config.pair_threshold > 0:
        launches = [(config, config.pair_threshold, NO_UPPER_BOUND),
                    (config.single_fallback(), 0, config.pair_threshold)]
    for cfg, rows_lo, rows_hi in launches:
        kernel = _kernel_cache().get(kernel_key(cfg, problem), lambda cfg=cfg: compile_kernel(cfg, problem)[0],
                                     request=lambda cfg=cfg: kernel_request(cfg, problem))
        kernel(a, w, out, row_offsets, counts, bias if bias is not None else dummy,
               row_scale if row_scale is not None else dummy, rows_lo, rows_hi)
    return out


def _check_align(align) -> None:
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align % ROW_GRANULE:
        raise ValueError(f"align: expected the dispatch's align, a multiple of the {ROW_GRANULE} rows every expert's "
                         f"tiles start on, got {align!r}")


def sm100_grouped_gemm1(a: torch.Tensor, packed_w13: torch.Tensor, row_offsets: torch.Tensor, counts: torch.Tensor,
                        activation: Activation = Activation.SWIGLU, b13: torch.Tensor | KernelBias | None = None,
                        out: torch.Tensor | None = None, config: Sm100GemmConfig | None = None,
                        align: int = 128) -> torch.Tensor:
    """act(a @ w13[e].T + b13[e]) per expert -> [max_rows, I]; packed_w13 from prepack_w13, b13 public [E, 2I] or
    its kernel_bias.

    The dispatch metadata lives on the device and is not read here; as router.dispatch makes it: row_offsets [E + 1]
    from 0, multiples of `align` (the dispatch's align, a multiple of 128), counts[e] <= row_offsets[e + 1] -
    row_offsets[e], row_offsets[E] <= a's rows. The kernel stores whole 128-row halves: an expert's padding rows up to
    its next multiple of 128 are written too."""
    _check_align(align)
    _check_inputs(a, packed_w13, row_offsets, counts, "packed_w13")
    num_experts, two_i, hidden = packed_w13.shape
    problem = Sm100Problem(GemmStage.GEMM1, two_i, hidden, num_experts, _DTYPES[a.dtype],
                           activation=Activation.parse(activation), has_bias=b13 is not None)
    config = config or default_config(problem, WorkUnit.PAIR, DEFAULT_PAIR_THRESHOLD)
    bias, _ = epilogue_operands(GemmStage.GEMM1, num_experts, two_i, a.shape[0], b13, None, a.device)
    if out is None:
        out = torch.empty(a.shape[0], two_i // 2, dtype=a.dtype, device=a.device)
    else:
        check_out(out, a.shape[0], two_i // 2, a, packed_w13=packed_w13, row_offsets=row_offsets, counts=counts,
                  b13=bias)
    return _launch(config, problem, a, packed_w13, out, row_offsets, counts, bias, None)


def sm100_grouped_gemm2(a: torch.Tensor, w2: torch.Tensor, row_offsets: torch.Tensor, counts: torch.Tensor,
                        row_scale: torch.Tensor | None = None, b2: torch.Tensor | KernelBias | None = None,
                        out: torch.Tensor | None = None, config: Sm100GemmConfig | None = None,
                        align: int = 128) -> torch.Tensor:
    """(a @ w2[e].T + b2[e]) * row_scale per expert -> [max_rows, H]; the dispatch metadata and `align` as in
    sm100_grouped_gemm1."""
    _check_align(align)
    _check_inputs(a, w2, row_offsets, counts, "w2")
    num_experts, hidden, inter = w2.shape
    problem = Sm100Problem(GemmStage.GEMM2, hidden, inter, num_experts, _DTYPES[a.dtype],
                           has_bias=b2 is not None, has_row_scale=row_scale is not None)
    config = config or default_config(problem, WorkUnit.PAIR, DEFAULT_PAIR_THRESHOLD)
    bias, row_scale = epilogue_operands(GemmStage.GEMM2, num_experts, hidden, a.shape[0], b2, row_scale, a.device)
    if out is None:
        out = torch.empty(a.shape[0], hidden, dtype=a.dtype, device=a.device)
    else:
        check_out(out, a.shape[0], hidden, a, w2=w2, row_offsets=row_offsets, counts=counts, row_scale=row_scale,
                  b2=bias)
    return _launch(config, problem, a, w2, out, row_offsets, counts, bias, row_scale)
