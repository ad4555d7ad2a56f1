"""Torch twin of the grouped GEMMs over the padded expert-order layout (docs/design.md).

For each local expert e, the valid rows are [row_offsets[e], row_offsets[e] + counts[e]). Rows outside
every expert's valid range are left as they are in `out` (callers never read them). fp32 accumulation: the matmuls
run at torch's "highest" fp32 precision whatever the process set (`fp32_matmuls`; "high" would run them in TF32 on a
GPU, "medium" in bf16 on a CPU with bf16 units).
"""
from __future__ import annotations

import contextlib

import torch

from .epilogue import Activation, apply_activation

__all__ = ["fp32_matmuls", "grouped_gemm1_reference", "grouped_gemm2_reference"]


@contextlib.contextmanager
def fp32_matmuls():
    """fp32 matmuls at torch's "highest" precision inside, the process's setting restored after. A process that set
    the per-backend switches (torch >= 2.9: `torch.backends.cuda.matmul.fp32_precision = "tf32"`; torch then refuses
    the global query) gets each of them set to "ieee" and restored. The setting is process-wide: two threads inside
    at once may leave the other's matmuls at the process's precision."""
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # the new per-backend API is in use
        precision = None
    if precision == "highest":
        yield
        return
    if precision is not None:
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(precision)
        return
    switches = [b.matmul for b in (torch.backends.cuda, torch.backends.mkldnn) if hasattr(b, "matmul")]
    saved = [s.fp32_precision for s in switches]
    try:
        for switch in switches:
            switch.fp32_precision = "ieee"
        yield
    finally:
        for switch, value in zip(switches, saved):
            switch.fp32_precision = value


def _valid_ranges(row_offsets: torch.Tensor, counts: torch.Tensor):
    starts = row_offsets[:-1].tolist()
    sizes = counts.tolist()
    return [(e, s, n) for e, (s, n) in enumerate(zip(starts, sizes)) if n > 0]


def grouped_gemm1_reference(
    a: torch.Tensor,
    w13: torch.Tensor,
    row_offsets: torch.Tensor,
    counts: torch.Tensor,
    activation: Activation = Activation.SWIGLU,
    b13: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """a [max_rows, H], w13 [E, 2I, H] (gate rows then up rows) -> act [max_rows, I] in a.dtype."""
    intermediate = w13.shape[1] // 2
    if out is None:
        out = torch.zeros(a.shape[0], intermediate, dtype=a.dtype, device=a.device)
    with fp32_matmuls():
        for e, start, n in _valid_ranges(row_offsets, counts):
            h = a[start : start + n].float() @ w13[e].float().t()
            if b13 is not None:
                h = h + b13[e].float()
            out[start : start + n] = apply_activation(h[:, :intermediate], h[:, intermediate:], activation).to(out.dtype)
    return out


def grouped_gemm2_reference(
    a: torch.Tensor,
    w2: torch.Tensor,
    row_offsets: torch.Tensor,
    counts: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """a [max_rows, I], w2 [E, H, I] -> y [max_rows, H] in a.dtype; y[r] *= row_scale[r] when given."""
    if out is None:
        out = torch.zeros(a.shape[0], w2.shape[1], dtype=a.dtype, device=a.device)
    with fp32_matmuls():
        for e, start, n in _valid_ranges(row_offsets, counts):
            y = a[start : start + n].float() @ w2[e].float().t()
            if b2 is not None:
                y = y + b2[e].float()
            if row_scale is not None:
                y = y * row_scale[start : start + n].float().unsqueeze(1)
            out[start : start + n] = y.to(out.dtype)
    return out
