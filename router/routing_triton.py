"""Fused routing kernel (Triton): router logits -> (topk_weights fp32, topk_ids int32), one launch.

Program layout: one program per block of BLOCK_T tokens; the whole row of E logits of each token sits in
registers (BLOCK_E = next power of two >= E, at most 512). No shared-memory pipeline, no atomics: every
step is a row reduction (tl.max / tl.min / tl.sum over the expert axis).

Steps for a token block:
  1. load logits [BLOCK_T, BLOCK_E] (bf16 / fp16 / fp32), upcast to fp32;
  2. score: softmax over E (SOFTMAX), sigmoid (+ correction bias for the selection key, SIGMOID_GROUPED),
     or the raw logits (TOPK_SOFTMAX, SIGMOID_TOP1);
  3. group-limited selection (SIGMOID_GROUPED with groups): group score = sum of the two best keys of the
     group, keep the best topk_group groups, mask the other experts to -inf. GroupReduce.AUTO takes each
     group's two best keys in two reductions over a [BLOCK_T, G, E / G] view of the keys when E and G are
     powers of two (deepseek-v3, H200: the route launch 1.6-2.0x faster than PER_GROUP, one masked pass over all
     experts per group);
     PER_GROUP otherwise;
  4. top-k by k rounds of one max over packed keys (KeyPacking, a constexpr derived from the logits dtype and
     the scoring); the winner is replaced by a "taken" value below every key, so -inf and NaN rows still
     select distinct experts in index order; ties go to the lower expert. NaN keys count as -inf, as in
     router/reference.py.
     SCORE_INT64: (order-preserving int32 image of the fp32 score) << 32 | (BLOCK_E - 1 - expert): one
       int64 max per round. Any dtype and scoring.
     LOGIT_INT32 (bf16 / fp16 logits; SOFTMAX, TOPK_SOFTMAX, SIGMOID_TOP1): the selection order of these
       scorings is the order of the raw logits (monotone transforms). The fp32 image of a bf16 (fp16) logit
       has 16 (13) zero low mantissa bits; the order-preserving int32 image (sign-magnitude -> two's
       complement, so -0.0 == +0.0) keeps them zero, and they hold BLOCK_E - 1 - expert (9 bits at most):
       one int32 max per round, half the ALU work. SOFTMAX: the probabilities are a non-strictly monotone
       function of the logits (exp underflow, fp32 absorption of tiny logits), so the k+1 best logits are
       checked: a row is ambiguous if two consecutive candidates with different logits have d = x - max
       (fp32) closer than 2**-16 or the first d below -69; a block with an ambiguous row redoes the selection
       with SCORE_INT64 on the probabilities (a runtime branch that random data never takes). A row with a NaN or
       +inf logit, or of only -inf, has NaN probabilities in the reference: ids 0..k-1 and NaN weights.
       SOFTMAX + renormalize then needs no exp over E at all: weights = e_sel / sum(e_sel);
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

import enum
import functools
import types

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .config import next_pow2, parse_enum, triton_interpreting

__all__ = [
    "GroupReduce",
    "KeyPacking",
    "KEY_PACKING_CODES",
    "resolve_key_packing",
    "MAX_EXPERTS",
    "MAX_TOP_K",
    "SCORING_CODES",
    "triton_interpreting",
    "build_jit_namespace",
    "jit_functions",
    "route_launch_params",
    "route_variant",
]

MAX_EXPERTS = 512
MAX_TOP_K = 16

# Scoring -> integer code seen by the kernels (keys are Scoring.value strings to avoid an import cycle).
SCORING_CODES = {"softmax": 0, "topk_softmax": 1, "sigmoid_grouped": 2, "sigmoid_top1": 3}




class KeyPacking(enum.Enum):
    """How the top-k rounds pack (key, expert) into one integer (see the module docstring, step 4)."""

    AUTO = "auto"  # LOGIT_INT32 where it is exact (bf16 / fp16 logits, not SIGMOID_GROUPED), else SCORE_INT64
    SCORE_INT64 = "score_int64"  # fp32 score << 32 | inverted expert: any dtype, any scoring
    LOGIT_INT32 = "logit_int32"  # raw bf16 / fp16 logit bits | inverted expert in the zero low bits

    @classmethod
    def parse(cls, value: "KeyPacking | str") -> "KeyPacking":
        return parse_enum(cls, value, "key_packing")


class GroupReduce(enum.Enum):
    """How SIGMOID_GROUPED with groups finds each group's two best keys (see the module docstring, step 3)."""

    AUTO = "auto"  # a [BLOCK_T, G, E / G] view of the keys where E and G are powers of two, else PER_GROUP
    PER_GROUP = "per_group"  # one masked pass over all experts per group

    @classmethod
    def parse(cls, value: "GroupReduce | str") -> "GroupReduce":
        return parse_enum(cls, value, "group_reduce")


