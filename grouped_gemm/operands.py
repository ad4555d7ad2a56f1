"""Operand checks shared by the grouped GEMM families' host wrappers (sm90, sm100, Triton). Torch only, no values read."""
from __future__ import annotations

import torch

__all__ = ["byte_span", "require_own_memory"]


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, one past the last) byte address of t's elements: its strides' reach (t.numel() elements when
    contiguous); (p, p) for an empty tensor."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    elements = t.numel() if t.is_contiguous() else 1 + sum(
        (size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + elements * t.element_size()


def require_own_memory(out: torch.Tensor, **reads) -> None:
    """ValueError naming the first of `reads` (operand name -> tensor or None) whose memory `out` overlaps: a grouped
    GEMM reads its operands while other CTAs / programs store out, so an overlap would feed them outputs."""
    if out.numel() == 0:
        return
    out_start, out_end = byte_span(out)
    for name, tensor in reads.items():
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            start, end = byte_span(tensor)
            if out_start < end and start < out_end:
                raise ValueError(f"out: expected memory of its own, got one that overlaps {name} (the GEMM reads "
                                 f"{name} while it writes out)")
