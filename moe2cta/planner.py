"""Planner: resource accounting first, prune, then rank by an analytic time model (no GPU needed).

The seed's method: count what one configuration needs (SMEM, TMEM, registers, tiles, coverage), drop what
cannot fit or wastes too much, then measure the rest. This module does the first two steps and ranks the
survivors with a roofline-style model, so serving gets a good configuration with no autotuning at start-up
and no recompile per batch size (moe2cta/tuning.py can replace the ranking by measurements, per bucket).

Problem. One grouped GEMM over experts: expert e has m_e rows (tokens routed to it), N output columns of
the accumulator (GEMM1: 2I, gate and up; the fused activation halves it to I on output; GEMM2: H) and
depth K (GEMM1: H, GEMM2: I). Routing assumption, stated on every plan (RoutingAssumption): a given counts
vector; UNIFORM (default): uniform random top-k routing in expectation: E * (1 - (1 - k/E)^T) experts hit
(rounded), the T*k rows spread as evenly as possible over them; or BALANCED: the T*k rows spread evenly over
all E experts (min(E, T*k) hit).

Candidate. arch (sm_90a | sm_100a), work unit (PAIR: two CTAs of a (2,1,1) cluster on one tile of
block_m = 2 x rows_per_cta rows; SINGLE: one CTA on block_m rows), block_n, block_k, stages, accumulator
slots, epilogue sub-tile, and for PAIR a pair_threshold: experts with fewer rows run single-CTA tiles of
rows_per_cta rows (0: every expert runs pairs). The search offers rows_per_cta + 1 (experts that need more
than one CTA tile pair up), and 0 where that differs or (sm_100) saves the second launch.

Accounting per CTA (all from grouped_gemm/budget.py):
  input stage    = A rows_per_cta x BK + B (sm_100 PAIR: BN/2 columns, 2-CTA MMA; otherwise BN) x BK, x 2 B.
                   (sm_90 PAIR with a pair_threshold runs single tiles in the same kernel with the same SMEM.
                   sm_100 cannot mix cta_group::1 and ::2 in one kernel: a PAIR launch for experts with
                   >= pair_threshold rows, then a SINGLE launch for the rest with its own layout (B not split,
                   as many stages as fit, same BN/BK/slots/epilogue: Sm100GemmConfig.single_fallback). Each
                   launch is budgeted, limit-checked and predicted alone; see split_launches / Launch.)
  SMEM           = align1024(barriers + scheduler words [+ sm_90: row_offsets and counts, 4 x (2E+1) B])
                   + stages x input stage + epilogue staging (rows_per_cta x epi_n x out bytes x epi_buffers),
                   limit 227 KiB.
  TMEM (sm_100)  = block_n fp32 columns per accumulator slot (<= 128 rows per CTA = 128 lanes), x slots,
                   <= 512; tcgen05.alloc reserves the next power of two.
  registers      = sm_90: each consumer warpgroup holds 64 x BN fp32 = BN/2 registers per thread, budget
                   232 per consumer thread (setmaxnreg; producer 40) minus ~64 for addresses and epilogue.
                   sm_100: accumulators live in TMEM; not modelled.
  coverage       = sum_e m_e * N / sum over tiles of (tile rows x BN): the share of computed outputs that
                   are wanted. tiles = sum_e ceil(m_e / unit rows) * ceil(N / BN).
  intensity      = FLOP of one work unit per K stage / bytes that stage brings into SMEM (all CTAs of the
                   unit), and per byte read from L2 (sm_90 multicast: B counted once per pair).

Time model (predicted seconds, ranked ascending):
  per CTA tile   t_mma  = 2 * rows_per_cta * BN * K / (peak / num_sms) / (shape_eff * smem_read_eff)
                   t_load = bytes the CTA's stages bring in / min(per_sm_bw, stages * stage_bytes / latency)
                   (Little's law: bytes in flight over the load latency -> pipeline depth matters)
                   t_epi  = output bytes of the tile / per_sm_bw, hidden when accumulator slots >= 2
                   t_tile = max(t_mma, t_load) + (t_epi if slots == 1)
  SM time        = ceil(cta_tiles / num_sms) * t_tile           (wave quantization, tail)
  HBM time       = (weights of the experts hit + A rows read + output written) / hbm_bw
  L2 time        = sum over tiles of bytes loaded from L2 / l2_bw
  power time     = (computed FLOP x J/FLOP + HBM bytes x J/byte) / (power limit - idle), where the hardware has a
                   measured power model (the H200: every prefill GEMM runs at its 700 W cap; padding rows cost energy)
  predicted      = max(SM, HBM, L2, power time) / measured unit rate + latency (first fill) + launch overhead, per
                   launch; the unit rate is a measured factor per kind of work unit (Hardware.pair_rate,
                   single_warpgroup_rate: the H200's PAIR units 0.99, its one-warpgroup 64-row tiles 0.75, each
                   with its measurements in HARDWARE); 1 where nothing was measured (the B200);
                   an sm_100 two-launch candidate: the sum of both launches (waves counted per launch).
  shape_eff: sm_100 tiles of 64 rows per CTA use half the tensor core (0.5), else 1.0.
  smem_read_eff: min(1, 128 B/clk / SMEM bytes the MMA reads per clock at peak) (sm_90 per warpgroup of 64
  rows: every warpgroup reads all of B).
Prune: over the SMEM/TMEM/register budget, fewer than 2 stages, alignment (K*2 % 16; gated N tiles divide
2I: sm_100's limit, and on sm_90 a partial last n-block measured slower than a dividing tile), the kernel family's
own can_implement where the family exists (the planner
builds its Sm90GemmConfig / Sm100GemmConfig), then coverage below min_coverage_ratio x the best feasible
coverage (Hardware.min_coverage_ratio unless given: the seed's 0.8; the H200 0.5, so that a 128-row tile over
experts of 64 rows stays, the fastest measured there). Ties on time go to fewer waves, more busy SMs, fewer L2
bytes, better coverage, more accumulator slots, more stages, less SMEM, SINGLE before PAIR. On the B200 model pairs
win for experts with >= pair_threshold rows because the L2 and SMEM-read terms reward the shared B tile. On the H200
the power term binds at prefill for pairs and singles alike, and the measured pair rate leaves the single unit
first, as measured (stop 32: the first pick is the family default on all 30 buckets of the tuning runs,
tests/test_planner.py). Decode shapes (few rows per expert) come out HBM-bound. Hardware constants: the H200's
4.24 TB/s, 792 TFLOP/s, L2 rate and power model were measured; the rest are assumptions.
The text reports (budget table, runners-up, rejections) are printed by moe2cta/plan_cli.py.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import math
from typing import Iterable, Sequence

from .grouped_gemm.epilogue import Activation, GemmStage
from .grouped_gemm.budget import (
    ARCH_LIMITS,
    Arch,
    WorkUnit,
    barrier_bytes,
    epilogue_smem_bytes,
    input_bytes_per_stage,
    tmem_allocation_columns,
    tmem_columns,
)

__all__ = [
    "GemmKind",
    "Hardware",
    "PowerModel",
    "HARDWARE",
    "GemmProblem",
    "Candidate",
    "Budget",
    "Prediction",
    "Evaluation",
    "SearchResult",
    "MoePlan",
    "RoutingAssumption",
    "expected_experts_hit",
    "balanced_counts",
    "moe_problems",
    "dense_problem",
    "compute_budget",
    "check_limits",
    "predict",
    "combine_predictions",
    "split_launches",
    "fitting_stages",
    "Launch",
    "evaluate",
    "to_kernel_config",
    "FAMILY_DEFAULTS",
    "make_candidate",
    "enumerate_candidates",
    "search",
    "plan_moe",
    "search_to_dict",
    "RANK_TERMS",
    "rank_key",
    "best_per_shape",
    "KiB",
]

KiB = 1024
SMEM_ALIGN = 1024
SCHEDULER_SMEM_BYTES = 64  # tile-info words / CLC response, TMEM base address
SM90_CONSUMER_REGS = 232  # setmaxnreg for 2 consumer warpgroups next to a 40-register producer warpgroup
SM90_PRODUCER_REGS = 40
SM90_REG_OVERHEAD = 64  # addresses, loop state and epilogue temporaries next to the accumulators
MIN_STAGES = 2


class GemmKind(enum.Enum):
    """Which GEMM of the MoE layer; decides the epilogue and the output width."""

    GEMM1 = "gemm1"  # gate/up projection + fused gated activation: output N/2 columns
    GEMM2 = "gemm2"  # down projection (+ optional router-weight row scale): output N columns
    DENSE = "dense"  # one plain matrix (the seed's calculator, `plan --gemm`)


@dataclasses.dataclass(frozen=True)
class PowerModel:
    """The board's power cap as a time term: energy over (limit - idle) watts. Measured on the H200 with sustained
    replays and NVML (serving_bench/power.py; results/power-h200-2026-12-01, run3 and run7): every prefill GEMM holds
    the board at its cap, and the energy of its MMAs (padding rows included) and weight stream sets its time."""

    limit_watts: float
    idle_watts: float
    joules_per_flop: float  # above idle, dense bf16 MMA (a sustained cuBLAS matmul)
    joules_per_hbm_byte: float  # the weight stream beside the MMAs

    def __post_init__(self):
        for name in ("limit_watts", "joules_per_flop", "joules_per_hbm_byte"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: expected a number > 0, got {value!r}")
        if isinstance(self.idle_watts, bool) or not isinstance(self.idle_watts, (int, float)) or not (
                0 <= self.idle_watts < self.limit_watts):
            raise ValueError(
                f"idle_watts: expected a number in [0, limit_watts={self.limit_watts}), got {self.idle_watts!r}")

    def seconds(self, flop: float, hbm_bytes: float) -> float:
        joules = flop * self.joules_per_flop + hbm_bytes * self.joules_per_hbm_byte
        return joules / (self.limit_watts - self.idle_watts)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Model constants of one GPU. Throughputs are practical ceilings, not datasheet peaks."""

    name: str
    arch: Arch
    num_sms: int
    peak_flops: float  # dense 16-bit tensor FLOP/s
    hbm_bytes_per_s: float
    l2_bytes_per_s: float  # aggregate L2 -> SM bandwidth (assumed)
    per_sm_bytes_per_s: float  # most one SM's TMA loads can pull (assumed)
    load_latency_s: float  # TMA load round trip (assumed)
    mma_flops_per_clk_per_sm: int  # to turn the SMEM read rate into an MMA limit
    smem_read_bytes_per_clk: int = 128
    launch_overhead_s: float = 3e-6
    power: PowerModel | None = None  # None: no power term (not measured)
    # Measured rates of whole kernels against the model's other terms, as factors on their speed (1: as modelled):
    pair_rate: float = 1.0  # PAIR units (cluster of two CTAs in lockstep)
    single_warpgroup_rate: float = 1.0  # tiles of 64 rows per CTA (one consumer warpgroup)
    # search's prune: candidates under this share of the best feasible coverage are dropped (the seed's 0.8)
    min_coverage_ratio: float = 0.8