# KeyPacking -> the kernels' KEY_PACKING constexpr (0: derived in the kernel from the logits dtype + scoring).
KEY_PACKING_CODES = {KeyPacking.AUTO: 0, KeyPacking.SCORE_INT64: 1, KeyPacking.LOGIT_INT32: 2}
_LOGIT_KEY_SCORINGS = ("softmax", "topk_softmax", "sigmoid_top1")


def resolve_key_packing(packing: "KeyPacking | str", logits_dtype, scoring: str) -> KeyPacking:
    """AUTO -> the packing the kernel picks; LOGIT_INT32 where it is not exact -> ValueError.
    logits_dtype: a torch dtype (or its name); scoring: a Scoring value string."""
    packing = KeyPacking.parse(packing)
    name = str(logits_dtype).replace("torch.", "")
    exact = name in ("bfloat16", "float16") and scoring in _LOGIT_KEY_SCORINGS
    if packing is KeyPacking.AUTO:
        return KeyPacking.LOGIT_INT32 if exact else KeyPacking.SCORE_INT64
    if packing is KeyPacking.LOGIT_INT32 and not exact:
        raise ValueError(f"key_packing: LOGIT_INT32 needs bf16 / fp16 logits and scoring in {_LOGIT_KEY_SCORINGS}, "
                         f"got {name} logits, scoring {scoring!r}")
    return packing


