"""The physical floor of one MoE layer call, the card's ceilings, and the project's targets.

floor = max(memory time, compute time), as in shared/bench/peers-h200-2026-11-29.md:
- memory: bytes of the experts hit (w13 + w2, and their biases when the model has them) plus the
  activations (hidden states read once, output written once, both in the activation dtype), over the
  copy bandwidth;
- compute: 2 * T * k * 3 * H * I FLOPs (GEMM1 is 2I x H, GEMM2 is H x I per routed row), over the peak
  of a large bf16 matmul.
The floors use the ceilings the targets are defined with, the H200 figures of the peers file (4.24 TB/s,
792 TFLOP/s), unless asked otherwise (FloorCeilings.MEASURED, or figures given). The ceilings measured on the card
at start (a device-to-device copy, counting bytes read + written; an 8192^3 bf16 matmul) are recorded beside: the
matmul's figure moves by several percent from start to start (760-817 TFLOP/s on the same kind of card), so floors
from it made runs incomparable (up to stop 51 they did).
"""
from __future__ import annotations

import dataclasses
import enum

import torch

from moe2cta.presets import ModelPreset

__all__ = [
    "CeilingSource",
    "FloorCeilings",
    "Ceilings",
    "DEFAULT_CEILINGS",
    "measure_ceilings",
    "Floor",
    "moe_floor",
    "Phase",
    "phase_of",
    "Targets",
    "TARGETS",
]

DEFAULT_BANDWIDTH = 4.24e12  # bytes/s, H200 device-to-device copy (peers file)
DEFAULT_MATMUL_FLOPS = 792e12  # FLOP/s, H200 8192^3 bf16 matmul (peers file)


class CeilingSource(enum.Enum):
    MEASURED = "measured on this card"
    DEFAULT = "the targets' (H200 figures of the peers file)"
    USER = "given on the command line"


class FloorCeilings(enum.Enum):
    """Which ceilings a run's floors use."""

    TARGETS = "targets"  # 4.24 TB/s, 792 TFLOP/s: what the targets and the peer figures are defined with
    MEASURED = "measured"  # this card's, measured at the run's start


@dataclasses.dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s
    source: CeilingSource

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.matmul_flops > 0):
            raise ValueError(f"ceilings: expected positive bandwidth and FLOP/s, got {self.bandwidth}, {self.matmul_flops}")

    def describe(self) -> str:
        return f"{self.bandwidth / 1e12:.2f} TB/s copy, {self.matmul_flops / 1e12:.0f} TFLOP/s bf16 ({self.source.value})"


DEFAULT_CEILINGS = Ceilings(DEFAULT_BANDWIDTH, DEFAULT_MATMUL_FLOPS, CeilingSource.DEFAULT)


def _median_event_ms(fn, iters: int) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def measure_ceilings(device: torch.device, *, copy_bytes: int = 1 << 30, matmul_size: int = 8192) -> Ceilings:
    """Copy bandwidth and bf16 matmul peak of the CUDA `device` (median of 20 after 5 warm-up runs)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: measuring ceilings needs a CUDA device, got {device}")
    with torch.cuda.device(device):
        src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
        dst = torch.empty_like(src)
        for _ in range(5):
            dst.copy_(src)
        copy_ms = _median_event_ms(lambda: dst.copy_(src), 20)
        del src, dst
        a = torch.randn(matmul_size, matmul_size, dtype=torch.bfloat16, device=device)
        b = torch.randn(matmul_size, matmul_size, dtype=torch.bfloat16, device=device)
        c = torch.empty_like(a)
        for _ in range(5):
            torch.matmul(a, b, out=c)
        mm_ms = _median_event_ms(lambda: torch.matmul(a, b, out=c), 20)
        del a, b, c
        torch.cuda.empty_cache()
    bandwidth = 2 * (copy_bytes // 2) * 2 / (copy_ms * 1e-3)
    flops = 2 * matmul_size**3 / (mm_ms * 1e-3)
    return Ceilings(bandwidth, flops, CeilingSource.MEASURED)


@dataclasses.dataclass(frozen=True)
class Floor:
    weight_bytes: int
    activation_bytes: int
    flops: int
    memory_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def us(self) -> float:
        return self.seconds * 1e6

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def moe_floor(preset: ModelPreset, num_tokens: int, experts_hit: float, ceilings: Ceilings, elem_bytes: int = 2) -> Floor:
    """Floor of one layer call with `num_tokens` tokens whose routing hit `experts_hit` experts."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens: expected >= 0, got {num_tokens}")
    if not 0 <= experts_hit <= preset.num_experts:
        raise ValueError(f"experts_hit: expected 0..{preset.num_experts}, got {experts_hit}")
    h, i = preset.hidden, preset.intermediate
    per_expert = 3 * h * i * elem_bytes
    if preset.has_bias:
        per_expert += (2 * i + h) * elem_bytes
    weight_bytes = round(experts_hit * per_expert)
    activation_bytes = 2 * num_tokens * h * elem_bytes
    flops = 2 * num_tokens * preset.top_k * 3 * h * i
    return Floor(
        weight_bytes,
        activation_bytes,
        flops,
        (weight_bytes + activation_bytes) / ceilings.bandwidth,
        flops / ceilings.matmul_flops,
    )


class Phase(enum.Enum):
    DECODE = "decode"  # T <= 512
    MIDDLE = "middle"  # 512 < T < 2048: only the worst-cell target applies
    PREFILL = "prefill"  # T >= 2048


def phase_of(num_tokens: int) -> Phase:
    if num_tokens <= 512:
        return Phase.DECODE
    if num_tokens >= 2048:
        return Phase.PREFILL
    return Phase.MIDDLE


@dataclasses.dataclass(frozen=True)
class Targets:
    """The project's targets for time / floor (issue 7)."""

    decode: float = 1.10
    prefill: float = 1.25
    worst: float = 1.35

    def for_tokens(self, num_tokens: int) -> float:
        phase = phase_of(num_tokens)
        if phase is Phase.DECODE:
            return self.decode
        if phase is Phase.PREFILL:
            return self.prefill
        return self.worst

    def describe(self) -> str:
        return (
            f"decode T<=512: <= {self.decode:.2f}x floor; prefill T>=2048: <= {self.prefill:.2f}x; "
            f"worst cell: <= {self.worst:.2f}x"
        )


TARGETS = Targets()