HARDWARE = {
    # H200 SXM: 4.24 TB/s copy and 792 TFLOP/s bf16 measured (shared/bench/peers); the rest assumed.
    Arch.SM90: Hardware(
        name="NVIDIA H200",
        arch=Arch.SM90,
        num_sms=ARCH_LIMITS[Arch.SM90].num_sms,
        peak_flops=792e12,
        hbm_bytes_per_s=4.24e12,
        # ncu: our GEMM1 at 97.4% of L2 throughput moves ~8.3 TB/s at 1.37 GHz (results/power-h200-2026-12-01)
        l2_bytes_per_s=8.5e12,
        per_sm_bytes_per_s=100e9,
        load_latency_s=1.0e-6,
        mma_flops_per_clk_per_sm=4096,
        # idle 126 W, 0.864 pJ per FLOP above idle, 22 pJ per weight byte, 700 W enforced limit
        power=PowerModel(limit_watts=700.0, idle_watts=126.0, joules_per_flop=0.864e-12, joules_per_hbm_byte=22e-12),
        # PAIR against SINGLE units of the same tile, 14 prefill buckets of the five presets (tuning-h200-2026-12-02,
        # routed rows): 0.95-1.20x the time, geomean 1.01; ncu: B multicast lowers L2 traffic and the clock rises, but
        # the card stays at its power cap (results/power-h200-2026-12-01, run6)
        pair_rate=0.99,
        # 64-row tiles against the 128-row default on the memory-bound buckets of 64 rows per expert: 0.74-0.80 of
        # its speed (tuning-h200-2026-12-02, four GEMMs), 0.66-0.91 at 64-2048 rows (power-h200-2026-12-01, run8)
        single_warpgroup_rate=0.75,
        # 0.5 keeps a 128-row tile over experts of 64 rows (half its rows padding): 1.24-1.35x faster there than the
        # 64-row tile (tuning-h200-2026-12-02); the padding's cost is the power term's, not a prune's
        min_coverage_ratio=0.5,
    ),
    # B200: practical values assumed (no B200 here): ~80% of the 2.25 PFLOP/s and 8 TB/s datasheet.
    Arch.SM100: Hardware(
        name="NVIDIA B200",
        arch=Arch.SM100,
        num_sms=ARCH_LIMITS[Arch.SM100].num_sms,
        peak_flops=1800e12,
        hbm_bytes_per_s=6.5e12,
        l2_bytes_per_s=20.0e12,
        per_sm_bytes_per_s=120e9,
        load_latency_s=1.0e-6,
        mma_flops_per_clk_per_sm=8192,
    ),
}


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """One grouped GEMM: counts[e] rows of expert e times an N x K weight (K-major)."""

    name: str
    kind: GemmKind
    n: int  # accumulator columns (GEMM1: 2I)
    k: int
    counts: tuple[int, ...]
    routing: str  # how counts were obtained (stated in every report)
    elem_bytes: int = 2  # A and B
    out_bytes: int = 2
    dtype: str = "bfloat16"  # "bfloat16" | "float16"
    activation: Activation | None = None  # GEMM1's fused activation (None: SwiGLU for the kernels' checks)
    has_bias: bool = False
    has_row_scale: bool = False  # GEMM2 scales rows by the router weights

    def __post_init__(self):
        _positive_int("n", self.n)
        _positive_int("k", self.k)
        if not isinstance(self.kind, GemmKind):
            raise TypeError(f"kind: expected a GemmKind, got {self.kind!r}")
        counts = tuple(self.counts)
        if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"counts: expected a non-empty sequence of ints >= 0, got {self.counts!r}")
        object.__setattr__(self, "counts", counts)
        if self.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"dtype: expected 'bfloat16' or 'float16', got {self.dtype!r}")
        if self.kind is GemmKind.GEMM1 and self.n % 2:
            raise ValueError(f"n: GEMM1 needs an even N (gate and up halves), got {self.n}")

    @property
    def num_experts(self) -> int:
        return len(self.counts)

    @property
    def total_rows(self) -> int:
        return sum(self.counts)

    @property
    def experts_hit(self) -> int:
        return sum(1 for c in self.counts if c > 0)

    @property
    def out_columns(self) -> int:
        return self.n // 2 if self.kind is GemmKind.GEMM1 else self.n


