"""Fused routing kernel (Triton): router logits -> (topk_weights fp32, topk_ids int32), one launch.

Program layout: one program per block of BLOCK_T tokens; the whole row of E logits of each token sits in
registers (BLOCK_E = next power of two >= E, at most 512). No shared-memory pipeline, no atomics: every
step is a row reduction (tl.max / tl.min / tl.sum over the expert axis).

Steps for a token block:
  1. load logits [BLOCK_T, BLOCK_E] (bf16 / fp16 / fp32), upcast to fp32;
  2. score: softmax over E (SOFTMAX), sigmoid (+ correction bias for the selection key, SIGMOID_GROUPED),
     or the raw logits (TOPK_SOFTMAX, SIGMOID_TOP1);
  3. group-limited selection (SIGMOID_GROUPED with groups): group score = sum of the two best keys of the
     group, keep the best topk_group groups, mask the other experts to -inf;
  4. top-k by k rounds of one int64 max: each key is packed as (order-preserving int32 image of the fp32
     key) << 32 | (BLOCK_E - 1 - expert), so the max is the best key and ties go to the lower expert; the
     winner is replaced by a "taken" value below every key, so -inf and NaN rows still select distinct
     experts in index order. NaN keys count as -inf, as in router/reference.py;
  5. weights: the selected probabilities (SOFTMAX; NaN for a row with a NaN), softmax over the k selected
     logits (TOPK_SOFTMAX), or sigmoid scores (SIGMOID_*), from a k-element re-load of the selected logits
     (NaN kept, no bias); optional renormalization, then routed_scaling_factor.

Math is fp32. exp is libdevice expf on CUDA (faithfully rounded; Triton's tl.exp is ex2.approx there), and
numpy's exp under TRITON_INTERPRET=1 (CPU tensors). Limits: E <= 512, k <= 16, k <= E.
The jit helper `route_token_block` is reused by the fused route + dispatch kernel (dispatch_triton.py).

The kernel functions below are plain Python; `jit_functions()` decorates them with triton.jit on first
use, once per interpreter mode (Triton fixes compiled-vs-interpreted when it decorates, so a test can turn
TRITON_INTERPRET on for its own scope), and `build_jit_namespace` is shared with the other kernel modules.
"""
from __future__ import annotations

import functools
import os
import types

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = [
    "MAX_EXPERTS",
    "MAX_TOP_K",
    "SCORING_CODES",
    "triton_interpreting",
    "build_jit_namespace",
    "jit_functions",
    "route_launch_params",
]

MAX_EXPERTS = 512
MAX_TOP_K = 16

# Scoring -> integer code seen by the kernels (keys are Scoring.value strings to avoid an import cycle).
SCORING_CODES = {"softmax": 0, "topk_softmax": 1, "sigmoid_grouped": 2, "sigmoid_top1": 3}


