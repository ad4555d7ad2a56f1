"""Resource accounting shared by the CuTe kernel families and the planner (the seed's "do the budget first").

Pure Python, no GPU. Each kernel family states its own layout (what one pipeline stage holds per CTA, what
the epilogue reserves) with these functions, so the planner and the kernel read the same numbers.

Work units: a PAIR is two CTAs of a (2,1,1) cluster on one 2*BM_cta-row tile of one expert, sharing the
weight tile (sm_100: each CTA keeps half of B, tcgen05.mma.cta_group::2; sm_90: each CTA loads half of B
and multicasts it, so each CTA still holds all of B in its SMEM). A SINGLE is one CTA on its own tile.
"""
from __future__ import annotations

import dataclasses
import enum

__all__ = [
    "Arch",
    "WorkUnit",
    "ArchLimits",
    "ARCH_LIMITS",
    "input_bytes_per_stage",
    "max_stages",
    "MBARRIER_BYTES",
    "barrier_bytes",
    "epilogue_smem_bytes",
    "tmem_columns",
    "tmem_allocation_columns",
]


class Arch(enum.Enum):
    SM90 = "sm_90a"
    SM100 = "sm_100a"

    @classmethod
    def parse(cls, value: "Arch | str") -> "Arch":
        if isinstance(value, cls):
            return value
        for member in cls:
            if str(value).lower() in (member.value, member.value.rstrip("a"), member.name.lower()):
                return member
        raise ValueError(f"arch: expected one of {[m.value for m in cls]}, got {value!r}")


class WorkUnit(enum.Enum):
    PAIR = "pair"
    SINGLE = "single"


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    smem_per_cta: int  # bytes of dynamic shared memory one CTA may use
    num_sms: int
    tmem_columns: int  # 0 where there is no TMEM
    max_cluster: int


ARCH_LIMITS = {
    # H100/H200: 227 KiB opt-in shared memory per block, 132 SMs.
    Arch.SM90: ArchLimits(smem_per_cta=227 * 1024, num_sms=132, tmem_columns=0, max_cluster=8),
    # B200: 227 KiB per block, 148 SMs, 512 TMEM columns of 128 lanes x 32 bit per SM.
    Arch.SM100: ArchLimits(smem_per_cta=227 * 1024, num_sms=148, tmem_columns=512, max_cluster=16),
}


def input_bytes_per_stage(
    block_m: int, block_n: int, block_k: int, elem_bytes: int, unit: WorkUnit, arch: Arch
) -> int:
    """SMEM bytes of A and B one CTA holds per pipeline stage.

    block_m, block_n are the tile of the whole work unit (for a PAIR: both CTAs together, block_m rows).
    """
    if unit is WorkUnit.SINGLE:
        return (block_m * block_k + block_n * block_k) * elem_bytes
    a_rows = block_m // 2
    if arch is Arch.SM100:
        b_cols = block_n // 2  # 2-CTA MMA: B split by columns across the pair
    else:
        b_cols = block_n  # multicast: every receiver keeps its own copy of the whole B tile
    return (a_rows * block_k + b_cols * block_k) * elem_bytes


def max_stages(per_stage_bytes: int, reserved_bytes: int, arch: Arch, barrier_bytes_per_stage: int = 16) -> int:
    """Largest stage count whose buffers fit next to `reserved_bytes` (epilogue, scheduler, barriers)."""
    budget = ARCH_LIMITS[arch].smem_per_cta - reserved_bytes
    return max(0, budget // (per_stage_bytes + barrier_bytes_per_stage))


# ---- appended by the planner (issue 6): accounting beyond the A/B stages; append-only below ----

MBARRIER_BYTES = 8  # one mbarrier object in SMEM


def barrier_bytes(stages: int, accumulator_slots: int = 0, extra_barriers: int = 0) -> int:
    """SMEM bytes of mbarriers: a full/empty pair per input stage and per accumulator slot, plus extras
    (scheduler, TMEM handshake)."""
    return (2 * stages + 2 * accumulator_slots + extra_barriers) * MBARRIER_BYTES


def epilogue_smem_bytes(rows_per_cta: int, epi_n: int, out_elem_bytes: int, buffers: int) -> int:
    """SMEM staging the epilogue writes before a TMA store: `buffers` sub-tiles of rows_per_cta x epi_n."""
    return rows_per_cta * epi_n * out_elem_bytes * buffers


def tmem_columns(block_n: int, accumulator_slots: int) -> int:
    """TMEM columns one CTA uses for fp32 accumulators on sm_100 (128 lanes x 32 bit per column).

    Each CTA holds at most 128 rows of the tile (a PAIR's 256-row tile puts 128 in each CTA), so one
    accumulator slot takes block_n columns whatever the work unit; slots are double-buffered accumulators.
    """
    return block_n * accumulator_slots


def tmem_allocation_columns(columns: int) -> int:
    """Columns tcgen05.alloc actually reserves: a power of two, at least 32."""
    alloc = 32
    while alloc < columns:
        alloc *= 2
    return alloc
