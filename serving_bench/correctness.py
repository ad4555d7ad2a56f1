"""Checking a backend's output against the fp32 reference before it is timed.

The reference is the whole layer after routing, in fp32, on every token row (the benchmark's default) or on a sample
of them (a token's output depends only on that token, so a sample checks a large call cheaply, but misses a fault
confined to a few rows). The tolerance is
twice the error of a same-dtype (bf16) torch run of the same math on the same rows, with a small floor,
measured as a relative Frobenius error. A second bound catches a fault confined to a few rows, which the Frobenius
error over many rows dilutes (one zero row in 32768 moves it by 0.3%): every row's own relative error must stay within
ROW_TOLERANCE_FACTOR times the worst row of the same-dtype run (each row's error over its norm, or over a tenth of the
median row norm where its own is smaller). Rows whose top-k is ambiguous (selection margin near zero, see
routing_twin) are left out: a correct router may pick the other expert there.
"""
from __future__ import annotations

import dataclasses
import enum

import torch

from moe2cta.grouped_gemm import Activation, apply_activation
from moe2cta.grouped_gemm.reference import fp32_matmuls

__all__ = ["CheckStatus", "Verdict", "sample_rows", "moe_rows", "ReferenceRows", "AmbiguousRows", "make_reference",
           "check_output"]

AMBIGUOUS_MARGIN = 1e-6  # selection-score gap (fp32 units) under which a row's top-k is ambiguous
# relative Frobenius error always accepted, per activation dtype (bf16 has 8 mantissa bits)
MIN_TOLERANCE = {torch.bfloat16: 2e-3, torch.float16: 5e-4, torch.float32: 1e-5}
TOLERANCE_FACTOR = 2.0
ROW_TOLERANCE_FACTOR = 3.0  # of the same-dtype run's worst row (the most extreme of many rows: more headroom)


class CheckStatus(enum.Enum):
    PASS = "pass"
    FAIL = "fail"


@dataclasses.dataclass(frozen=True)
class Verdict:
    status: CheckStatus
    rel_err: float  # over every checked row (NaN where the output could not be compared)
    tolerance: float
    rows_checked: int
    rows_ambiguous: int
    reason: str = ""
    row_err: float | None = None  # the worst checked row's error (None where the whole-output check decided)
    row_tolerance: float | None = None

    @property
    def margin_used(self) -> float:
        """The larger of rel_err / tolerance and row_err / row_tolerance (inf where nothing could be compared)."""
        if self.rel_err != self.rel_err:
            return float("inf")
        used = self.rel_err / self.tolerance
        if self.row_err is not None and self.row_tolerance:
            used = max(used, self.row_err / self.row_tolerance)
        return used


def sample_rows(num_tokens: int, max_rows: int | None, device) -> torch.Tensor:
    """Evenly spaced token indices (all of them when max_rows is None or num_tokens <= max_rows), first and last
    included."""
    if max_rows is None or num_tokens <= max_rows:
        return torch.arange(num_tokens, device=device)
    return torch.linspace(0, num_tokens - 1, max_rows, device=device).round().long().unique()