class RoutingAssumption(enum.Enum):
    """How the planner turns a token count into rows per expert when no counts are given."""

    UNIFORM = "uniform"  # uniform random top-k: the expected number of experts hit, rows spread evenly over them
    BALANCED = "balanced"  # rows spread evenly over all experts


def expected_experts_hit(tokens: int, top_k: int, num_experts: int) -> int:
    """E * (1 - (1 - k/E)^T) rounded, at least 1 when tokens > 0, at most min(E, T*k)."""
    if tokens <= 0:
        return 0
    hit = round(num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens))
    return max(1, min(num_experts, tokens * top_k, hit))


def balanced_counts(total_rows: int, num_experts: int) -> tuple[int, ...]:
    """total_rows spread as evenly as possible: the first total % E experts get one row more."""
    if total_rows < 0:
        raise ValueError(f"total_rows: expected >= 0, got {total_rows}")
    _positive_int("num_experts", num_experts)
    base, extra = divmod(total_rows, num_experts)
    return tuple(base + (1 if e < extra else 0) for e in range(num_experts))


def moe_problems(preset, tokens: int, counts: Sequence[int] | None = None,
                 routing_assumption: RoutingAssumption = RoutingAssumption.UNIFORM) -> tuple[GemmProblem, GemmProblem]:
    """GEMM1 (N=2I, K=H) and GEMM2 (N=H, K=I) of one MoE forward of `tokens` tokens."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens: expected an int >= 0, got {tokens!r}")
    if not isinstance(routing_assumption, RoutingAssumption):
        raise TypeError(f"routing_assumption: expected a RoutingAssumption, got {routing_assumption!r}")
    rows, e = tokens * preset.top_k, preset.num_experts
    if counts is None and routing_assumption is RoutingAssumption.BALANCED:
        counts = balanced_counts(rows, e)
        routing = f"balanced: {rows} rows (T={tokens} x k={preset.top_k}) spread evenly over {e} experts"
    elif counts is None:
        hit = expected_experts_hit(tokens, preset.top_k, e)
        counts = balanced_counts(rows, hit) + (0,) * (e - hit) if hit else (0,) * e
        routing = (f"uniform random top-{preset.top_k} (expected): {rows} rows (T={tokens}) spread evenly over "
                   f"{hit} of {e} experts hit")
    else:
        counts = tuple(int(c) for c in counts)
        if len(counts) != preset.num_experts:
            raise ValueError(f"counts: expected {preset.num_experts} entries (one per expert), got {len(counts)}")
        if min(counts) < 0 or sum(counts) != rows:
            raise ValueError(f"counts: expected rows >= 0 per expert summing to T x k = {tokens} x {preset.top_k} = "
                             f"{rows}, got {sum(counts)} (min {min(counts)})")
        routing = f"given counts: {sum(counts)} rows over {len(counts)} experts, max {max(counts)}"
    h, i = preset.hidden, preset.intermediate
    return (
        GemmProblem("gemm1", GemmKind.GEMM1, 2 * i, h, counts, routing, activation=preset.activation,
                    has_bias=preset.has_bias),
        GemmProblem("gemm2", GemmKind.GEMM2, h, i, counts, routing, has_bias=preset.has_bias, has_row_scale=True),
    )


def dense_problem(m: int, n: int, k: int) -> GemmProblem:
    """One dense M x N x K GEMM (a single 'expert'), as in the seed's calculator."""
    _positive_int("m", m)
    return GemmProblem("gemm", GemmKind.DENSE, n, k, (m,), f"dense: one matrix of {m} rows")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration of a grouped GEMM kernel family.

    block_m is the tile height of the whole work unit (PAIR: both CTAs, 2 x rows_per_cta). For SINGLE
    units pair_threshold must be 0. accumulator_slots: TMEM accumulator slots on sm_100 (2: the epilogue of
    one tile overlaps the next tile's MMAs); sm_90's cooperative consumer warpgroups hold one accumulator
    per CTA (1). epi_n x epi_buffers: the epilogue's SMEM sub-tiles (rows_per_cta x epi_n each).
    """

    arch: Arch
    unit: WorkUnit
    block_m: int
    block_n: int
    block_k: int
    stages: int
    accumulator_slots: int = 2
    pair_threshold: int = 0
    epi_n: int = 32
    epi_buffers: int = 2

    def __post_init__(self):
        object.__setattr__(self, "arch", Arch.parse(self.arch))
        if not isinstance(self.unit, WorkUnit):
            raise TypeError(f"unit: expected a WorkUnit, got {self.unit!r}")
        for name in ("block_m", "block_n", "block_k", "stages", "accumulator_slots", "epi_n", "epi_buffers"):
            _positive_int(name, getattr(self, name))
        if self.unit is WorkUnit.PAIR and self.block_m % 2:
            raise ValueError(f"block_m: a PAIR tile splits its rows over two CTAs, got odd {self.block_m}")
        if isinstance(self.pair_threshold, bool) or not isinstance(self.pair_threshold, int) or self.pair_threshold < 0:
            raise ValueError(f"pair_threshold: expected an int >= 0, got {self.pair_threshold!r}")
        if self.pair_threshold and self.unit is WorkUnit.SINGLE:
            raise ValueError("pair_threshold: only a PAIR candidate has a threshold (SINGLE: 0)")

    @property
    def rows_per_cta(self) -> int:
        return self.block_m // 2 if self.unit is WorkUnit.PAIR else self.block_m

    @property
    def cluster(self) -> tuple[int, int, int]:
        return (2, 1, 1) if self.unit is WorkUnit.PAIR else (1, 1, 1)

    @property
    def mixed(self) -> bool:
        """PAIR kernel that also runs single-CTA tiles for experts under pair_threshold."""
        return self.unit is WorkUnit.PAIR and self.pair_threshold > 0

    def label(self) -> str:
        unit = self.unit.value
        if self.mixed:
            unit += f">={self.pair_threshold}"
        return f"{unit} {self.block_m}x{self.block_n}x{self.block_k} s{self.stages} acc{self.accumulator_slots}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["arch"] = self.arch.value
        d["unit"] = self.unit.value
        d["cluster"] = list(self.cluster)
        return d


@dataclasses.dataclass(frozen=True)
class Budget:
    """Every number of the accounting for one (candidate, problem); bytes unless named otherwise."""

    # work and coverage
    work_units: int  # tiles: pair units + single units
    pair_units: int
    single_units: int
    cta_tiles: int  # rows_per_cta x BN pieces, one per CTA
    n_tiles: int
    useful_rows: int
    computed_rows: int
    coverage: float  # useful outputs / computed outputs (M and N together)
    m_coverage: float
    n_coverage: float
    k_segments: int
    num_sms: int
    waves: int
    tail_fraction: float  # how full the last wave is
    # SMEM per CTA
    a_stage_bytes: int
    b_stage_bytes: int
    input_stage_bytes: int
    input_buffer_bytes: int  # stages x input stage
    epilogue_bytes: int
    bookkeeping_bytes: int  # barriers + scheduler words, aligned to 1024
    smem_bytes: int
    smem_limit: int
    # reuse (per K stage of one work unit)
    flop_per_stage: int
    unit_smem_stage_bytes: int  # all CTAs of the unit
    unit_l2_stage_bytes: int
    intensity_smem: float  # FLOP per byte brought into SMEM
    intensity_l2: float  # FLOP per byte read from L2
    single_equivalent_stage_bytes: int  # per CTA, one 1-CTA tile of rows_per_cta x BN (the seed's 48 KiB)
    single_equivalent_intensity: float
    # TMEM (sm_100)
    tmem_columns_per_slot: int
    tmem_columns: int
    tmem_alloc_columns: int
    tmem_limit: int
    # registers (sm_90, where known)
    acc_regs_per_thread: int | None
    reg_limit_per_thread: int | None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _unit_rows(candidate: Candidate, m: int) -> tuple[int, int]:
    """(tile rows, CTAs) of the work unit that runs an expert with m rows."""
    if candidate.unit is WorkUnit.PAIR and m >= candidate.pair_threshold:
        return candidate.block_m, 2
    return candidate.rows_per_cta, 1


def _smem_pieces(c: Candidate, p: GemmProblem, stages: int) -> tuple[int, int, int]:
    """(input bytes per stage, epilogue staging, barriers + scheduler words aligned to 1024) of one CTA."""
    stage = input_bytes_per_stage(c.block_m, c.block_n, c.block_k, p.elem_bytes, c.unit, c.arch)
    epi = epilogue_smem_bytes(c.rows_per_cta, c.epi_n, p.out_bytes, c.epi_buffers)
    extra_barriers = 3 if c.arch is Arch.SM100 else 2  # scheduler (CLC or tile info) + TMEM handshake
    book = barrier_bytes(stages, c.accumulator_slots, extra_barriers) + SCHEDULER_SMEM_BYTES
    if c.arch is Arch.SM90:  # the sm_90 kernel copies row_offsets [E+1] and counts [E] (int32) into SMEM
        book += 4 * (2 * p.num_experts + 1)
    return stage, epi, math.ceil(book / SMEM_ALIGN) * SMEM_ALIGN


def fitting_stages(candidate: Candidate, problem: GemmProblem) -> int:
    """The most stages whose SMEM fits the per-CTA limit (at least 1; check_limits rejects < 2)."""
    limit = ARCH_LIMITS[candidate.arch].smem_per_cta
    stage, epi, _ = _smem_pieces(candidate, problem, 1)
    stages = max(1, limit // stage)
    while stages > 1:
        _, _, book = _smem_pieces(candidate, problem, stages)
        if book + stages * stage + epi <= limit:
            break
        stages -= 1
    return stages


def compute_budget(candidate: Candidate, problem: GemmProblem, hardware: Hardware | None = None) -> Budget:
    """The seed's calculator, generalized to experts, pairs, stages, epilogue, TMEM and registers."""
    arch = candidate.arch
    hw = hardware or HARDWARE[arch]
    c, p = candidate, problem
    n_tiles = math.ceil(p.n / c.block_n)
    pair_units = single_units = computed_rows = 0
    for m in p.counts:
        if m == 0:
            continue
        rows, ctas = _unit_rows(c, m)
        m_tiles = math.ceil(m / rows)
        computed_rows += m_tiles * rows
        if ctas == 2:
            pair_units += m_tiles * n_tiles
        else:
            single_units += m_tiles * n_tiles
    work_units = pair_units + single_units
    cta_tiles = 2 * pair_units + single_units
    useful = p.total_rows
    m_cov = useful / computed_rows if computed_rows else 1.0
    n_cov = p.n / (n_tiles * c.block_n)
    waves = math.ceil(cta_tiles / hw.num_sms)
    tail = (cta_tiles - (waves - 1) * hw.num_sms) / hw.num_sms if waves else 0.0

    e = p.elem_bytes
    rows = c.rows_per_cta
    a_stage = rows * c.block_k * e
    stage, epi, book_aligned = _smem_pieces(c, p, c.stages)
    b_stage = stage - a_stage
    slots = c.accumulator_slots
    smem = book_aligned + c.stages * stage + epi

    flop_stage = 2 * c.block_m * c.block_n * c.block_k
    ctas_per_unit = 2 if c.unit is WorkUnit.PAIR else 1
    unit_smem = ctas_per_unit * input_bytes_per_stage(c.block_m, c.block_n, c.block_k, e, c.unit, arch)
    if c.unit is WorkUnit.PAIR:  # B read from L2 once per pair (sm_100 split, sm_90 multicast)
        unit_l2 = (c.block_m * c.block_k + c.block_n * c.block_k) * e
    else:
        unit_l2 = unit_smem
    single_eq = input_bytes_per_stage(rows, c.block_n, c.block_k, e, WorkUnit.SINGLE, arch)
    single_eq_intensity = 2 * rows * c.block_n * c.block_k / single_eq

    if arch is Arch.SM100:
        per_slot = tmem_columns(c.block_n, 1)
        tmem = tmem_columns(c.block_n, slots)
        tmem_alloc = tmem_allocation_columns(tmem)
        acc_regs = reg_limit = None
    else:
        per_slot = tmem = tmem_alloc = 0
        acc_regs = 64 * c.block_n // 128
        reg_limit = SM90_CONSUMER_REGS - SM90_REG_OVERHEAD
    return Budget(
        work_units=work_units,
        pair_units=pair_units,
        single_units=single_units,
        cta_tiles=cta_tiles,
        n_tiles=n_tiles,
        useful_rows=useful,
        computed_rows=computed_rows,
        coverage=m_cov * n_cov,
        m_coverage=m_cov,
        n_coverage=n_cov,
        k_segments=math.ceil(p.k / c.block_k),
        num_sms=hw.num_sms,
        waves=waves,
        tail_fraction=tail,
        a_stage_bytes=a_stage,
        b_stage_bytes=b_stage,
        input_stage_bytes=stage,
        input_buffer_bytes=c.stages * stage,
        epilogue_bytes=epi,
        bookkeeping_bytes=book_aligned,
        smem_bytes=smem,
        smem_limit=ARCH_LIMITS[arch].smem_per_cta,
        flop_per_stage=flop_stage,
        unit_smem_stage_bytes=unit_smem,
        unit_l2_stage_bytes=unit_l2,
        intensity_smem=flop_stage / unit_smem,
        intensity_l2=flop_stage / unit_l2,
        single_equivalent_stage_bytes=single_eq,
        single_equivalent_intensity=single_eq_intensity,
        tmem_columns_per_slot=per_slot,
        tmem_columns=tmem,
        tmem_alloc_columns=tmem_alloc,
        tmem_limit=ARCH_LIMITS[arch].tmem_columns,
        acc_regs_per_thread=acc_regs,
        reg_limit_per_thread=reg_limit,
    )


def check_limits(candidate: Candidate, problem: GemmProblem, budget: Budget) -> tuple[bool, str]:
    """Hard limits: (True, "") or (False, reason). Coverage pruning is relative and lives in search()."""
    c, p, b = candidate, problem, budget
    if c.arch is Arch.SM90 and c.rows_per_cta not in (64, 128):
        return False, f"tile rows per CTA {c.rows_per_cta}: wgmma consumers take 64 or 128 rows per CTA"
    if c.arch is Arch.SM100 and c.rows_per_cta not in (64, 128):
        return False, f"tile rows per CTA {c.rows_per_cta}: tcgen05 takes M=64/128 per CTA (256 per pair)"
    if c.block_n % 16 or c.block_n > 256:
        return False, f"block_n {c.block_n}: expected a multiple of 16, at most 256"
    if c.block_k * p.elem_bytes % 128:
        return False, f"block_k {c.block_k}: expected whole 128-byte swizzle rows (multiple of {128 // p.elem_bytes})"
    if p.k * p.elem_bytes % 16:
        return False, f"K={p.k}: TMA needs 16-byte aligned rows (K*{p.elem_bytes} % 16 == 0)"
    if p.kind is GemmKind.GEMM1 and p.n % c.block_n:
        return False, (f"gated N tile {c.block_n}: the search takes N tiles that divide N=2I={p.n} (sm_100 needs it; on "
                       "sm_90 a partial last n-block measured slower)")
    if c.stages < MIN_STAGES:
        return False, f"stages {c.stages} < {MIN_STAGES}: no overlap of TMA and MMA"
    if b.smem_bytes > b.smem_limit:
        return False, (
            f"SMEM {b.smem_bytes / KiB:.1f} KiB > {b.smem_limit // KiB} KiB per CTA "
            f"({c.stages} x {b.input_stage_bytes / KiB:g} KiB stages + {b.epilogue_bytes / KiB:g} KiB epilogue)"
        )
    if c.arch is Arch.SM100:
        if b.tmem_alloc_columns > b.tmem_limit:
            return False, (
                f"TMEM {b.tmem_columns} columns ({c.accumulator_slots} x {b.tmem_columns_per_slot}, alloc "
                f"{b.tmem_alloc_columns}) > {b.tmem_limit}"
            )
        if c.accumulator_slots > 2:
            return False, f"accumulator slots {c.accumulator_slots}: at most 2"
    else:
        if c.accumulator_slots > 2:
            return False, f"accumulator slots {c.accumulator_slots}: sm_90 has 2 consumer warpgroups"
        if b.acc_regs_per_thread > b.reg_limit_per_thread:
            return False, (
                f"registers: {b.acc_regs_per_thread} accumulator registers per consumer thread "
                f"> {b.reg_limit_per_thread} ({SM90_CONSUMER_REGS} minus {SM90_REG_OVERHEAD} overhead)"
            )
    if c.epi_n > p.out_columns and c.epi_n > c.block_n:
        return False, f"epi_n {c.epi_n}: wider than the output tile"
    return True, ""


@dataclasses.dataclass(frozen=True)
class Prediction:
    seconds: float
    bound: str  # "sm" (MMA or per-SM load), "hbm", "l2"
    sm_seconds: float
    hbm_seconds: float
    l2_seconds: float
    tile_mma_seconds: float
    tile_load_seconds: float
    hbm_bytes: int
    l2_bytes: int
    useful_flop: int
    computed_flop: int
    mma_efficiency: float
    depth_bytes_per_s: float  # per-SM load rate the pipeline depth allows
    power_seconds: float = 0.0  # energy / (limit - idle) watts, where the hardware has a power model
    rate_factor: float = 1.0  # the measured unit rate applied (Hardware.pair_rate / single_warpgroup_rate)

    @property
    def tflops(self) -> float:
        return self.useful_flop / self.seconds / 1e12 if self.seconds else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["useful_tflops"] = self.tflops
        return d


def predict(candidate: Candidate, problem: GemmProblem, budget: Budget, hardware: Hardware | None = None) -> Prediction:
    """Analytic time of the whole grouped GEMM (formula in the module docstring).

    An sm_100 mixed PAIR candidate runs as two launches (split_launches): the sum of both launches'
    predictions, each with its own fill latency and launch overhead; `budget` is then unused.
    """
    hw = hardware or HARDWARE[candidate.arch]
    parts = split_launches(candidate, problem)
    if len(parts) == 1:
        return _predict_kernel(candidate, problem, budget, hw)
    return combine_predictions([_predict_kernel(lc, lp, compute_budget(lc, lp, hw), hw) for lc, lp, _, _ in parts])


def _predict_kernel(candidate: Candidate, problem: GemmProblem, budget: Budget, hw: Hardware) -> Prediction:
    """One launch: max(SM, HBM, L2 time) + first fill + one launch overhead."""
    c, p, b = candidate, problem, budget
    e = p.elem_bytes
    rows = c.rows_per_cta
    # MMA rate: tensor-core shape and SMEM read bandwidth
    shape_eff = 0.5 if (c.arch is Arch.SM100 and rows < 128) else 1.0
    if c.arch is Arch.SM90:
        read_per_flop = (64 + c.block_n) * e / (2 * 64 * c.block_n)  # every consumer warpgroup reads all of B
    else:
        b_cols = c.block_n // 2 if c.unit is WorkUnit.PAIR else c.block_n
        read_per_flop = (rows + b_cols) * e / (2 * rows * c.block_n)
    smem_eff = min(1.0, hw.smem_read_bytes_per_clk / (read_per_flop * hw.mma_flops_per_clk_per_sm))
    mma_eff = shape_eff * smem_eff
    per_sm_flops = hw.peak_flops / hw.num_sms
    t_mma = 2 * rows * c.block_n * p.k / per_sm_flops / mma_eff
    # loads: Little's law on the stages in flight
    cta_stage = b.input_stage_bytes
    depth_bw = min(hw.per_sm_bytes_per_s, c.stages * cta_stage / hw.load_latency_s)
    t_load = b.k_segments * cta_stage / depth_bw
    out_tile_bytes = rows * (c.block_n // 2 if p.kind is GemmKind.GEMM1 else c.block_n) * p.out_bytes
    t_epi = out_tile_bytes / hw.per_sm_bytes_per_s
    t_tile = max(t_mma, t_load) + (t_epi if c.accumulator_slots < 2 else 0.0)
    sm_seconds = b.waves * t_tile
    # global traffic
    weights = p.experts_hit * p.n * p.k * e
    a_bytes = b.computed_rows * p.k * e
    out_bytes = b.computed_rows * p.out_columns * p.out_bytes
    hbm_bytes = weights + a_bytes + out_bytes
    hbm_seconds = hbm_bytes / hw.hbm_bytes_per_s
    l2_bytes = 0
    for m in p.counts:
        if m:
            unit_rows, _ = _unit_rows(c, m)
            units = math.ceil(m / unit_rows) * b.n_tiles
            per_unit = (unit_rows + c.block_n) * c.block_k * e * b.k_segments
            l2_bytes += units * per_unit
    l2_seconds = l2_bytes / hw.l2_bytes_per_s
    useful = 2 * p.total_rows * p.n * p.k
    computed = 2 * b.computed_rows * b.n_tiles * c.block_n * p.k
    power_seconds = hw.power.seconds(computed, hbm_bytes) if hw.power is not None else 0.0
    terms = {"sm": sm_seconds, "hbm": hbm_seconds, "l2": l2_seconds, "power": power_seconds}
    bound = max(terms, key=terms.get)
    rate = (hw.pair_rate if c.unit is WorkUnit.PAIR else 1.0) * (hw.single_warpgroup_rate if rows == 64 else 1.0)
    seconds = terms[bound] / rate + hw.load_latency_s + hw.launch_overhead_s
    return Prediction(
        seconds=seconds,
        bound=bound,
        sm_seconds=sm_seconds,
        hbm_seconds=hbm_seconds,
        l2_seconds=l2_seconds,
        tile_mma_seconds=t_mma,
        tile_load_seconds=t_load,
        hbm_bytes=hbm_bytes,
        l2_bytes=l2_bytes,
        useful_flop=useful,
        computed_flop=computed,
        mma_efficiency=mma_eff,
        depth_bytes_per_s=depth_bw,
        power_seconds=power_seconds,
        rate_factor=rate,
    )


def combine_predictions(launches: Sequence[Prediction]) -> Prediction:
    """Launches run one after the other: times, bytes and FLOP add up (each launch keeps its own fill
    latency and launch overhead); bound and per-tile terms are the longest launch's."""
    longest = max(launches, key=lambda pr: pr.seconds)
    total = {f: sum(getattr(pr, f) for pr in launches) for f in (
        "seconds", "sm_seconds", "hbm_seconds", "l2_seconds", "power_seconds", "hbm_bytes", "l2_bytes", "useful_flop",
        "computed_flop")}
    return dataclasses.replace(longest, **total)


# ---------------------------------------------------------------------------------------------------------
# Launches: sm_100 cannot mix tcgen05 cta_group::1 and ::2 in one kernel, so a PAIR candidate with a
# pair_threshold runs as a PAIR launch (experts with >= threshold rows) then a SINGLE launch (the rest, its
# own layout: one CTA of rows_per_cta rows, B not split, as many stages as fit: Sm100GemmConfig.single_fallback).
# sm_90 runs pair and single units in one kernel with one layout.


def split_launches(candidate: Candidate, problem: GemmProblem
                   ) -> tuple[tuple[Candidate, GemmProblem, int, int | None], ...]:
    """[(launch candidate, problem restricted to its experts, rows_lo, rows_hi or None)] in launch order."""
    c, p = candidate, problem
    if not (c.arch is Arch.SM100 and c.mixed):
        return ((c, p, 0, None),)
    t = c.pair_threshold
    pair = dataclasses.replace(c, pair_threshold=0)
    pair_problem = dataclasses.replace(p, name=f"{p.name}[rows>={t}]",
                                       counts=tuple(m if m >= t else 0 for m in p.counts))
    single_problem = dataclasses.replace(p, name=f"{p.name}[rows<{t}]",
                                         counts=tuple(m if m < t else 0 for m in p.counts))
    single = Candidate(c.arch, WorkUnit.SINGLE, c.rows_per_cta, c.block_n, c.block_k, 1, c.accumulator_slots, 0,
                       c.epi_n, c.epi_buffers)
    single = dataclasses.replace(single, stages=fitting_stages(single, single_problem))
    return ((pair, pair_problem, t, None), (single, single_problem, 0, t))


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a two-launch candidate: its own layout, the experts it runs, its budget and time."""

    problem: GemmProblem  # counts of the experts this launch runs (the others 0)
    rows_lo: int  # runs experts with rows_lo <= rows < rows_hi
    rows_hi: int | None  # None: no upper bound
    evaluation: "Evaluation"  # candidate (the launch's layout), budget, limits, prediction of this launch alone

    def describe(self) -> str:
        ev, b = self.evaluation, self.evaluation.budget
        rows = f">= {self.rows_lo}" if self.rows_hi is None else f"< {self.rows_hi}"
        text = (f"{ev.candidate.unit.value} kernel {ev.candidate.label()} on {self.problem.experts_hit} experts with "
                f"{rows} rows (SMEM {b.smem_bytes / KiB:.1f} KiB, TMEM {b.tmem_columns} columns, "
                f"{b.cta_tiles} CTA tiles, {b.waves} wave{'s' if b.waves != 1 else ''}")
        return text + (f", {ev.prediction.seconds * 1e6:.1f} us)" if ev.prediction else f"; REJECTED: {ev.reason})")

    def to_dict(self) -> dict:
        return {"rows_lo": self.rows_lo, "rows_hi": self.rows_hi, "experts": self.problem.experts_hit,
                "rows": self.problem.total_rows, "counts": list(self.problem.counts)} | self.evaluation.to_dict()


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One candidate on one problem. launches: () when it runs as one kernel, else each launch (sm_100 mixed
    PAIR); budget is then the whole problem's (coverage, tiles) with the PAIR launch's SMEM/TMEM and the
    waves summed over launches, prediction the sum of both launches."""

    candidate: Candidate
    budget: Budget
    prediction: Prediction | None  # None when a hard limit rejected it
    ok: bool
    reason: str  # why rejected ("" when kept)
    kernel_config: object | None = None  # the kernel family's own config object, where that family exists
    launches: tuple[Launch, ...] = ()

    @property
    def num_launches(self) -> int:
        return max(1, len(self.launches))

    def launch_summary(self) -> str:
        """"1 launch" or "2 launches: pair kernel ..., single kernel ...; X us in all"."""
        if not self.launches:
            return "1 launch"
        text = f"{len(self.launches)} launches: " + ", ".join(launch.describe() for launch in self.launches)
        if self.prediction:
            text += f"; {self.prediction.seconds * 1e6:.1f} us in all (one launch overhead per launch)"
        return text

    def to_dict(self) -> dict:
        d = {"label": self.candidate.label(), "ok": self.ok, "reason": self.reason, "candidate": self.candidate.to_dict()}
        d["budget"] = self.budget.to_dict()
        d["prediction"] = self.prediction.to_dict() if self.prediction else None
        if self.kernel_config is not None:
            d["kernel_config"] = repr(self.kernel_config)
        d["num_launches"] = self.num_launches
        d["launch_summary"] = self.launch_summary()
        if self.launches:
            d["launches"] = [launch.to_dict() for launch in self.launches]
        return d


def _kernel_check(candidate: Candidate, problem: GemmProblem):
    """Build the kernel family's config and ask its can_implement, when that family exists.

    Returns (ok, reason, config or None). Missing family modules are not an error (the planner works alone).
    """
    module = _kernel_module(candidate.arch)
    if module is None:
        return True, "", None
    return _bridge_kernel(module, candidate, problem)


_KERNEL_FAMILIES = {Arch.SM90: ("sm90_grouped_gemm", "Sm90GemmConfig"), Arch.SM100: ("sm100_grouped_gemm", "Sm100GemmConfig")}


@functools.lru_cache(maxsize=None)
def _kernel_module(arch: Arch):
    """The kernel family module of `arch`, or None while it does not exist (or cannot be imported)."""
    name, config_name = _KERNEL_FAMILIES[arch]
    try:
        module = importlib.import_module(f"moe2cta.grouped_gemm.{name}")
    except ImportError:
        return None
    if not hasattr(module, config_name) or not hasattr(module, "can_implement"):
        return None
    return module


def _family_objects(module, candidate: Candidate, problem: GemmProblem):
    """(config, problem) of the kernel family for a planner candidate; ValueError when it has no such config."""
    c, p = candidate, problem
    gated = p.kind is GemmKind.GEMM1
    activation = (p.activation or Activation.SWIGLU) if gated else None
    row_scale = p.has_row_scale and not gated
    stage = GemmStage.GEMM1 if gated else GemmStage.GEMM2
    if c.arch is Arch.SM90:
        import torch

        if c.accumulator_slots != 1:
            raise ValueError(f"accumulator slots {c.accumulator_slots}: cooperative consumers hold one accumulator")
        if (c.epi_n, c.epi_buffers) != (module.EPILOGUE_TILE_N, module.EPILOGUE_SMEM_STAGES):
            raise ValueError(f"epilogue sub-tile {c.epi_n} x {c.epi_buffers} buffers: the family fixes "
                             f"{module.EPILOGUE_TILE_N} x {module.EPILOGUE_SMEM_STAGES}")
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[p.dtype]
        fam_problem = module.Sm90Problem(stage, p.n, p.k, p.num_experts, dtype, activation=activation,
                                         has_bias=p.has_bias, has_row_scale=row_scale)
        # scheduler and raster as the family's default picks them for this problem's rows per expert
        scheduler, raster = module.regular_schedule(c.unit, sum(p.counts) / max(1, p.num_experts),
                                                    n_blocks=-(-p.n // c.block_n), stage=stage)
        config = module.Sm90GemmConfig(tile_m=c.rows_per_cta, tile_n=c.block_n, tile_k=c.block_k, stages=c.stages,
                                       work_unit=c.unit, pair_threshold=c.pair_threshold, scheduler=scheduler,
                                       raster=raster, raster_group_m=module.GROUPED_RASTER_GROUP_M,
                                       padding_rows=module.default_padding_rows(fam_problem, c.rows_per_cta, raster=raster),
                                       epilogue_store=module.default_epilogue_store())
        return config, fam_problem
    if c.rows_per_cta != module.ROWS_PER_CTA:
        raise ValueError(f"{c.rows_per_cta} rows per CTA: the family fixes {module.ROWS_PER_CTA} (TMEM lanes)")
    fam_problem = module.Sm100Problem(stage, p.n, p.k, p.num_experts, p.dtype, activation=activation,
                                      has_bias=p.has_bias, has_row_scale=row_scale)
    config = module.Sm100GemmConfig(unit=c.unit, tile_n=c.block_n, tile_k=c.block_k, stages=c.stages,
                                    accumulator_slots=c.accumulator_slots, pair_threshold=c.pair_threshold,
                                    epi_n=c.epi_n, epi_buffers=c.epi_buffers)
    return config, fam_problem


def _bridge_kernel(module, candidate: Candidate, problem: GemmProblem):
    name = module.__name__.rsplit(".", 1)[-1]
    try:
        config, fam_problem = _family_objects(module, candidate, problem)
    except (ValueError, TypeError) as exc:
        return False, f"kernel {name}: {exc}", None
    ok, reason = module.can_implement(config, fam_problem)
    if not ok:
        return False, f"kernel {name}: {reason}", None
    if candidate.arch is Arch.SM100 and candidate.mixed:  # the second launch: its own layout and stages
        ok, reason = module.can_implement(config.single_fallback(), fam_problem)
        if not ok:
            return False, f"kernel {name}: {reason} (single launch)", None
    return True, "", config


def to_kernel_config(candidate: Candidate, problem: GemmProblem):
    """The kernel family's config object for `candidate` (None while the family is absent).

    Raises ValueError with the family's reason when the family cannot run the candidate.
    """
    module = _kernel_module(candidate.arch)
    if module is None:
        return None
    ok, reason, config = _bridge_kernel(module, candidate, problem)
    if not ok:
        raise ValueError(f"candidate {candidate.label()}: {reason}")
    return config


def evaluate(candidate: Candidate, problem: GemmProblem, hardware: Hardware | None = None, *, use_kernels: bool = True) -> Evaluation:
    """Budget, hard limits, kernel can_implement (where it exists), prediction of one candidate.

    A two-launch candidate (split_launches) is checked and predicted launch by launch.
    """
    hw = hardware or HARDWARE[candidate.arch]
    parts = split_launches(candidate, problem)
    budget = compute_budget(candidate, problem, hw)
    if len(parts) == 1:
        ok, reason = check_limits(candidate, problem, budget)
        config = None
        if ok and use_kernels:
            ok, reason, config = _kernel_check(candidate, problem)
        prediction = _predict_kernel(candidate, problem, budget, hw) if ok else None
        return Evaluation(candidate, budget, prediction, ok, reason, config)
    launches = []
    for (lc, lp, lo, hi), role in zip(parts, ("pair launch", "single launch")):
        lev = evaluate(lc, lp, hw, use_kernels=False)
        if not lev.ok:
            lev = dataclasses.replace(lev, reason=f"{lev.reason} ({role})")
        launches.append(Launch(lp, lo, hi, lev))
    budget = dataclasses.replace(budget, waves=sum(launch.evaluation.budget.waves for launch in launches),
                                 tail_fraction=launches[-1].evaluation.budget.tail_fraction)
    failed = [launch.evaluation for launch in launches if not launch.evaluation.ok]
    ok, reason, config = (False, failed[0].reason, None) if failed else (True, "", None)
    if ok and use_kernels:
        ok, reason, config = _kernel_check(candidate, problem)
    if config is not None:  # each launch's own family config: the PAIR config, then its single_fallback()
        launches = [dataclasses.replace(launch, evaluation=dataclasses.replace(launch.evaluation, kernel_config=cfg))
                    for launch, cfg in zip(launches, (config, config.single_fallback()))]
    prediction = combine_predictions([launch.evaluation.prediction for launch in launches]) if ok else None
    return Evaluation(candidate, budget, prediction, ok, reason, config, tuple(launches))


SM90_TILE_ROWS = (64, 128)
SM100_PAIR_ROWS = (128, 256)
SM100_SINGLE_ROWS = (64, 128)
BLOCK_NS = (64, 128, 192, 256)
BLOCK_KS = (64, 128)
STAGE_RANGE = range(2, 9)


# What the kernel families fix (grouped_gemm/cute_backend.py for sm_90a: cooperative consumers, one
# accumulator per CTA, epilogue sub-tile rows x 32 with 2 staged buffers; sm_100a: sm100_grouped_gemm.py).
FAMILY_DEFAULTS = {
    Arch.SM90: {"accumulator_slots": (1,), "epi_n": 32, "epi_buffers": 2},
    Arch.SM100: {"accumulator_slots": (2, 1), "epi_n": 32, "epi_buffers": 2},
}


def make_candidate(arch: Arch | str, unit: WorkUnit | str, block_m: int, block_n: int, block_k: int, stages: int,
                   *, accumulator_slots: int | None = None, pair_threshold: int = 0) -> Candidate:
    """A candidate with the family's fixed choices (epilogue sub-tile, default accumulator slots)."""
    arch = Arch.parse(arch)
    if isinstance(unit, str):
        try:
            unit = WorkUnit(unit.lower())
        except ValueError:
            raise ValueError(f"unit: expected 'pair' or 'single', got {unit!r}") from None
    d = FAMILY_DEFAULTS[arch]
    slots = accumulator_slots if accumulator_slots is not None else d["accumulator_slots"][0]
    return Candidate(arch, unit, block_m, block_n, block_k, stages, slots, pair_threshold, d["epi_n"], d["epi_buffers"])


def enumerate_candidates(arch: Arch | str, problem: GemmProblem) -> list[Candidate]:
    """Every configuration the families offer; limits are checked later so rejections can be explained."""
    arch = Arch.parse(arch)
    shapes: list[tuple[WorkUnit, int]] = []
    if arch is Arch.SM90:
        for rows in SM90_TILE_ROWS:
            shapes += [(WorkUnit.SINGLE, rows), (WorkUnit.PAIR, 2 * rows)]
    else:
        shapes += [(WorkUnit.SINGLE, r) for r in SM100_SINGLE_ROWS] + [(WorkUnit.PAIR, r) for r in SM100_PAIR_ROWS]
    slots_options = FAMILY_DEFAULTS[arch]["accumulator_slots"]
    out = []
    for unit, block_m in shapes:
        if unit is WorkUnit.SINGLE:
            thresholds = (0,)
        else:
            # pairs for experts that need more than one CTA tile, single tiles for the rest; on sm_90 that is
            # free (same kernel), on sm_100 it is a second launch, so "every expert pairs" (0) competes there.
            mixed = block_m // 2 + 1
            small = any(0 < m < mixed for m in problem.counts)
            thresholds = (mixed, 0) if (arch is Arch.SM100 or small) else (mixed,)
        for threshold in thresholds:
            if threshold and problem.total_rows and all(m < threshold for m in problem.counts):
                continue  # no expert fills a pair: same as a SINGLE kernel
            for bn in BLOCK_NS:
                for bk in BLOCK_KS:
                    for stages in STAGE_RANGE:
                        for slots in slots_options:
                            out.append(make_candidate(arch, unit, block_m, bn, bk, stages,
                                                      accumulator_slots=slots, pair_threshold=threshold))
    return out


@dataclasses.dataclass(frozen=True)
class SearchResult:
    problem: GemmProblem
    hardware: Hardware
    ranked: tuple[Evaluation, ...]  # kept, best first
    rejected: tuple[Evaluation, ...]
    min_coverage_ratio: float

    @property
    def chosen(self) -> Evaluation:
        if not self.ranked:
            raise ValueError(f"{self.problem.name}: no candidate fits (see rejected)")
        return self.ranked[0]

    def rejected_by_reason(self) -> dict[str, list[Evaluation]]:
        """Group rejections by the kind of limit (text before the first ':' or number)."""
        groups: dict[str, list[Evaluation]] = {}
        for ev in self.rejected:
            groups.setdefault(_reason_kind(ev.reason), []).append(ev)
        return groups


def _reason_kind(reason: str) -> str:
    for kind in ("SMEM", "TMEM", "registers", "coverage", "stages", "gated N tile", "kernel", "K=", "block_k",
                 "block_n", "tile rows", "accumulator slots", "epi_n"):
        if reason.startswith(kind):
            return kind
    return reason.split(":")[0]


RANK_TERMS = ("predicted time", "waves", "busy SMs", "L2 bytes", "coverage", "accumulator slots", "stages", "SMEM",
              "single before pair")  # the names of rank_key's terms, in order


def rank_key(ev: Evaluation):
    """Sort key of kept candidates: predicted time, then the tie-breaks named in RANK_TERMS."""
    b, c = ev.budget, ev.candidate
    busy_sms = min(b.cta_tiles, b.num_sms)
    return (ev.prediction.seconds, b.waves, -busy_sms, ev.prediction.l2_bytes, -b.coverage, -c.accumulator_slots,
            -c.stages, b.smem_bytes, c.unit is WorkUnit.PAIR)


def search(
    problem: GemmProblem,
    arch: Arch | str,
    hardware: Hardware | None = None,
    *,
    min_coverage_ratio: float | None = None,
    candidates: Iterable[Candidate] | None = None,
    use_kernels: bool = True,
) -> SearchResult:
    """Enumerate, drop what does not fit or wastes coverage, rank the rest by predicted time."""
    arch = Arch.parse(arch)
    hw = hardware or HARDWARE[arch]
    if hw.arch is not arch:
        raise ValueError(f"hardware: {hw.name} is {hw.arch.value}, expected {arch.value}")
    if min_coverage_ratio is None:
        min_coverage_ratio = hw.min_coverage_ratio
    if not 0.0 <= min_coverage_ratio <= 1.0:
        raise ValueError(f"min_coverage_ratio: expected 0..1, got {min_coverage_ratio}")
    cands = list(candidates) if candidates is not None else enumerate_candidates(arch, problem)
    evals = [evaluate(c, problem, hw, use_kernels=use_kernels) for c in cands]
    fitting = [ev for ev in evals if ev.ok]
    rejected = [ev for ev in evals if not ev.ok]
    kept = []
    if fitting:
        best_cov = max(ev.budget.coverage for ev in fitting)
        floor = min_coverage_ratio * best_cov
        for ev in fitting:
            if ev.budget.coverage < floor:
                rejected.append(dataclasses.replace(ev, ok=False, reason=(
                    f"coverage {ev.budget.coverage:.1%} < {min_coverage_ratio:.0%} of the best "
                    f"feasible {best_cov:.1%} (computes {ev.budget.computed_rows} rows for {ev.budget.useful_rows})")))
            else:
                kept.append(ev)
    kept.sort(key=rank_key)
    return SearchResult(problem, hw, tuple(kept), tuple(rejected), min_coverage_ratio)


@dataclasses.dataclass(frozen=True)
class MoePlan:
    model: str
    tokens: int
    arch: Arch
    gemm1: SearchResult
    gemm2: SearchResult

    def to_dict(self, top: int = 5) -> dict:
        return {
            "model": self.model,
            "tokens": self.tokens,
            "arch": self.arch.value,
            "gemms": [search_to_dict(r, top) for r in (self.gemm1, self.gemm2)],
        }


def plan_moe(preset, tokens: int, arch: Arch | str, *, counts: Sequence[int] | None = None,
             routing_assumption: RoutingAssumption = RoutingAssumption.UNIFORM,
             hardware: Hardware | None = None, min_coverage_ratio: float | None = None) -> MoePlan:
    """Search both GEMMs of one MoE forward of `tokens` tokens (counts, else the routing assumption)."""
    arch = Arch.parse(arch)
    g1, g2 = moe_problems(preset, tokens, counts, routing_assumption)
    r1 = search(g1, arch, hardware, min_coverage_ratio=min_coverage_ratio)
    r2 = search(g2, arch, hardware, min_coverage_ratio=min_coverage_ratio)
    return MoePlan(preset.name, tokens, arch, r1, r2)


# ---------------------------------------------------------------------------------------------------------
# Reports


def best_per_shape(ranked: Sequence[Evaluation]) -> list[Evaluation]:
    """The first (best) evaluation of each (unit, pair_threshold, block_m, block_n, block_k), in rank order."""
    seen, out = set(), []
    for ev in ranked:
        c = ev.candidate
        shape = (c.unit, c.pair_threshold, c.block_m, c.block_n, c.block_k)
        if shape not in seen:
            seen.add(shape)
            out.append(ev)
    return out


def search_to_dict(result: SearchResult, top: int = 5) -> dict:
    p = result.problem
    return {
        "gemm": p.name,
        "kind": p.kind.value,
        "n": p.n,
        "k": p.k,
        "num_experts": p.num_experts,
        "experts_hit": p.experts_hit,
        "total_rows": p.total_rows,
        "routing": p.routing,
        "hardware": dataclasses.asdict(result.hardware) | {"arch": result.hardware.arch.value},
        "min_coverage_ratio": result.min_coverage_ratio,
        "chosen": result.chosen.to_dict() if result.ranked else None,
        "ranked": [ev.to_dict() for ev in result.ranked[:top]],
        "num_kept": len(result.ranked),
        "rejected": [{"label": ev.candidate.label(), "reason": ev.reason} for ev in result.rejected],
    }