def _exp_f32(x, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


_TAKEN = tl.constexpr(-9223372036854775807)  # below every packed int64 key
_TAKEN32 = tl.constexpr(-2147483648)  # below every packed int32 logit key (-inf packs to -0x7F800000 | idx)
_INF_BITS = tl.constexpr(0x7F800000)  # fp32 +inf; a larger magnitude is a NaN


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


def _pack_logit_keys(x, cols, col_ok, NAN_AS_INF: tl.constexpr, BLOCK: tl.constexpr):
    """int32 per (row, col) ordered like (logit, -col), for bf16 / fp16 logits upcast to fp32 (low 16 / 13
    mantissa bits zero). Sign-magnitude -> two's complement (-0.0 and +0.0 both map to 0) keeps the low bits
    zero for both signs; they take BLOCK - 1 - col. NaN -> +inf (NAN_AS_INF) or -inf. Columns past E: taken."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    ordered = tl.where(bits < 0, -mag, mag)
    if NAN_AS_INF:
        ordered = tl.where(mag > _INF_BITS, _INF_BITS, ordered)
    else:
        ordered = tl.where(mag > _INF_BITS, -_INF_BITS, ordered)
    return tl.where(col_ok[None, :], ordered | (BLOCK - 1 - cols)[None, :], _TAKEN32)


def _unpack_logit(packed, BLOCK: tl.constexpr):
    """The fp32 logit of a packed int32 logit key (NaN came back as +-inf)."""
    ordered = packed & (-BLOCK)
    bits = tl.where(ordered < 0, (-ordered) | _TAKEN32, ordered)
    return bits.to(tl.float32, bitcast=True)


def _argmax_untaken(key, taken, cols, BLOCK: tl.constexpr):
    """Per row: index of the largest key among untaken columns, ties to the lower index."""
    cand = tl.where(taken, float("-inf"), key)
    best = tl.max(cand, axis=1)
    hit = (cand == best[:, None]) & (taken == 0)
    return tl.min(tl.where(hit, cols[None, :], BLOCK), axis=1)


def _softmax_probs(x, col_ok, USE_LIBDEVICE: tl.constexpr):
    """(softmax over the valid columns, row sum of the exponentials); NaN rows as torch.softmax."""
    xm = tl.where(col_ok[None, :], x, float("-inf"))
    row_max = tl.max(xm, axis=1)
    p = _exp_f32(xm - row_max[:, None], USE_LIBDEVICE)
    row_sum = tl.sum(p, axis=1)
    return p / row_sum[:, None], row_sum


def _topk_score_int64(key, cols, col_ok, kcols, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """SCORE_INT64 top-k of fp32 keys without NaN -> (ids, keys) [BLOCK_T, BLOCK_K], zero past TOP_K."""
    packed = tl.where(col_ok[None, :], _pack_keys(key, cols, BLOCK_E), _TAKEN)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    top_vals = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for j in range(TOP_K):
        best = tl.max(packed, axis=1)
        packed = tl.where(packed == best[:, None], _TAKEN, packed)
        top_ids = tl.where(kcols[None, :] == j, _unpack_index(best, BLOCK_E)[:, None], top_ids)
        top_vals = tl.where(kcols[None, :] == j, _unpack_key(best)[:, None], top_vals)
    return top_ids, top_vals


def _topk_logit_int32(x, cols, col_ok, kcols, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """LOGIT_INT32 top-k of the raw logits (NaN as -inf) -> ids [BLOCK_T, BLOCK_K] (TOPK_SOFTMAX,
    SIGMOID_TOP1)."""
    packed = _pack_logit_keys(x, cols, col_ok, False, BLOCK_E)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(packed, axis=1)
        packed = tl.where(packed == best[:, None], _TAKEN32, packed)
        top_ids = tl.where(kcols[None, :] == j, (BLOCK_E - 1 - (best & (BLOCK_E - 1)))[:, None], top_ids)
    return top_ids


def _softmax_logit_int32(x, cols, col_ok, kcols, row_ok, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                         RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """SOFTMAX with LOGIT_INT32 keys -> (ids, weights before routed_scaling_factor) [BLOCK_T, BLOCK_K].

    k rounds of one int32 max, plus one to find the best unselected logit; candidate j is then compared with
    candidate j+1: with d = x - max (fp32, as the reference), the probabilities keep the logits' order when
    the logits are equal, or when d_j >= -69 (exp(d_j) > 2**-100) and d_j - d_{j+1} >= 2**-16 (the
    exponentials then differ by far more than their rounding). Otherwise the row is ambiguous (exp underflow,
    a tiny logit absorbed by max) and the block redoes the selection on the probabilities with SCORE_INT64."""
    packed = _pack_logit_keys(x, cols, col_ok, True, BLOCK_E)  # NaN -> +inf: the row is NaN anyway
    top_packed = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)  # candidate j
    next_packed = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)  # candidate j + 1
    for j in tl.static_range(TOP_K + 1):
        if j < NUM_EXPERTS:
            best = tl.max(packed, axis=1)
            if j < TOP_K:
                packed = tl.where(packed == best[:, None], _TAKEN32, packed)
                top_packed = tl.where(kcols[None, :] == j, best[:, None], top_packed)
            if j > 0:
                next_packed = tl.where(kcols[None, :] == j - 1, best[:, None], next_packed)
    k_ok = kcols < TOP_K
    pair_ok = kcols < (TOP_K if TOP_K < NUM_EXPERTS else TOP_K - 1)
    top_ids = BLOCK_E - 1 - (top_packed & (BLOCK_E - 1))
    top_x = _unpack_logit(top_packed, BLOCK_E)
    row_max = tl.max(tl.where(k_ok[None, :], top_x, float("-inf")), axis=1)
    d = top_x - row_max[:, None]
    d_next = _unpack_logit(next_packed, BLOCK_E) - row_max[:, None]
    separated = (top_x == _unpack_logit(next_packed, BLOCK_E)) | ((d >= -69.0) & (d - d_next >= 1.52587890625e-05))
    top_e = tl.where(k_ok[None, :], _exp_f32(d, USE_LIBDEVICE), 0.0)
    # NaN or +inf in the row (max +inf after NaN -> +inf), or only -inf: torch.softmax gives NaN everywhere.
    row_bad = (row_max == float("inf")) | (row_max == float("-inf"))
    if RENORMALIZE:
        weights = top_e / tl.sum(top_e, axis=1)[:, None]
    else:
        e_all = _exp_f32(x - row_max[:, None], USE_LIBDEVICE)
        weights = top_e / tl.sum(tl.where(col_ok[None, :], e_all, 0.0), axis=1)[:, None]
    ambiguous = pair_ok[None, :] & (separated == 0) & (row_ok & (row_bad == 0))[:, None]
    if tl.max(tl.max(ambiguous.to(tl.int32), axis=1), axis=0) > 0:  # rare: exp underflow, absorbed tiny logits
        probs, row_sum = _softmax_probs(x, col_ok, USE_LIBDEVICE)
        key = tl.where(probs != probs, float("-inf"), probs)
        top_ids, weights = _topk_score_int64(key, cols, col_ok, kcols, TOP_K, BLOCK_T, BLOCK_E, BLOCK_K)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, axis=1)[:, None]
    top_ids = tl.where(row_bad[:, None], kcols[None, :], top_ids)
    weights = tl.where(row_bad[:, None], float("nan"), weights)
    return top_ids, weights


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
    KEY_PACKING: tl.constexpr = 0,
    GROUP_VIEW: tl.constexpr = 1,
):
    """Route tokens tok0 .. tok0+BLOCK_T-1 (rows past num_tokens are ignored). KEY_PACKING: KEY_PACKING_CODES
    (0 = AUTO: LOGIT_INT32 for 16-bit logits and SCORING != SIGMOID_GROUPED; the host validates 2).
    GROUP_VIEW: 1 = GroupReduce.AUTO, 0 = GroupReduce.PER_GROUP."""
    rows = tok0 + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    row_ok = rows < num_tokens
    col_ok = cols < NUM_EXPERTS
    k_ok = kcols < TOP_K
    out_offs = rows.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
    out_mask = row_ok[:, None] & k_ok[None, :]
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_logits + cols[None, :]
    x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    neg_inf = float("-inf")
    LOGIT_KEYS: tl.constexpr = (KEY_PACKING == 2) or (
        (KEY_PACKING == 0) and (SCORING != 2) and (logits_ptr.dtype.element_ty.primitive_bitwidth == 16))

    if LOGIT_KEYS and SCORING == 0:
        top_ids, weights = _softmax_logit_int32(x, cols, col_ok, kcols, row_ok, NUM_EXPERTS, TOP_K, RENORMALIZE,
                                                BLOCK_T, BLOCK_E, BLOCK_K, USE_LIBDEVICE)
    else:
        if LOGIT_KEYS:  # TOPK_SOFTMAX, SIGMOID_TOP1 on 16-bit logits
            top_ids = _topk_logit_int32(x, cols, col_ok, kcols, TOP_K, BLOCK_T, BLOCK_E, BLOCK_K)
        else:
            if SCORING == 0:  # SOFTMAX: probabilities over E, select on them
                raw_key, row_sum = _softmax_probs(x, col_ok, USE_LIBDEVICE)
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
                if GROUP_VIEW and BLOCK_E == NUM_EXPERTS and BLOCK_G == NUM_GROUPS:
                    # every group is one row of a [BLOCK_T, G, E / G] view: its two best keys in two reductions
                    grouped = tl.reshape(packed, (BLOCK_T, BLOCK_G, per_group))
                    best1 = tl.max(grouped, axis=2)
                    best2 = tl.max(tl.where(grouped == best1[:, :, None], _TAKEN, grouped), axis=2)
                    group_scores = _unpack_key(best1) + _unpack_key(best2)
                else:  # PER_GROUP, or E / the group count not a power of two: one masked pass per group
                    group_scores = tl.full([BLOCK_T, BLOCK_G], neg_inf, tl.float32)
                    for g in range(NUM_GROUPS):
                        c = tl.where(((group_of_col == g) & col_ok)[None, :], packed, _TAKEN)
                        best1 = tl.max(c, axis=1)
                        best2 = tl.max(tl.where(c == best1[:, None], _TAKEN, c), axis=1)
                        score = _unpack_key(best1) + _unpack_key(best2)
                        group_scores = tl.where(gcols[None, :] == g, score[:, None], group_scores)
                # inf + -inf (an infinite correction bias) is NaN: such a group ranks last, as in the twin
                group_scores = tl.where(group_scores != group_scores, neg_inf, group_scores)
                group_taken = tl.zeros([BLOCK_T, BLOCK_G], tl.int1) | (gcols >= NUM_GROUPS)[None, :]
                keep = tl.zeros([BLOCK_T, BLOCK_E], tl.int1)
                for _ in range(TOPK_GROUP):
                    gbest = _argmax_untaken(group_scores, group_taken, gcols, BLOCK_G)
                    group_taken = group_taken | (gcols[None, :] == gbest[:, None])
                    keep = keep | (group_of_col[None, :] == gbest[:, None])
                key = tl.where(keep, key, neg_inf)

            # Top-k: one int64 max per round (key bits, then the inverted index for ties to the lower index).
            top_ids, top_vals = _topk_score_int64(key, cols, col_ok, kcols, TOP_K, BLOCK_T, BLOCK_E, BLOCK_K)

        # The selected keys are the scores except where NaN became -inf (and SIGMOID_GROUPED's bias):
        # re-derive the weight sources from the selected logits (a k-element gather, same arithmetic).
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
    KEY_PACKING: tl.constexpr = 0,
    DEPENDENT_LAUNCH: tl.constexpr = 0,
    GROUP_VIEW: tl.constexpr = 1,
):
    """Grid: (cdiv(T, BLOCK_T),). Each program routes one block of tokens."""
    if DEPENDENT_LAUNCH >= 1:  # programmatic dependent launch: wait for the previous kernel's results
        tl.extra.cuda.gdc_wait()
    if DEPENDENT_LAUNCH == 2:  # a small launch: the next kernel's grid may start now (else: as blocks exit)
        tl.extra.cuda.gdc_launch_dependents()
    tok0 = tl.program_id(0) * BLOCK_T
    route_token_block(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr, tok0, num_tokens, stride_logits, routed_scaling_factor,
        NUM_EXPERTS, TOP_K, SCORING, RENORMALIZE, HAS_BIAS, NUM_GROUPS, TOPK_GROUP,
        BLOCK_T, BLOCK_E, BLOCK_K, BLOCK_G, USE_LIBDEVICE, KEY_PACKING, GROUP_VIEW,
    )


_JIT_NAMES = ("_exp_f32", "_pack_keys", "_unpack_index", "_unpack_key", "_pack_logit_keys", "_unpack_logit",
              "_argmax_untaken", "_softmax_probs", "_topk_score_int64", "_topk_logit_int32", "_softmax_logit_int32",
              "route_token_block", "route_kernel")


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
    block_e = max(16, next_pow2(num_experts))
    cap = max(1, 2048 // block_e)
    spread = next_pow2(max(1, -(-num_tokens // num_sms)))
    block_t = max(1, min(cap, spread))
    elems = block_t * block_e
    num_warps = 4 if elems >= 1024 else (2 if elems >= 256 else 1)
    return block_t, block_e, num_warps


def launch_route(logits, config, bias, *, key_packing_code: int = 0, block_t: int | None = None,
                 num_warps: int | None = None, launch_options: dict | None = None,
                 group_reduce: GroupReduce = GroupReduce.AUTO):
    """Allocate (topk_weights fp32, topk_ids int32) and launch route_kernel on checked arguments (router.api.route
    and route_variant check them). key_packing_code: KEY_PACKING_CODES (0 = AUTO); block_t / num_warps:
    route_launch_params by default; launch_options: extra launch keywords (programmatic dependent launch)."""
    import torch

    from . import api  # (api imports this module lazily: no import cycle at load)

    num_tokens, num_experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    meta = api._route_meta(config, num_experts, bias is not None, logits.device)
    weights = torch.empty(num_tokens, config.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, config.top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    auto_t, block_e, auto_warps = route_launch_params(num_tokens, num_experts, api._num_sms(logits.device))
    block_t = auto_t if block_t is None else block_t
    num_warps = auto_warps if num_warps is None else num_warps
    jit_functions().route_kernel[(-(-num_tokens // block_t),)](
        logits, bias if bias is not None else weights, weights, ids, num_tokens, logits.stride(0),
        float(config.routed_scaling_factor), BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps,
        KEY_PACKING=key_packing_code, GROUP_VIEW=int(group_reduce is GroupReduce.AUTO), **meta,
        **(launch_options or {}),
    )
    return weights, ids


def route_variant(logits, config, e_score_correction_bias=None, *, key_packing: "KeyPacking | str" = KeyPacking.AUTO,
                  block_t: int | None = None, num_warps: int | None = None,
                  group_reduce: "GroupReduce | str" = GroupReduce.AUTO):
    """route(..., backend=TRITON) with the kernel choices spelled out (benchmarks and tests compare them):
    key_packing (LOGIT_INT32 where not exact -> ValueError), block_t (tokens per program, a power of two),
    num_warps (default: route_launch_params) and group_reduce. Same results as route() for every choice."""
    from .api import _check_route_args

    _check_route_args(logits, config, e_score_correction_bias)
    packing = resolve_key_packing(key_packing, logits.dtype, config.scoring.value)
    if block_t is not None and (block_t < 1 or block_t & (block_t - 1)):
        raise ValueError(f"block_t: expected a power of two, got {block_t}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps: expected 1, 2, 4, 8 or 16, got {num_warps}")
    group_reduce = GroupReduce.parse(group_reduce)
    return launch_route(logits, config, e_score_correction_bias, key_packing_code=KEY_PACKING_CODES[packing],
                        block_t=block_t, num_warps=num_warps, group_reduce=group_reduce)