def moe_rows(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The MoE layer after routing for the rows of `hidden` [n, H] -> fp32 [n, H].

    compute_dtype fp32: exact reference. bf16/fp16: a same-dtype run (GEMM outputs, activation and the
    second GEMM's input rounded to that dtype; router weights and the combine in fp32).
    """
    intermediate = w2.shape[2]
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_rows = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1).float()
    for expert in torch.unique(flat_ids).tolist():
        pick = (flat_ids == expert).nonzero().squeeze(1)
        rows = flat_rows[pick]
        x = hidden[rows].to(compute_dtype)
        h = x @ w13[expert].to(compute_dtype).t()
        if b13 is not None:
            h = h + b13[expert].to(compute_dtype)
        a = apply_activation(h[:, :intermediate], h[:, intermediate:], activation).to(compute_dtype)
        y = a @ w2[expert].to(compute_dtype).t()
        if b2 is not None:
            y = y + b2[expert].to(compute_dtype)
        out.index_add_(0, rows, y.float() * flat_weights[pick].unsqueeze(1))
    if compute_dtype != torch.float32:
        out = out.to(compute_dtype).float()
    return out


@dataclasses.dataclass(frozen=True)
class ReferenceRows:
    rows: torch.Tensor  # token indices checked (ambiguous ones removed)
    expected: torch.Tensor  # fp32 [len(rows), H]
    tolerance: float
    twin_err: float  # relative error of the same-dtype run
    rows_ambiguous: int
    row_tolerance: float = float("inf")  # bound on any one row's relative error (module docstring)
    twin_row_err: float = 0.0  # the same-dtype run's worst row


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    denom = float(torch.linalg.vector_norm(expected))
    return float(torch.linalg.vector_norm(got.float() - expected)) / max(denom, 1e-30)


def _row_errs(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Each row's relative error: over its norm, or over a tenth of the median row norm where its own is smaller."""
    norms = torch.linalg.vector_norm(expected, dim=1)
    floor = 0.1 * float(norms.median()) if norms.numel() else 0.0
    return torch.linalg.vector_norm(got.float() - expected, dim=1) / norms.clamp_min(max(floor, 1e-30))


class AmbiguousRows(ValueError):
    """Every row make_reference would check has an ambiguous top-k: no backend can be checked on this input."""


def make_reference(hidden, weights, routed, activation: Activation, *, max_rows: int | None = None) -> ReferenceRows:
    """fp32 expected rows (every row, or max_rows evenly spaced ones) and the tolerance for one input; `routed` comes
    from routing_twin.route_twin."""
    rows = sample_rows(hidden.shape[0], max_rows, hidden.device)
    clear = routed.margin[rows] > AMBIGUOUS_MARGIN
    ambiguous = int((~clear).sum())
    rows = rows[clear]
    if rows.numel() == 0:
        raise AmbiguousRows("hidden: every sampled row has an ambiguous top-k; use another seed")
    args = (weights.w13, weights.w2, routed.topk_weights[rows], routed.topk_ids[rows], activation, weights.b13, weights.b2)
    with fp32_matmuls():  # an fp32 reference must not run in TF32
        expected = moe_rows(hidden[rows], *args, compute_dtype=torch.float32)
        twin = moe_rows(hidden[rows], *args, compute_dtype=hidden.dtype)
    twin_err = _rel_err(twin, expected)
    floor = MIN_TOLERANCE.get(hidden.dtype, 2e-3)
    tolerance = max(TOLERANCE_FACTOR * twin_err, floor)
    twin_row_err = float(_row_errs(twin, expected).max())
    row_tolerance = max(ROW_TOLERANCE_FACTOR * twin_row_err, tolerance, floor)
    return ReferenceRows(rows, expected, tolerance, twin_err, ambiguous, row_tolerance, twin_row_err)


def check_output(out: torch.Tensor, reference: ReferenceRows, num_tokens: int, hidden_size: int) -> Verdict:
    """Compare a backend's full output [T, H] with the reference rows."""
    n = int(reference.rows.numel())
    if not isinstance(out, torch.Tensor):
        return Verdict(CheckStatus.FAIL, float("nan"), reference.tolerance, n, reference.rows_ambiguous,
                       f"returned {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != (num_tokens, hidden_size):
        return Verdict(CheckStatus.FAIL, float("nan"), reference.tolerance, n, reference.rows_ambiguous,
                       f"output shape {tuple(out.shape)}, expected {(num_tokens, hidden_size)}")
    got = out[reference.rows].float()
    if not bool(torch.isfinite(got).all()):
        return Verdict(CheckStatus.FAIL, float("nan"), reference.tolerance, n, reference.rows_ambiguous,
                       "output has NaN/Inf")
    err = _rel_err(got, reference.expected)
    if err > reference.tolerance:
        return Verdict(CheckStatus.FAIL, err, reference.tolerance, n, reference.rows_ambiguous,
                       f"relative error {err:.2e} > tolerance {reference.tolerance:.2e}")
    row_errs = _row_errs(got, reference.expected)
    worst = int(row_errs.argmax()) if row_errs.numel() else 0
    row_err = float(row_errs[worst]) if row_errs.numel() else 0.0
    if row_err > reference.row_tolerance:
        return Verdict(CheckStatus.FAIL, err, reference.tolerance, n, reference.rows_ambiguous,
                       f"token row {int(reference.rows[worst])}: relative error {row_err:.2e} > row "
                       f"tolerance {reference.row_tolerance:.2e} (the same-dtype run's worst row: "
                       f"{reference.twin_row_err:.2e})", row_err, reference.row_tolerance)
    return Verdict(CheckStatus.PASS, err, reference.tolerance, n, reference.rows_ambiguous, "", row_err,
                   reference.row_tolerance)
