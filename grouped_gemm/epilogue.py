"""Epilogue definitions shared by every grouped GEMM family (torch, Triton, CuTe sm90/sm100).

GEMM1 produces gate and up projections of one row; its epilogue turns the pair into one activation value.
GEMM2 may scale each row by the router weight of the slot that row holds. The torch functions here are the
twins every kernel epilogue is checked against; all math is fp32. `GemmStage` and `epilogue_name` are the
one definition of which GEMM a kernel runs and how its epilogue is named in kernel keys, bundle file names
and tuning-cache keys (every family uses them; the names must never change, or prebuilt bundles are lost).
`W13Layout` is the row order of GEMM1's weights: the public one, or gate / up interleaved in chunks of
GATE_UP_CHUNK rows so that one weight tile holds the gate and up rows of the same output columns (every
CuTe kernel reads that layout; the Triton kernel reads both).
"""
from __future__ import annotations

import enum

import torch

__all__ = [
    "Activation",
    "GATE_UP_CHUNK",
    "GemmStage",
    "SWIGLU_OAI_ALPHA",
    "SWIGLU_OAI_LIMIT",
    "W13Layout",
    "apply_activation",
    "epilogue_name",
    "gated_activation",
    "pack_gate_up_rows",
    "parse_epilogue_name",
    "unpack_gate_up_rows",
]

SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0
GATE_UP_CHUNK = 8  # rows per gate / up chunk of W13Layout.CHUNKED (the wgmma C layout's 8-column groups)


class Activation(enum.Enum):
    """Gated activation fused into GEMM1's epilogue: out = f(gate, up)."""

    SWIGLU = "swiglu"  # silu(gate) * up
    GELU_GATED = "gelu_gated"  # gelu_erf(gate) * up
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss clamped variant, see apply_activation

    @classmethod
    def parse(cls, value: "Activation | str") -> "Activation":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower() or member.name == value.upper():
                    return member
        raise ValueError(
            f"activation: expected one of {[m.value for m in cls]}, got {value!r}"
        )


class GemmStage(enum.Enum):
    """Which grouped GEMM of the MoE layer; fixes the epilogue and the output width."""

    GEMM1 = "gemm1"  # a1 @ w13.T (+ b13) -> gated activation of (gate, up) pairs -> [M, I]
    GEMM2 = "gemm2"  # (a2 @ w2.T (+ b2)) * optional per-row router weight -> [M, H]


def epilogue_name(stage: GemmStage, activation: "Activation | None", has_row_scale: bool, has_bias: bool) -> str:
    """The epilogue's name in kernel keys: the activation (GEMM1) or "plain" (GEMM2), then "_rowscale", "_bias".

    GEMM1 needs an activation; GEMM2 ignores `activation`. Families reject invalid combinations
    (a GEMM1 row scale, a GEMM2 activation) in their own checks, before a key is made.
    """
    if not isinstance(stage, GemmStage):
        raise TypeError(f"stage: expected a GemmStage, got {stage!r}")
    name = Activation.parse(activation).value if stage is GemmStage.GEMM1 else "plain"
    if has_row_scale:
        name += "_rowscale"
    if has_bias:
        name += "_bias"
    return name


def parse_epilogue_name(name: str) -> "tuple[GemmStage, Activation | None, bool, bool]":
    """(stage, activation, has_row_scale, has_bias) whose epilogue_name is `name` (ValueError for any other)."""
    for stage in GemmStage:
        for activation in (Activation if stage is GemmStage.GEMM1 else (None,)):
            for has_row_scale in (False, True):
                for has_bias in (False, True):
                    if epilogue_name(stage, activation, has_row_scale, has_bias) == name:
                        return stage, activation, has_row_scale, has_bias
    raise ValueError(f"name: {name!r} is no epilogue name (an activation or 'plain', then '_rowscale', '_bias')")


def apply_activation(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """fp32 twin of the fused epilogue. gate and up have the same shape; returns fp32."""
    return gated_activation(gate.float(), up.float(), activation)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The gated activation as torch ops in gate's and up's own dtype (each op rounds to it). gate and up have the
    same shape and dtype."""
    activation = Activation.parse(activation)
    if activation is Activation.SWIGLU:
        return torch.nn.functional.silu(gate) * up
    if activation is Activation.GELU_GATED:
        return torch.nn.functional.gelu(gate) * up
    if activation is Activation.SWIGLU_OAI:
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (up + 1.0) * (gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate))
    raise ValueError(f"activation: unknown {activation!r}")


class W13Layout(enum.Enum):
    """Row order of w13 [E, 2I, H] (and of b13 [E, 2I])."""

    GATE_THEN_UP = "gate_then_up"  # the public layout: I gate rows, then the I up rows
    # GATE_UP_CHUNK gate rows, then the matching GATE_UP_CHUNK up rows, repeated (pack_gate_up_rows):
    # packed rows [2 * c0, 2 * c1) hold the gate and up rows of output columns [c0, c1) for chunk-aligned c0, c1
    CHUNKED = "chunked"


def _gate_up_chunks(x: torch.Tensor) -> int:
    """Chunks of GATE_UP_CHUNK gate + GATE_UP_CHUNK up rows in x [E, 2I, ...]; bad shapes name w13."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise TypeError(f"w13: expected a tensor [E, 2I, ...], got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[1] % (2 * GATE_UP_CHUNK):
        raise ValueError(f"w13: expected 2I a multiple of {2 * GATE_UP_CHUNK}, got {x.shape[1]}")
    return x.shape[1] // (2 * GATE_UP_CHUNK)


def pack_gate_up_rows(x: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] in GATE_THEN_UP order -> a new contiguous tensor in CHUNKED order (once at weight load)."""
    chunks = _gate_up_chunks(x)
    halves = x.reshape(x.shape[0], 2, chunks, GATE_UP_CHUNK, *x.shape[2:])  # (gate | up, chunk, row in chunk)
    return halves.transpose(1, 2).reshape(x.shape).contiguous()


def unpack_gate_up_rows(x: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_gate_up_rows: CHUNKED order -> a new contiguous tensor in GATE_THEN_UP order."""
    chunks = _gate_up_chunks(x)
    packed = x.reshape(x.shape[0], chunks, 2, GATE_UP_CHUNK, *x.shape[2:])  # (chunk, gate | up, row in chunk)
    return packed.transpose(1, 2).reshape(x.shape).contiguous()
