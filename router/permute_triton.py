"""Gather and combine kernels (Triton): hidden rows into expert order, and expert outputs back to tokens.

gather_kernel: grid (cdiv(T*k, BLOCK_S), cdiv(H, BLOCK_H)). A program takes a block of slots s = t*k + j,
  reads slot_rows[s] (padded row or -1) and copies hidden[s // k, h-block] to a1[row, h-block], optionally
  times scale[s] (fp32 math, rounded once to the activation dtype); with ROW_WEIGHTS the programs of the first
  h-block also write row_weights[row] = slot_weights[s] (GEMM2's per-row router weight, no extra launch).
  Work is per slot, so the grid is static (T*k) and never walks the padding rows: they are left untouched
  (docs/design.md allows it). With PAD_TOKEN_ROW (GatherPadding.TOKEN_ROW) the grid has cdiv(max_rows,
  BLOCK_P) more programs along axis 0, each over BLOCK_P padded rows: rows below row_offsets[E] whose
  sorted_slots entry is -1 (an expert's padding) get a copy of hidden[0] (the padding programs never touch
  the rows the slot programs write). Rows are
  contiguous in H: with H a multiple of 8 (bf16/fp16) Triton issues 16-byte vector loads and stores.
combine_kernel: grid (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H)). A program owns a block of tokens and columns
  and loops j = 0 .. k-1 in order: acc += w[t, j] * y[slot_rows[t*k+j]] in fp32, slots with row -1 add
  nothing (even with a NaN weight). One writer per output element and a fixed order: bit-stable runs.
row_weights_kernel: grid (cdiv(T*k, BLOCK),): row_weights[slot_rows[s]] = slot_weights[s] (gather_kernel's
  ROW_WEIGHTS part alone, for a GEMM1 that reads the token rows itself).
Router weights (scale, slot_weights, w) of any float dtype are read as they are and widened to fp32 on load.
No shared memory, no atomics. Limits: hidden / y / out contiguous rows (stride in H of 1).
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from . import routing_triton
from .config import next_pow2

__all__ = ["jit_functions", "permute_launch_params", "ROW_WEIGHTS_BLOCK", "GATHER_SLOTS_PER_PROGRAM",
           "COMBINE_TOKENS_PER_PROGRAM"]


def gather_kernel(
    hidden_ptr, scale_ptr, slot_rows_ptr, a1_ptr, slot_weights_ptr, row_weights_ptr, num_slots, hidden_size,
    stride_hidden, stride_a1, sorted_slots_ptr, row_offsets_ptr, num_experts, num_slot_programs,
    TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
    ROW_WEIGHTS: tl.constexpr = False, DEPENDENT_LAUNCH: tl.constexpr = 0, PAD_TOKEN_ROW: tl.constexpr = False,
    BLOCK_P: tl.constexpr = 32,
):
    if DEPENDENT_LAUNCH >= 1:  # programmatic dependent launch: wait for the previous kernel's results
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:  # a small launch: the next kernel's grid may start now (else: as blocks exit)
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden_size
    if PAD_TOKEN_ROW:
        if tl.program_id(0) >= num_slot_programs:
            _pad_token_rows(hidden_ptr, a1_ptr, sorted_slots_ptr, row_offsets_ptr, num_experts, stride_a1, cols,
                            col_ok, tl.program_id(0) - num_slot_programs, BLOCK_P, BLOCK_H)
        else:
            _gather_slot_block(hidden_ptr, scale_ptr, slot_rows_ptr, a1_ptr, slot_weights_ptr, row_weights_ptr,
                               num_slots, stride_hidden, stride_a1, cols, col_ok, TOP_K, HAS_SCALE, BLOCK_S,
                               ROW_WEIGHTS)
    else:
        _gather_slot_block(hidden_ptr, scale_ptr, slot_rows_ptr, a1_ptr, slot_weights_ptr, row_weights_ptr,
                           num_slots, stride_hidden, stride_a1, cols, col_ok, TOP_K, HAS_SCALE, BLOCK_S, ROW_WEIGHTS)


def _gather_slot_block(hidden_ptr, scale_ptr, slot_rows_ptr, a1_ptr, slot_weights_ptr, row_weights_ptr, num_slots,
                       stride_hidden, stride_a1, cols, col_ok, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
                       BLOCK_S: tl.constexpr, ROW_WEIGHTS: tl.constexpr):
    """Program (slot block, h-block) of gather_kernel: hidden[s // k] (* scale[s]) -> a1[slot_rows[s]]."""
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    slot_ok = slots < num_slots
    rows = tl.load(slot_rows_ptr + slots, mask=slot_ok, other=-1)
    valid = rows >= 0
    tokens = slots // TOP_K
    m = valid[:, None] & col_ok[None, :]
    x = tl.load(hidden_ptr + tokens.to(tl.int64)[:, None] * stride_hidden + cols[None, :], mask=m, other=0.0)
    if HAS_SCALE:
        s = tl.load(scale_ptr + slots, mask=valid, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * s[:, None]).to(a1_ptr.dtype.element_ty)
    tl.store(a1_ptr + rows.to(tl.int64)[:, None] * stride_a1 + cols[None, :], x, mask=m)
    if ROW_WEIGHTS:
        if tl.program_id(1) == 0:
            w = tl.load(slot_weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)  # any float dtype
            tl.store(row_weights_ptr + rows.to(tl.int64), w, mask=valid)


def _pad_token_rows(hidden_ptr, a1_ptr, sorted_slots_ptr, row_offsets_ptr, num_experts, stride_a1, cols, col_ok,
                    block, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """Padding program `block` of gather_kernel: hidden[0] -> the expert padding rows among its BLOCK_P rows."""
    rows = block * BLOCK_P + tl.arange(0, BLOCK_P)
    in_use = rows < tl.load(row_offsets_ptr + num_experts)  # rows past the last expert's tiles: no GEMM reads them
    slots = tl.load(sorted_slots_ptr + rows, mask=in_use, other=0)
    pad = in_use & (slots < 0)
    x = tl.load(hidden_ptr + cols, mask=col_ok, other=0.0)
    tile = tl.broadcast_to(x[None, :], (BLOCK_P, BLOCK_H))
    tl.store(a1_ptr + rows.to(tl.int64)[:, None] * stride_a1 + cols[None, :], tile, mask=pad[:, None] & col_ok[None, :])


def combine_kernel(
    y_ptr, weights_ptr, slot_rows_ptr, out_ptr, num_tokens, hidden_size, stride_y, stride_out,
    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr = 0,
):
    if DEPENDENT_LAUNCH >= 1:  # programmatic dependent launch: wait for the previous kernel's results
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:  # a small launch: the next kernel's grid may start now (else: as blocks exit)
        tl.extra.cuda.gdc_launch_dependents()
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok_ok = tokens < num_tokens
    col_ok = cols < hidden_size
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tokens.to(tl.int64) * TOP_K + j
        row = tl.load(slot_rows_ptr + slot, mask=tok_ok, other=-1)
        valid = row >= 0
        m = valid[:, None] & col_ok[None, :]
        y = tl.load(y_ptr + row.to(tl.int64)[:, None] * stride_y + cols[None, :], mask=m, other=0.0)
        y = y.to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + slot, mask=tok_ok, other=0.0).to(tl.float32)  # any float dtype
            y = y * w[:, None]
        acc += tl.where(m, y, 0.0)
    out_mask = tok_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def row_weights_kernel(slot_weights_ptr, slot_rows_ptr, row_weights_ptr, num_slots, BLOCK: tl.constexpr,
                       DEPENDENT_LAUNCH: tl.constexpr = 0):
    if DEPENDENT_LAUNCH >= 1:
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:
        tl.extra.cuda.gdc_launch_dependents()
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = slots < num_slots
    rows = tl.load(slot_rows_ptr + slots, mask=ok, other=-1)
    valid = rows >= 0
    w = tl.load(slot_weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)  # any float dtype
    tl.store(row_weights_ptr + rows.to(tl.int64), w, mask=valid)


ROW_WEIGHTS_BLOCK = 1024

_JIT_NAMES = ("gather_kernel", "_gather_slot_block", "_pad_token_rows", "combine_kernel", "row_weights_kernel")


@functools.lru_cache(maxsize=2)
def _jit_functions(interpret: bool):
    del interpret  # cache key only
    return routing_triton.build_jit_namespace(globals(), _JIT_NAMES)


def jit_functions():
    """gather_kernel and combine_kernel for the current interpreter mode."""
    return _jit_functions(routing_triton.triton_interpreting())


GATHER_SLOTS_PER_PROGRAM = 8  # BLOCK_S of gather_kernel
COMBINE_TOKENS_PER_PROGRAM = 2  # BLOCK_T of combine_kernel


def permute_launch_params(hidden_size: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): one 16-byte vector per thread and row, 4 warps x 32 lanes across at most 2 KiB of a
    row. Two vectors per thread (a 4 KiB slab, the previous choice) made the combine 2-27% slower at the layer's
    prefill shapes on the H200, and the gather 0-5% (with 4 slots per program; results/permute-h200-2026-12-01/)."""
    vec = max(1, 16 // element_size)
    block_h = min(next_pow2(max(hidden_size, 1)), 128 * vec)
    block_h = max(block_h, 16)
    num_warps = 4 if block_h >= 128 * vec else max(1, block_h // (32 * vec))
    return block_h, num_warps
