"""Epilogue definitions shared by every grouped GEMM family (torch, Triton, CuTe sm90/sm100).

GEMM1 produces gate and up projections of one row; its epilogue turns the pair into one activation value.
GEMM2 may scale each row by the router weight of the slot that row holds. The torch functions here are the
twins every kernel epilogue is checked against; all math is fp32. `GemmStage` and `epilogue_name` are the
one definition of which GEMM a kernel runs and how its epilogue is named in kernel keys, bundle file names
and tuning-cache keys (every family uses them; the names must never change, or prebuilt bundles are lost).
"""
from __future__ import annotations

import enum

import torch

__all__ = ["Activation", "GemmStage", "SWIGLU_OAI_ALPHA", "SWIGLU_OAI_LIMIT", "apply_activation", "epilogue_name"]

SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


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


def apply_activation(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """fp32 twin of the fused epilogue. gate and up have the same shape; returns fp32."""
    gate = gate.float()
    up = up.float()
    if activation is Activation.SWIGLU:
        return torch.nn.functional.silu(gate) * up
    if activation is Activation.GELU_GATED:
        return torch.nn.functional.gelu(gate) * up
    if activation is Activation.SWIGLU_OAI:
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (up + 1.0) * (gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate))
    raise ValueError(f"activation: unknown {activation!r}")
