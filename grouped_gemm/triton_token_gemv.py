"""Triton token-major expert GEMVs: the MoE layer of a few tokens straight from topk_ids (no dispatch).

At a batch of a few tokens every (token, expert) slot is its own row and most experts get one row, so a
grouped GEMM over the padded expert layout multiplies 16-row tiles that hold one valid row, and the layer
needs the dispatch (per-expert counts, offsets, sorted slots) and a separate combine. This family reads
topk_ids directly, in two launches:
- GEMV1 (gated): a2[t*k + j, n] = act(x_tj . w13[e_tj, gate n] + b13, x_tj . w13[e_tj, up n] + b13), with
  x_tj = hidden[t] (times topk_weights[t, j] when the router weight is on the input), w13 in either
  W13Layout (CHUNKED: one tile of 2 * BLOCK_N packed rows; GATE_THEN_UP: a gate and an up tile);
- GEMV2 + combine: out[t, n] = sum_j topk_weights[t, j] * (a2[t*k + j] . w2[e_tj, n] + b2[e_tj, n]), all k
  slots of a token in one program, summed in fp32 in a fixed order (bit-stable, no atomics), so the
  layer has no combine launch and the expert outputs are never rounded to the activation dtype.
e_tj = expert_map[topk_ids[t, j]] when an expert map is given (an id of -1, or a map entry of -1: the slot
adds nothing; its a2 row is not written and never read).

Work decomposition: program (t, g, n block) takes BLOCK_J slots of token t (group g; GEMV2: all k slots,
BLOCK_J >= k) and BLOCK_N output columns. Token is the fastest index, so the programs that read one expert's
rows for different tokens run together and share them through L2. Per K step of BLOCK_K: one
[BLOCK_J, rows, BLOCK_K] weight load (one base pointer per slot), multiplied by x in fp32 and reduced over K
into [BLOCK_J, rows] accumulators. No tensor cores: at one row per expert each weight element is used once,
and the kernel is a weight stream whose depth comes from many small programs per SM and from prefetching
the next K step's weights into registers (two 8-16 KB weight tiles per program in flight by default).

Warps and pipelines: no warp specialization; all `num_warps` warps load and multiply; the K loop holds the
current weight tile and the next one's loads in registers (a two-deep software pipeline written out in the
kernel: Triton's pipeliner only handles loops with a dot). On sm_90+ a launch is a programmatic dependent
launch: it waits for the previous kernel of the stream with griddepcontrol.wait before reading anything and
releases the next kernel's grid at once (every launch of this family is decode-sized).

Limits: hidden / a2 and the weights share one dtype in {float16, bfloat16, float32}; topk_ids / expert_map int32
or int64 and topk_weights of any float dtype, read as given (widened to fp32 on load: no conversion launch);
contiguous weights; any K and N (tails masked; CHUNKED needs I % GATE_UP_CHUNK == 0 and BLOCK_N a multiple
of it); k <= 64. Weights are read once per slot (tokens share an expert's rows only through L2): the layer
uses this family only where `token_gemv_applies` (a few tokens, bounded weight bytes; measured,
docs/perf-notes-triton.md v6), the grouped GEMM elsewhere. At T=1 both launches are one-wave kernels whose time
is the weight stream plus ~3 us of ramp and drain each (a plain read of the same bytes is slower); measured and
removed: GEMV1 prefetching GEMV2's weights into L2 (v8), deeper register pipelines and GEMV1 routing its own
tokens (v7), GEMV2's first tile loaded before griddepcontrol.wait (v6), both GEMVs in one launch with per-token
counters (v10: a ticket and a release per item cost more than the ramp and drain it saves).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from .epilogue import GATE_UP_CHUNK, Activation, GemmStage, W13Layout
from .operands import require_own_memory
from .triton_grouped_gemm import (
    _ACTIVATION_CODE,
    _SUPPORTED_DTYPES,
    _decorated,
    _decorated_helpers,
    _dependent_launch_supported,
    _interpreting,
    _limits_for,
    _named_reason,
    require_distinct_rows,
)

# router weights are read in their own dtype and widened to fp32 on load (a caller's bf16 weights need no launch)
_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

__all__ = [
    "TOKEN_GEMV_LIMITS",
    "TOKEN_GEMV_MAX_TOKENS",
    "TokenGemvConfig",
    "TokenGemvProblem",
    "can_implement",
    "default_config",
    "token_gemv1",
    "token_gemv2_combine",
    "token_gemv_applies",
    "token_gemv_max_tokens",
]

# Where the layer runs this family, measured on an H200 (docs/perf-notes-triton.md v6): it saves the
# dispatch and combine launches, but reads an expert's weights once per slot (tokens that share an expert
# share its rows only through L2), so it pays for a few tokens, and fewer as experts grow. Rows: (largest
# expert weight bytes, most tokens). Measured token / grouped layer time: qwen3-30b-a3b (9.4 MB experts)
# 0.70 / 0.79 / 0.88 / 0.96 at T = 1 / 2 / 4 / 8; qwen3-235b-a22b (38 MB) 0.87 / 0.92 / 0.96 / 1.05;
# gpt-oss-120b (50 MB) 0.96 / 0.98 / 1.06; deepseek-v3 (88 MB) 0.96 / 0.99 / 1.00 / 1.05; mixtral-8x7b
# (352 MB) 1.01 / 1.02 / 1.22.
TOKEN_GEMV_LIMITS = ((16 << 20, 8), (40 << 20, 4), (128 << 20, 2))
TOKEN_GEMV_MAX_TOKENS = max(tokens for _, tokens in TOKEN_GEMV_LIMITS)
MAX_TOP_K = 64
# Default tiles (block_n, block_k, num_warps), from the H200 sweeps (serving_bench/token_gemv_bench.py --sweep;
# results/token-gemv-h200-2026-11-29, -2026-12-01): the best or within 8% of it at T=1. GEMV1 on the packed w13
# (W13Layout.CHUNKED, what AUTO layers read): 8 columns, one chunk, beat 16 by 1.7-3.9% in all ten cells of five
# presets x T = 1, 2 (2026-12-01); on the public layout (a gate and an up tile) 16 columns, as measured on 11-29.
_GEMV1_TILE = (16, 256, 4)  # 2 * 16 weight rows x 256: 16 KB of bf16 per K step, two in flight
_GEMV1_CHUNKED_BLOCK_N = GATE_UP_CHUNK
_GEMV2_TILE = (4, 256, 8)  # k slots x 4 rows x 256
# GEMV2 is a one-wave kernel where it can be: each program streams all of its K, so a partial last wave leaves HBM
# idle while it drains. The narrow tile (half the K step on half the warps: the same bytes per program, twice the
# programs per SM) replaces the default where it has the smaller wave tail, or the same one on a grid of more than
# one wave (measured: as fast or faster in 10 of 11 such cells); both use the same registers per thread
# (64 with Triton 3.6 on the H200, ncu: 4 programs of 8 warps per SM -> 32 resident warps). Measured, both tiles in
# one run (results/token-gemv2-waves-h200-2026-12-01): gpt-oss T=1 27.4 -> 25.5 us (1.36 -> 0.68 waves), qwen3-235b
# T=1 29.8 -> 28.8 (1.94 -> 0.97), qwen3-30b T=2 18.6 -> 17.7; the faster tile in all 5 cells where the tails differ.
_GEMV2_NARROW_TILE = (4, 128, 4)
_RESIDENT_WARPS_PER_SM = 32
_TILE_ELEMENTS_PER_WARP = 2048  # at most 64 weight elements per thread (their fp32 products live in registers)


def token_gemv_max_tokens(expert_bytes: int, limits=TOKEN_GEMV_LIMITS) -> int:
    """The most tokens a layer batch may have to run this family, for experts of expert_bytes weight bytes
    (w13 + w2 + biases of one expert): the token limit of the first row of `limits` ((largest expert bytes, most
    tokens), ...) that admits expert_bytes, 0 where none does."""
    return next((max_tokens for max_bytes, max_tokens in limits if expert_bytes <= max_bytes), 0)


def token_gemv_applies(num_tokens: int, expert_bytes: int, limits=TOKEN_GEMV_LIMITS) -> bool:
    """Whether a layer batch of num_tokens tokens runs this family: 1 <= num_tokens <= token_gemv_max_tokens."""
    return 1 <= num_tokens <= token_gemv_max_tokens(expert_bytes, limits)


@dataclasses.dataclass(frozen=True)
class TokenGemvProblem:
    """Static facts of one launch (num_tokens only sizes the grid of the default config)."""

    stage: GemmStage
    num_tokens: int
    top_k: int
    n: int  # output columns: I for GEMV1, H for GEMV2
    k: int  # reduction length: H for GEMV1, I for GEMV2
    dtype: torch.dtype
    num_sms: int
    w13_layout: W13Layout = W13Layout.GATE_THEN_UP

    @property
    def chunked(self) -> bool:
        return self.stage is GemmStage.GEMM1 and self.w13_layout is W13Layout.CHUNKED

    @property
    def weight_rows(self) -> int:
        """Weight rows one program loads per slot and output column (gate + up for GEMV1)."""
        return 2 if self.stage is GemmStage.GEMM1 else 1


@dataclasses.dataclass(frozen=True)
class TokenGemvConfig:
    block_j: int  # slots of one token per program (GEMV2: >= top_k, the combine is in-program)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int = 4  # (no num_stages: the K loop's two-deep register pipeline is written in the kernel)

    def tile_elements(self, problem: TokenGemvProblem) -> int:
        return self.block_j * problem.weight_rows * self.block_n * self.block_k


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def can_implement(config: TokenGemvConfig, problem: TokenGemvProblem) -> tuple[bool, str]:
    """(True, "") when the kernel runs `problem` with `config`, else (False, why)."""
    if problem.dtype not in _SUPPORTED_DTYPES:
        return False, f"dtype {problem.dtype} not in {_SUPPORTED_DTYPES}"
    if not 1 <= problem.top_k <= MAX_TOP_K:
        return False, f"top_k {problem.top_k} outside 1..{MAX_TOP_K}"
    for name in ("block_j", "block_n", "block_k", "num_warps"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int):
            return False, f"{name}: expected an int, got {value!r}"
    for name in ("block_j", "block_n", "block_k"):
        if not _is_pow2(getattr(config, name)):
            return False, f"{name} {getattr(config, name)} is not a power of two"
    if config.block_k < 16:
        return False, f"block_k {config.block_k} < 16"
    if config.num_warps not in (1, 2, 4, 8, 16):
        return False, f"num_warps {config.num_warps} not in (1, 2, 4, 8, 16)"
    if problem.stage is GemmStage.GEMM2 and config.block_j < problem.top_k:
        return False, f"block_j {config.block_j} < top_k {problem.top_k}: GEMV2 sums all slots of a token in one program"
    if problem.chunked:
        if problem.n % GATE_UP_CHUNK:
            return False, f"w13_layout chunked needs the intermediate size ({problem.n}) a multiple of {GATE_UP_CHUNK}"
        if config.block_n % GATE_UP_CHUNK:
            return False, f"W13Layout.CHUNKED needs block_n % {GATE_UP_CHUNK} == 0, got {config.block_n}"
    limit = _TILE_ELEMENTS_PER_WARP * config.num_warps
    if config.tile_elements(problem) > limit:
        return False, (f"weight tile of {config.tile_elements(problem)} elements per K step exceeds {limit} for "
                       f"{config.num_warps} warps (registers)")
    return True, ""


def _wave_tail(programs: int, slots: int) -> float:
    """Elapsed waves over busy waves of a grid of `programs` equal programs, `slots` of which one wave holds: 1.0
    when one wave holds them all, else ceil(waves) / waves."""
    waves = programs / slots
    return 1.0 if waves <= 1 else math.ceil(waves) / waves


def _wave_slots(num_warps: int, problem: TokenGemvProblem) -> int:
    """Programs of `num_warps` warps that one wave holds (_RESIDENT_WARPS_PER_SM per SM)."""
    return problem.num_sms * max(1, _RESIDENT_WARPS_PER_SM // num_warps)


def default_config(problem: TokenGemvProblem) -> TokenGemvConfig:
    """_GEMV1_TILE / _GEMV2_TILE (GEMV1: one slot per program, _GEMV1_CHUNKED_BLOCK_N columns on the packed w13,
    and half of _GEMV1_TILE's where that leaves fewer programs than SMs; GEMV2: all k slots, block_j =
    next_pow2(k), _GEMV2_NARROW_TILE where its wave tail is smaller, or equal on a grid of more than one wave);
    block_k shrinks for large k to stay within the register limit of can_implement."""
    if problem.stage is GemmStage.GEMM1:
        block_j = 1
        block_n, block_k, num_warps = _GEMV1_TILE
        if problem.chunked or max(1, problem.num_tokens) * problem.top_k * -(-problem.n // block_n) < problem.num_sms:
            block_n = _GEMV1_CHUNKED_BLOCK_N
    else:
        block_j = _next_pow2(problem.top_k)
        block_n, block_k, num_warps = _GEMV2_TILE
        programs = max(1, problem.num_tokens) * -(-problem.n // block_n)
        narrow = _GEMV2_NARROW_TILE
        slots = _wave_slots(num_warps, problem)
        # the narrow tile where the default grid takes more than one wave and the narrow tail is no longer (a shorter
        # narrow tail implies more than one wave: both tails are 1.0 on one wave)
        narrow_tail = _wave_tail(programs, _wave_slots(narrow[2], problem))
        if programs > slots and narrow_tail <= _wave_tail(programs, slots) + 1e-9:
            block_n, block_k, num_warps = narrow
    rows = block_j * problem.weight_rows * block_n
    block_k = max(16, min(block_k, _TILE_ELEMENTS_PER_WARP * num_warps // rows, _next_pow2(problem.k)))
    return TokenGemvConfig(block_j, block_n, block_k, num_warps=num_warps)


# ----------------------------------------------------------------------------------------------------------
# Kernel (decorated lazily, as the grouped GEMM kernel: see triton_grouped_gemm._jitted_kernel; only Triton
# builtins and the per-mode helpers _add / _gated_activation, so it runs in the interpreter too).


def _token_gemv_kernel(
    x_ptr, ids_ptr, map_ptr, topk_w_ptr, w_ptr, bias_ptr, out_ptr,
    num_tokens, N, K, num_experts, map_len,
    stride_xm, stride_we, stride_wn, up_offset, stride_be, stride_om,
    TOP_K: tl.constexpr, STAGE: tl.constexpr, ACTIVATION: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr, W13_CHUNK: tl.constexpr, EVEN_K: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # STAGE 1: GEMV1 (gated; x = hidden [T, K]; HAS_WEIGHTS: the router weight scales x, on the input)
    # STAGE 2: GEMV2 + combine (x = a2 [T * TOP_K, K]; HAS_WEIGHTS: the router weight scales each slot's y)
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_wait()  # topk_ids / a2 come from the previous kernel of the stream
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    groups = (TOP_K + BLOCK_J - 1) // BLOCK_J
    t = pid % num_tokens
    rest = pid // num_tokens
    g = rest % groups
    n_block = rest // groups

    offs_j = g * BLOCK_J + tl.arange(0, BLOCK_J)
    slot_ok = offs_j < TOP_K
    slots = t.to(tl.int64) * TOP_K + tl.minimum(offs_j, TOP_K - 1)  # clamped: always a valid slot
    experts = tl.load(ids_ptr + slots)
    if HAS_MAP:  # global -> local id; -1: not on this rank (ids of -1: slot unused)
        in_map = (experts >= 0) & (experts < map_len)
        mapped = tl.load(map_ptr + tl.minimum(tl.maximum(experts, 0), map_len - 1))
        experts = tl.where(in_map, mapped, -1)
    # Ids outside the weights' experts add nothing, as the dispatch treats them (off-rank), never an address. Ids and
    # map entries (int32 or int64) are compared in their own type: an int64 value past int32 is never wrapped.
    slot_ok = slot_ok & (experts >= 0) & (experts < num_experts)
    experts = tl.where(slot_ok, experts, 0)
    e_off = tl.maximum(experts, 0).to(tl.int64) * stride_we  # [BLOCK_J]
    if HAS_WEIGHTS:
        slot_w = tl.load(topk_w_ptr + slots, mask=slot_ok, other=0.0).to(tl.float32)  # [BLOCK_J], any float dtype

    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_n = (offs_n % N).to(tl.int64)  # wrapped: weight rows need no N mask
    offs_k = tl.arange(0, BLOCK_K)
    if STAGE == 1:
        x_row = t.to(tl.int64) * stride_xm  # every slot of a token reads the token's row
        if W13_CHUNK > 0:
            # packed rows [2 * n0, 2 * n0 + 2 * BLOCK_N) hold gate and up rows of columns [n0, n0 + BLOCK_N)
            offs_p = n_block * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
            w_rows = (offs_p % (2 * N)).to(tl.int64)
        else:
            w_rows = w_n
    else:
        x_rows = slots * stride_xm  # [BLOCK_J]: a2 row of each slot
        w_rows = w_n
    w_ptrs = w_ptr + e_off[:, None, None] + w_rows[None, :, None] * stride_wn + offs_k[None, None, :]
    acc = tl.full((BLOCK_J, w_rows.shape[0]), 0.0, tl.float32)
    if STAGE == 1 and W13_CHUNK == 0:
        acc_up = tl.full((BLOCK_J, BLOCK_N), 0.0, tl.float32)
    # Weights are prefetched one K step ahead into registers: two tiles in flight per program (the loop
    # has no dot, so Triton's pipeliner leaves it alone). Loads past K are masked off (no memory traffic).
    w_mask = slot_ok[:, None, None]
    k_ok = offs_k < K
    w_cur = tl.load(w_ptrs, mask=w_mask & k_ok[None, None, :], other=0.0)
    if STAGE == 1 and W13_CHUNK == 0:
        u_cur = tl.load(w_ptrs + up_offset, mask=w_mask & k_ok[None, None, :], other=0.0)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        next_mask = w_mask & ((k0 + BLOCK_K + offs_k) < K)[None, None, :]
        w_ptrs += BLOCK_K
        w_next = tl.load(w_ptrs, mask=next_mask, other=0.0)
        if STAGE == 1 and W13_CHUNK == 0:
            u_next = tl.load(w_ptrs + up_offset, mask=next_mask, other=0.0)
        if STAGE == 1:
            if EVEN_K:
                x = tl.load(x_ptr + x_row + k0 + offs_k).to(tl.float32)[None, None, :]
            else:
                x = tl.load(x_ptr + x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, None, :]
        else:
            x_ptrs = x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :]
            if EVEN_K:
                x = tl.load(x_ptrs, mask=slot_ok[:, None], other=0.0).to(tl.float32)[:, None, :]
            else:
                x = tl.load(x_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)[:, None, :]
        acc += tl.reduce(w_cur.to(tl.float32) * x, 2, _add)
        w_cur = w_next
        if STAGE == 1 and W13_CHUNK == 0:
            acc_up += tl.reduce(u_cur.to(tl.float32) * x, 2, _add)
            u_cur = u_next

    y = acc  # [BLOCK_J, rows]
    if STAGE == 1 and HAS_WEIGHTS:  # router weight on the input: (w x) . row = w (x . row), before the bias
        y = y * slot_w[:, None]
    b_base = bias_ptr + tl.maximum(experts, 0).to(tl.int64) * stride_be
    if STAGE == 1:
        if W13_CHUNK > 0:
            # [BLOCK_J, 2 * BLOCK_N] packed columns (chunk, gate | up, column in chunk) -> gate, up
            pairs = tl.permute(tl.reshape(y, (BLOCK_J, BLOCK_N // W13_CHUNK, 2, W13_CHUNK)), (0, 1, 3, 2))
            gate, up = tl.split(pairs)
            gate = tl.reshape(gate, (BLOCK_J, BLOCK_N))
            up = tl.reshape(up, (BLOCK_J, BLOCK_N))
        else:
            gate = y
            up = acc_up
            if HAS_WEIGHTS:
                up = up * slot_w[:, None]
        if HAS_BIAS:  # b13 in the public gate-then-up order
            gate += tl.load(b_base[:, None] + w_n[None, :], mask=slot_ok[:, None], other=0.0).to(tl.float32)
            up += tl.load(b_base[:, None] + (w_n + N)[None, :], mask=slot_ok[:, None], other=0.0).to(tl.float32)
        result = _gated_activation(gate, up, ACTIVATION)
        out_ptrs = out_ptr + slots[:, None] * stride_om + offs_n[None, :].to(tl.int64)
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=slot_ok[:, None] & n_ok[None, :])
    else:
        if HAS_BIAS:
            y += tl.load(b_base[:, None] + w_n[None, :], mask=slot_ok[:, None], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            y = y * slot_w[:, None]
        y = tl.where(slot_ok[:, None], y, 0.0)
        total = tl.reduce(y, 0, _add)  # fixed reduction order over the k slots: bit-stable
        out_ptrs = out_ptr + t.to(tl.int64) * stride_om + offs_n.to(tl.int64)
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@functools.lru_cache(maxsize=2)
def _jitted_kernel(interpret: bool):
    del interpret  # part of the cache key only (triton reads its mode when it decorates)
    namespace = dict(globals())
    namespace.update(_decorated_helpers())
    # num_tokens varies with the batch: specializing on it would compile per T.
    return _decorated(_token_gemv_kernel, namespace, do_not_specialize=["num_tokens"])


def _kernel():
    return _jitted_kernel(_interpreting())


# ----------------------------------------------------------------------------------------------------------
# Host wrappers.


def _require(name: str, t, ndim: int, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")


def _check_ids(topk_ids, num_tokens: int | None, device) -> tuple[int, int]:
    _require("topk_ids", topk_ids, 2, (torch.int32, torch.int64), device)
    if not topk_ids.is_contiguous():
        raise ValueError("topk_ids: expected a contiguous tensor")
    if num_tokens is not None and topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids: expected {num_tokens} rows (one per token), got {topk_ids.shape[0]}")
    if not 1 <= topk_ids.shape[1] <= MAX_TOP_K:
        raise ValueError(f"topk_ids: expected 1..{MAX_TOP_K} columns (top_k), got {topk_ids.shape[1]}")
    return topk_ids.shape[0], topk_ids.shape[1]


def _check_optional(name, t, shape, device, dtypes=None) -> None:
    if t is None:
        return
    _require(name, t, len(shape), dtypes, device)
    if tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor of shape {list(shape)}, got {list(t.shape)}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")


@functools.lru_cache(maxsize=1024)
def _checked_config(problem: TokenGemvProblem, config: TokenGemvConfig | None) -> tuple[TokenGemvConfig, str]:
    """(config, or default_config(problem) for None; why can_implement refuses it, or ""): pure functions of frozen
    arguments, asked on every launch (memoized: ~10 us of Python each)."""
    config = default_config(problem) if config is None else config
    return config, can_implement(config, problem)[1]


def _launch(stage: GemmStage, x, topk_ids, w, activation, bias, topk_weights, expert_map, out, config,
            w13_layout: W13Layout, out_dtype) -> torch.Tensor:
    w_name, b_name = ("w13", "b13") if stage is GemmStage.GEMM1 else ("w2", "b2")
    x_name = "hidden" if stage is GemmStage.GEMM1 else "a2"
    _require(x_name, x, 2, _SUPPORTED_DTYPES)
    device = x.device
    _require(w_name, w, 3, (x.dtype,), device)
    if not w.is_contiguous():
        raise ValueError(f"{w_name}: expected a contiguous tensor")
    if x.stride(1) != 1:
        raise ValueError(f"{x_name}: expected unit column stride, got strides {tuple(x.stride())}")
    num_experts, w_rows, k_dim = w.shape
    if x.shape[1] != k_dim:
        raise ValueError(f"{x_name}: expected {k_dim} columns (K of {w_name}), got {x.shape[1]}")
    if stage is GemmStage.GEMM1:
        num_tokens, top_k = _check_ids(topk_ids, x.shape[0], device)
        if w_rows % 2:
            raise ValueError(f"w13: expected an even row count 2I, got {w_rows}")
        n_dim = w_rows // 2
        out_shape = (num_tokens * top_k, n_dim)
    else:
        num_tokens, top_k = _check_ids(topk_ids, None, device)
        if x.shape[0] != num_tokens * top_k:
            raise ValueError(f"a2: expected T * k = {num_tokens * top_k} rows (one per slot), got {x.shape[0]}")
        n_dim = w_rows
        out_shape = (num_tokens, n_dim)
    _check_optional(b_name, bias, (num_experts, w_rows), device)
    if bias is not None and not bias.is_floating_point():
        raise ValueError(f"{b_name}: expected a floating-point tensor, got {bias.dtype}")
    _check_optional("topk_weights", topk_weights, (num_tokens, top_k), device, _WEIGHT_DTYPES)
    if expert_map is not None:
        _require("expert_map", expert_map, 1, (torch.int32, torch.int64), device)
        if not expert_map.is_contiguous():
            raise ValueError("expert_map: expected a contiguous tensor")
        if expert_map.numel() == 0:
            raise ValueError("expert_map: expected at least one entry (global expert id -> local id or -1)")
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=device)
    else:
        _require("out", out, 2, (out_dtype,), device)
        if tuple(out.shape) != out_shape or out.stride(1) != 1:
            raise ValueError(f"out: expected {out_dtype} {list(out_shape)} with unit column stride, got "
                             f"{out.dtype} {list(out.shape)}")
        require_distinct_rows(out)
        require_own_memory(out, **{x_name: x, w_name: w, b_name: bias, "topk_ids": topk_ids,
                                   "topk_weights": topk_weights, "expert_map": expert_map})
    num_sms, _ = _limits_for(device)
    problem = TokenGemvProblem(stage, num_tokens, top_k, n_dim, k_dim, x.dtype, num_sms, w13_layout)
    if config is not None and not isinstance(config, TokenGemvConfig):
        raise TypeError(f"config: expected a TokenGemvConfig or None, got {type(config).__name__}")
    config, reason = _checked_config(problem, config)
    if reason:
        raise ValueError(_named_reason(reason) or f"config: {reason}")
    if num_tokens == 0 or n_dim == 0:
        return out
    groups = -(-top_k // config.block_j)
    grid = (num_tokens * groups * -(-n_dim // config.block_n),)
    dependent = _dependent_launch_supported(device)
    dummy = out  # stands in for absent optional pointers (never read: their constexpr flag is off)
    _kernel()[grid](
        x, topk_ids, expert_map if expert_map is not None else topk_ids,
        topk_weights if topk_weights is not None else dummy, w, bias if bias is not None else dummy, out,
        num_tokens, n_dim, k_dim, num_experts, expert_map.shape[0] if expert_map is not None else 0,
        x.stride(0), w.stride(0), w.stride(1), n_dim * w.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        TOP_K=top_k, STAGE=1 if stage is GemmStage.GEMM1 else 2,
        ACTIVATION=_ACTIVATION_CODE[activation] if activation is not None else 0,
        HAS_MAP=expert_map is not None, HAS_WEIGHTS=topk_weights is not None, HAS_BIAS=bias is not None,
        W13_CHUNK=GATE_UP_CHUNK if problem.chunked else 0, EVEN_K=k_dim % config.block_k == 0,
        DEPENDENT_LAUNCH=dependent, launch_pdl=dependent,
        BLOCK_J=config.block_j, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=1,  # a loop without a dot: Triton's pipeliner does nothing
    )
    return out


def token_gemv1(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    activation: Activation | str = Activation.SWIGLU,
    b13: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: TokenGemvConfig | None = None,
    w13_layout: W13Layout = W13Layout.GATE_THEN_UP,
) -> torch.Tensor:
    """GEMV1 -> a2 [T * k, I] in hidden's dtype, row t * k + j = act of slot (t, j) (slots of experts mapped
    to -1 are not written).

    hidden [T, H]; topk_ids [T, k] int32 / int64 (global ids when expert_map [E_g] int32 / int64 maps them to local
    ids of w13, -1 = not here; with a map an id may be -1, slot unused); w13 [E, 2I, H] in `w13_layout`;
    b13 [E, 2I] public order; topk_weights [T, k] (any float dtype, read as fp32) only when the router weight scales the input (it
    multiplies each slot's dot products, before b13).
    """
    if not isinstance(w13_layout, W13Layout):
        raise TypeError(f"w13_layout: expected a W13Layout, got {w13_layout!r}")
    activation = Activation.parse(activation)
    return _launch(GemmStage.GEMM1, hidden, topk_ids, w13, activation, b13, topk_weights, expert_map, out,
                   config, w13_layout, hidden.dtype if isinstance(hidden, torch.Tensor) else None)


def token_gemv2_combine(
    a2: torch.Tensor,
    topk_ids: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    config: TokenGemvConfig | None = None,
) -> torch.Tensor:
    """GEMV2 and the combine -> out [T, H]: out[t] = sum_j w[t, j] * (a2[t*k + j] @ w2[e_tj].T + b2[e_tj]),
    fp32, the k slots summed in a fixed order; slots of experts mapped to -1 add nothing.

    a2 [T * k, I] (token_gemv1's output); w2 [E, H, I]; topk_weights [T, k] (any float dtype, read as fp32) or None (router weight on
    the input: already applied); out_dtype: a2's dtype unless given.
    """
    if not isinstance(a2, torch.Tensor):
        raise TypeError(f"a2: expected a torch.Tensor, got {type(a2).__name__}")
    if out_dtype is None:
        out_dtype = a2.dtype
    if out_dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype: expected one of {_SUPPORTED_DTYPES}, got {out_dtype}")
    return _launch(GemmStage.GEMM2, a2, topk_ids, w2, None, b2, topk_weights, expert_map, out, config,
                   W13Layout.GATE_THEN_UP, out_dtype)