def _exp_f32(x, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


_TAKEN = tl.constexpr(-9223372036854775807)  # below every packed key


def _pack_keys(key, cols, BLOCK: tl.constexpr):
    """int64 per (row, col) ordered like (key, -col): the max is the best key, ties to the lower col.
    key: fp32 without NaN. The high word is the key's bits mapped to an order-preserving int32."""
    key = tl.where(key == 0.0, 0.0, key)  # -0.0 ties with +0.0, as in torch
    bits = key.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (BLOCK - 1 - cols)[None, :].to(tl.int64)


def _unpack_index(packed, BLOCK: tl.constexpr):
    return BLOCK - 1 - packed.to(tl.int32)  # low word


def _unpack_key(packed):
    ordered = (packed >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


def _argmax_untaken(key, taken, cols, BLOCK: tl.constexpr):
    """Per row: index of the largest key among untaken columns, ties to the lower index."""
    cand = tl.where(taken, float("-inf"), key)
    best = tl.max(cand, axis=1)
    hit = (cand == best[:, None]) & (taken == 0)
    return tl.min(tl.where(hit, cols[None, :], BLOCK), axis=1)


def route_token_block(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    tok0,
    num_tokens,
    stride_logits,
    routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """Route tokens tok0 .. tok0+BLOCK_T-1 (rows past num_tokens are ignored)."""
    rows = tok0 + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    row_ok = rows < num_tokens
    col_ok = cols < NUM_EXPERTS
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_logits + cols[None, :]
    x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    neg_inf = float("-inf")

    if SCORING == 0:  # SOFTMAX: probabilities over E, select on them
        xm = tl.where(col_ok[None, :], x, neg_inf)
        row_max = tl.max(xm, axis=1)
        p = _exp_f32(xm - row_max[:, None], USE_LIBDEVICE)
        row_sum = tl.sum(p, axis=1)
        raw_key = p / row_sum[:, None]
    elif SCORING == 2:  # SIGMOID_GROUPED: weights from sigmoid, selection on sigmoid + bias
        raw_key = 1.0 / (1.0 + _exp_f32(-x, USE_LIBDEVICE))
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            raw_key = raw_key + bias[None, :]
    else:  # TOPK_SOFTMAX, SIGMOID_TOP1: select on the logits
        raw_key = x
    key = tl.where(raw_key != raw_key, neg_inf, raw_key)  # NaN never beats a number

    if NUM_GROUPS > 0:  # group-limited selection (SIGMOID_GROUPED only; validated on the host)
        per_group: tl.constexpr = NUM_EXPERTS // NUM_GROUPS
        group_of_col = cols // per_group
        gcols = tl.arange(0, BLOCK_G)
        packed = _pack_keys(key, cols, BLOCK_E)
        group_scores = tl.full([BLOCK_T, BLOCK_G], neg_inf, tl.float32)
        for g in range(NUM_GROUPS):
            c = tl.where(((group_of_col == g) & col_ok)[None, :], packed, _TAKEN)
            best1 = tl.max(c, axis=1)
            best2 = tl.max(tl.where(c == best1[:, None], _TAKEN, c), axis=1)
            score = _unpack_key(best1) + _unpack_key(best2)
            group_scores = tl.where(gcols[None, :] == g, score[:, None], group_scores)
        group_taken = tl.zeros([BLOCK_T, BLOCK_G], tl.int1) | (gcols >= NUM_GROUPS)[None, :]
        keep = tl.zeros([BLOCK_T, BLOCK_E], tl.int1)
        for _ in range(TOPK_GROUP):
            gbest = _argmax_untaken(group_scores, group_taken, gcols, BLOCK_G)
            group_taken = group_taken | (gcols[None, :] == gbest[:, None])
            keep = keep | (group_of_col[None, :] == gbest[:, None])
        key = tl.where(keep, key, neg_inf)

    # Top-k: one int64 max per round (key bits, then the inverted index for ties to the lower index).
    packed = tl.where(col_ok[None, :], _pack_keys(key, cols, BLOCK_E), _TAKEN)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    top_vals = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for j in range(TOP_K):
        best = tl.max(packed, axis=1)
        packed = tl.where(packed == best[:, None], _TAKEN, packed)
        top_ids = tl.where(kcols[None, :] == j, _unpack_index(best, BLOCK_E)[:, None], top_ids)
        top_vals = tl.where(kcols[None, :] == j, _unpack_key(best)[:, None], top_vals)

    k_ok = kcols < TOP_K
    out_offs = rows.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
    out_mask = row_ok[:, None] & k_ok[None, :]
    # The selected keys are the scores except where NaN became -inf (and SIGMOID_GROUPED's bias): re-derive
    # the weight sources from the selected logits (a k-element gather, same arithmetic as above).
    if SCORING == 0:
        top_vals = top_vals + (row_sum - row_sum)[:, None]  # a NaN anywhere makes every probability NaN
    else:
        x_sel = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_logits + top_ids, mask=out_mask,
                        other=0.0).to(tl.float32)
        if SCORING == 2:
            top_vals = tl.where(k_ok[None, :], 1.0 / (1.0 + _exp_f32(-x_sel, USE_LIBDEVICE)), 0.0)
        else:
            top_vals = x_sel

    if SCORING == 1:  # TOPK_SOFTMAX: softmax over the k selected logits
        vm = tl.where(k_ok[None, :], top_vals, neg_inf)
        e = _exp_f32(vm - tl.max(vm, axis=1)[:, None], USE_LIBDEVICE)
        weights = e / tl.sum(e, axis=1)[:, None]
    elif SCORING == 3:  # SIGMOID_TOP1: weight = sigmoid(logit)
        weights = tl.where(k_ok[None, :], 1.0 / (1.0 + _exp_f32(-top_vals, USE_LIBDEVICE)), 0.0)
        if RENORMALIZE and TOP_K > 1:
            weights = weights / tl.sum(weights, axis=1)[:, None]
    else:  # SOFTMAX, SIGMOID_GROUPED: the selected scores
        weights = top_vals
        if RENORMALIZE:
            weights = weights / tl.sum(weights, axis=1)[:, None]
    weights = weights * routed_scaling_factor
    tl.store(weights_ptr + out_offs, weights, mask=out_mask)
    tl.store(ids_ptr + out_offs, top_ids, mask=out_mask)


def route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    stride_logits,
    routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T),). Each program routes one block of tokens."""
    tok0 = tl.program_id(0) * BLOCK_T
    route_token_block(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr, tok0, num_tokens, stride_logits, routed_scaling_factor,
        NUM_EXPERTS, TOP_K, SCORING, RENORMALIZE, HAS_BIAS, NUM_GROUPS, TOPK_GROUP,
        BLOCK_T, BLOCK_E, BLOCK_K, BLOCK_G, USE_LIBDEVICE,
    )


_JIT_NAMES = ("_exp_f32", "_pack_keys", "_unpack_index", "_unpack_key", "_argmax_untaken", "route_token_block",
              "route_kernel")


def triton_interpreting() -> bool:
    """Whether triton.jit would build interpreted kernels now (TRITON_INTERPRET, read at call time)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def build_jit_namespace(module_globals: dict, names: tuple, extra: tuple = ()) -> types.SimpleNamespace:
    """triton.jit copies of the named plain functions, bound to one namespace so that their calls to each
    other (and to the functions in `extra` namespaces) reach copies of the same mode."""
    namespace = dict(module_globals)
    for other in extra:
        namespace.update(vars(other))
    for name in names:
        fn = module_globals[name]
        copy = types.FunctionType(fn.__code__, namespace, name, fn.__defaults__, fn.__closure__)
        copy.__module__, copy.__qualname__, copy.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
        copy.__annotations__ = dict(fn.__annotations__)  # tl.constexpr marks live here (not in __code__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        namespace[name] = triton.jit(copy)
    return types.SimpleNamespace(**{name: namespace[name] for name in names})


@functools.lru_cache(maxsize=2)
def _jit_functions(interpret: bool) -> types.SimpleNamespace:
    del interpret  # cache key only: triton reads the mode when decorating
    return build_jit_namespace(globals(), _JIT_NAMES)


def jit_functions() -> types.SimpleNamespace:
    """route_kernel, route_token_block, ... decorated for the current interpreter mode."""
    return _jit_functions(triton_interpreting())


def route_launch_params(num_tokens: int, num_experts: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, num_warps) for the routing kernel.

    About 2048 fp32 logits per program at most; fewer tokens per program while that leaves SMs idle (small
    T is latency-bound: spread it). Depends on T only through a power-of-two bucket.
    """
    block_e = max(16, triton.next_power_of_2(num_experts))
    cap = max(1, 2048 // block_e)
    spread = triton.next_power_of_2(max(1, -(-num_tokens // num_sms)))
    block_t = max(1, min(cap, spread))
    elems = block_t * block_e
    num_warps = 4 if elems >= 1024 else (2 if elems >= 256 else 1)
    return block_t, block_e, num_warps
