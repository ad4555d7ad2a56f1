"""Epilogue definitions shared by every grouped GEMM family (torch, Triton, CuTe sm90/sm100).

GEMM1 produces gate and up projections of one row; its epilogue turns the pair into one activation value.
GEMM2 may scale each row by the router weight of the slot that row holds. The torch functions here are the
twins every kernel epilogue is checked against; all math is fp32.
"""
from __future__ import annotations

import enum

import torch

__all__ = ["Activation", "SWIGLU_OAI_ALPHA", "SWIGLU_OAI_LIMIT", "apply_activation"]

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
