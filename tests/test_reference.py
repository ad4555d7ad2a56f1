"""The torch reference of the whole MoE forward, checked against plain per-token loops written here.

The loops below share no code with moe2cta: routing is done with Python floats (fp64) and sorted() with an
explicit (score desc, index asc) key; experts run one token and one slot at a time in fp64.
"""
from __future__ import annotations

import math

import pytest
import torch

from moe2cta import Activation, RouterWeightOn, RoutingConfig, Scoring, moe_forward_reference, moe_reference
from moe2cta.router.reference import dispatch_reference, max_rows_for, route_reference

# ----------------------------------------------------------------------------------------------------------
# Independent loop definitions


def _softmax(values):
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _best(scores, candidates, k):
    """k candidates with the highest score; ties -> lower index."""
    return sorted(candidates, key=lambda e: (-scores[e], e))[:k]


def route_loop(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None):
    num_tokens, num_experts = logits.shape
    k = cfg.top_k
    weights = torch.zeros(num_tokens, k, dtype=torch.float64)
    ids = torch.zeros(num_tokens, k, dtype=torch.int64)
    for t in range(num_tokens):
        row = [float(v) for v in logits[t].double()]
        experts = list(range(num_experts))
        if cfg.scoring is Scoring.SOFTMAX:
            probs = _softmax(row)
            chosen = _best(probs, experts, k)
            w = [probs[e] for e in chosen]
            if cfg.renormalize:
                w = [x / sum(w) for x in w]
        elif cfg.scoring is Scoring.TOPK_SOFTMAX:
            chosen = _best(row, experts, k)
            w = _softmax([row[e] for e in chosen])
        elif cfg.scoring is Scoring.SIGMOID_TOP1:
            chosen = _best(row, experts, k)
            w = [_sigmoid(row[e]) for e in chosen]
            if cfg.renormalize and k > 1:
                w = [x / sum(w) for x in w]
        else:  # SIGMOID_GROUPED
            scores = [_sigmoid(v) for v in row]
            biased = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
            allowed = experts
            if cfg.num_expert_group is not None:
                size = num_experts // cfg.num_expert_group
                group_score = []
                for g in range(cfg.num_expert_group):
                    members = sorted((biased[e] for e in range(g * size, (g + 1) * size)), reverse=True)
                    group_score.append(members[0] + members[1])
                groups = _best(group_score, list(range(cfg.num_expert_group)), cfg.topk_group)
                allowed = [e for e in experts if e // size in groups]
            chosen = _best(biased, allowed, k)
            w = [scores[e] for e in chosen]
            if cfg.renormalize:
                w = [x / sum(w) for x in w]
        weights[t] = torch.tensor([x * cfg.routed_scaling_factor for x in w], dtype=torch.float64)
        ids[t] = torch.tensor(chosen)
    return weights, ids


def _act_loop(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    out = torch.empty_like(gate)
    for n in range(gate.shape[0]):
        g, u = float(gate[n]), float(up[n])
        if activation is Activation.SWIGLU:
            out[n] = g * _sigmoid(g) * u
        elif activation is Activation.GELU_GATED:
            out[n] = 0.5 * g * (1.0 + math.erf(g / math.sqrt(2.0))) * u
        else:
            g = min(g, 7.0)
            u = max(-7.0, min(u, 7.0))
            out[n] = (u + 1.0) * g * _sigmoid(1.702 * g)
    return out


def moe_loop(hidden, w13, w2, weights, ids, activation=Activation.SWIGLU, b13=None, b2=None, expert_map=None,
             weight_on=RouterWeightOn.OUTPUT):
    """fp64: out[t] = sum over slots j (in order) of w * expert(x); slots off this rank add nothing."""
    num_tokens, top_k = ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e]) if e >= 0 else -1
            if e < 0:
                continue
            w = float(weights[t, j])
            x = hidden[t].double()
            if weight_on is RouterWeightOn.INPUT:
                x = x * w
            h = w13[e].double() @ x
            if b13 is not None:
                h = h + b13[e].double()
            a = _act_loop(h[:inter], h[inter:], activation)
            y = w2[e].double() @ a
            if b2 is not None:
                y = y + b2[e].double()
            if weight_on is RouterWeightOn.OUTPUT:
                y = y * w
            out[t] += y
    return out


def make_layer(num_tokens, hidden, inter, num_experts, dtype=torch.float32, bias=False, integer=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if integer:
        def rnd(*shape, scale=None):
            return torch.randint(-2, 3, shape, generator=gen).to(dtype)
    else:
        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(dtype)
    x = rnd(num_tokens, hidden, scale=1.0)
    w13 = rnd(num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w2 = rnd(num_experts, hidden, inter, scale=inter ** -0.5)
    b13 = rnd(num_experts, 2 * inter, scale=0.5) if bias else None
    b2 = rnd(num_experts, hidden, scale=0.5) if bias else None
    return x, w13, w2, b13, b2


def distinct_ids(num_tokens, k, num_experts, gen) -> torch.Tensor:
    """[T, k] int32: k distinct random experts per token."""
    return torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :k].int().contiguous()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-12))


# ----------------------------------------------------------------------------------------------------------
# Routing

ROUTINGS = [
    RoutingConfig(top_k=2, scoring=Scoring.SOFTMAX, renormalize=True),
    RoutingConfig(top_k=3, scoring=Scoring.SOFTMAX, renormalize=False),
    RoutingConfig(top_k=4, scoring=Scoring.TOPK_SOFTMAX),
    RoutingConfig(top_k=1, scoring=Scoring.SIGMOID_TOP1),
    RoutingConfig(top_k=2, scoring=Scoring.SIGMOID_TOP1, renormalize=False, routed_scaling_factor=0.5),
    RoutingConfig(top_k=4, scoring=Scoring.SIGMOID_GROUPED, renormalize=True, routed_scaling_factor=2.5),
    RoutingConfig(top_k=4, scoring=Scoring.SIGMOID_GROUPED, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
    RoutingConfig(top_k=3, scoring=Scoring.SIGMOID_GROUPED, renormalize=False, num_expert_group=8, topk_group=3),
]


@pytest.mark.parametrize("cfg", ROUTINGS, ids=lambda c: f"{c.scoring.value}-k{c.top_k}-g{c.num_expert_group}")
@pytest.mark.parametrize("data", ["random", "integer"])
def test_route_matches_loop(cfg, data):
    gen = torch.Generator().manual_seed(1)
    num_experts = 32
    if data == "random":
        logits = torch.randn(17, num_experts, generator=gen) * 2
        bias = torch.randn(num_experts, generator=gen) * 0.1
    else:  # many exact ties: the lower expert index must win everywhere
        logits = torch.randint(0, 4, (17, num_experts), generator=gen).float()
        bias = torch.randint(0, 3, (num_experts,), generator=gen).float() / 8
    bias = bias if cfg.scoring is Scoring.SIGMOID_GROUPED else None
    weights, ids = route_reference(logits, cfg, bias)
    want_w, want_ids = route_loop(logits, cfg, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (17, cfg.top_k)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=2e-6, atol=1e-7)


def test_route_tie_break_lower_index():
    logits = torch.zeros(3, 8)
    logits[1, 5] = logits[1, 6] = 1.0
    _, ids = route_reference(logits, RoutingConfig(top_k=3))
    assert ids.tolist() == [[0, 1, 2], [5, 6, 0], [0, 1, 2]]


def test_route_bf16_logits_use_fp32_math():
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    cfg = RoutingConfig(top_k=2)
    weights, ids = route_reference(logits, cfg)
    want_w, want_ids = route_loop(logits.float(), cfg)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=2e-6, atol=1e-7)


def test_route_nan_and_inf_logits():
    """NaN never wins a slot over a number; softmax spreads a NaN / +inf to its own row's weights only."""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    logits[2, 3] = float("nan")
    logits[1, 6] = float("inf")
    weights, ids = route_reference(logits, RoutingConfig(top_k=2))
    assert ids[2].tolist() == [0, 1] and torch.isnan(weights[2]).all()  # all-NaN probabilities: index order
    assert torch.isnan(weights[1]).all()
    assert torch.isfinite(weights[[0, 3]]).all()
    for cfg in (RoutingConfig(top_k=2, scoring=Scoring.TOPK_SOFTMAX), RoutingConfig(top_k=2, scoring=Scoring.SIGMOID_TOP1),
                RoutingConfig(top_k=2, scoring=Scoring.SIGMOID_GROUPED)):
        weights, ids = route_reference(logits, cfg)
        assert 3 not in ids[2].tolist() and torch.isfinite(weights[2]).all()
        assert 6 in ids[1].tolist()
        assert torch.isfinite(weights[[0, 3]]).all()


# ----------------------------------------------------------------------------------------------------------
# Dispatch


def dispatch_loop(ids: torch.Tensor, num_experts: int, align: int, heights, expert_map=None):
    num_tokens, k = ids.shape
    local = []
    for slot in range(num_tokens * k):
        e = int(ids.view(-1)[slot])
        if expert_map is not None:
            e = int(expert_map[e]) if e >= 0 else -1
        local.append(e)
    counts = [sum(1 for e in local if e == x) for x in range(num_experts)]
    token_offsets, row_offsets = [0], [0]
    for c in counts:
        token_offsets.append(token_offsets[-1] + c)
        row_offsets.append(row_offsets[-1] + (c + align - 1) // align * align)
    tiles = []
    for h in heights:
        acc = [0]
        for c in counts:
            acc.append(acc[-1] + (c + h - 1) // h)
        tiles.append(acc)
    max_rows = num_tokens * k + num_experts * (align - 1)
    sorted_slots = [-1] * max_rows
    slot_rows = [-1] * (num_tokens * k)
    for e in range(num_experts):
        row = row_offsets[e]
        for slot in range(num_tokens * k):  # slot order = token, then j: stable
            if local[slot] == e:
                sorted_slots[row] = slot
                slot_rows[slot] = row
                row += 1
    return counts, token_offsets, row_offsets, tiles, sorted_slots, slot_rows


@pytest.mark.parametrize(
    "num_tokens,k,num_experts,align,skew",
    [(0, 2, 8, 128, "uniform"), (1, 2, 8, 16, "uniform"), (13, 2, 8, 16, "uniform"), (9, 3, 6, 4, "one"),
     (20, 4, 16, 8, "zero-experts"), (7, 8, 256, 1, "uniform")],
)
def test_dispatch_matches_loop(num_tokens, k, num_experts, align, skew):
    gen = torch.Generator().manual_seed(5)
    if skew == "one":
        ids = torch.full((num_tokens, k), 4, dtype=torch.int32)
    elif skew == "zero-experts":  # only even experts get tokens
        ids = (torch.randint(0, num_experts // 2, (num_tokens, k), generator=gen) * 2).int()
    else:
        ids = distinct_ids(num_tokens, k, num_experts, gen)
    heights = (16, 64)
    disp = dispatch_reference(ids, num_experts, align=align, tile_heights=heights)
    counts, token_offsets, row_offsets, tiles, sorted_slots, slot_rows = dispatch_loop(ids, num_experts, align, heights)
    assert disp.counts.tolist() == counts
    assert disp.token_offsets.tolist() == token_offsets
    assert disp.row_offsets.tolist() == row_offsets
    assert disp.tile_offsets.tolist() == tiles
    assert disp.sorted_slots.tolist() == sorted_slots
    assert disp.slot_rows.tolist() == slot_rows
    assert disp.sorted_slots.shape[0] == max_rows_for(num_tokens, k, num_experts, align)
    for t in (disp.counts, disp.token_offsets, disp.row_offsets, disp.tile_offsets, disp.sorted_slots, disp.slot_rows):
        assert t.dtype == torch.int32


def test_dispatch_expert_map():
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 8, (11, 2), generator=gen).int()
    ids[3, 1] = -1  # an unused slot
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)  # 4 local experts
    disp = dispatch_reference(ids, 4, align=4, expert_map=expert_map)
    counts, token_offsets, row_offsets, _, sorted_slots, slot_rows = dispatch_loop(ids, 4, 4, (16,), expert_map)
    assert disp.counts.tolist() == counts
    assert disp.row_offsets.tolist() == row_offsets
    assert disp.sorted_slots.tolist() == sorted_slots
    assert disp.slot_rows.tolist() == slot_rows
    assert disp.slot_rows[3 * 2 + 1] == -1


# ----------------------------------------------------------------------------------------------------------
# Whole forward

CASES = [
    # name, T, H, I, E, routing, activation, bias, weight_on
    ("e8k2-swiglu", 9, 32, 16, 8, RoutingConfig(top_k=2), Activation.SWIGLU, False, RouterWeightOn.OUTPUT),
    ("e8k2-gelu", 6, 16, 24, 8, RoutingConfig(top_k=2, renormalize=False), Activation.GELU_GATED, False,
     RouterWeightOn.OUTPUT),
    ("gptoss", 7, 32, 16, 8, RoutingConfig(top_k=4, scoring=Scoring.TOPK_SOFTMAX), Activation.SWIGLU_OAI, True,
     RouterWeightOn.OUTPUT),
    ("llama4", 5, 16, 16, 8, RoutingConfig(top_k=1, scoring=Scoring.SIGMOID_TOP1), Activation.SWIGLU, False,
     RouterWeightOn.INPUT),
    ("dsv3", 6, 16, 8, 32, RoutingConfig(top_k=4, scoring=Scoring.SIGMOID_GROUPED, num_expert_group=4, topk_group=2,
                                         routed_scaling_factor=2.5), Activation.SWIGLU, False, RouterWeightOn.OUTPUT),
    ("e256k8", 6, 16, 8, 256, RoutingConfig(top_k=8), Activation.SWIGLU, False, RouterWeightOn.OUTPUT),
    ("t1", 1, 16, 8, 8, RoutingConfig(top_k=2), Activation.SWIGLU, False, RouterWeightOn.OUTPUT),
    ("t0", 0, 16, 8, 8, RoutingConfig(top_k=2), Activation.SWIGLU, False, RouterWeightOn.OUTPUT),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_loop_fp32(case):
    name, num_tokens, hidden, inter, num_experts, routing, activation, bias, weight_on = case
    x, w13, w2, b13, b2 = make_layer(num_tokens, hidden, inter, num_experts, bias=bias, seed=len(name))
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(7))
    corr = torch.randn(num_experts, generator=torch.Generator().manual_seed(8)) * 0.1
    corr = corr if routing.scoring is Scoring.SIGMOID_GROUPED else None
    out = moe_forward_reference(x, w13, w2, logits, routing, activation=activation, b13=b13, b2=b2,
                                e_score_correction_bias=corr, router_weight_on=weight_on, align=8)
    weights, ids = route_loop(logits, routing, corr)
    want = moe_loop(x, w13, w2, weights, ids, activation, b13, b2, weight_on=weight_on)
    assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32
    if num_tokens == 0:
        return
    assert rel_err(out, want) < 1e-5
    # the direct per-expert definition agrees too
    direct = moe_reference(x, w13, w2, weights.float(), ids.int(), activation, b13, b2, router_weight_on=weight_on)
    assert rel_err(direct, want) < 1e-5


def test_string_options_are_parsed_not_ignored():
    """router_weight_on / activation given as strings act as their enums (a string matched neither enum member
    before, so the router weights were silently left out); an unknown string is an error naming the argument."""
    x, w13, w2, _, _ = make_layer(6, 16, 8, 8, seed=12)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(13))
    routing = RoutingConfig(top_k=2)
    weights, ids = route_reference(logits, routing)
    for on in RouterWeightOn:
        want = moe_reference(x, w13, w2, weights, ids, Activation.GELU_GATED, router_weight_on=on)
        assert torch.equal(moe_reference(x, w13, w2, weights, ids, "gelu_gated", router_weight_on=on.value), want)
        want = moe_forward_reference(x, w13, w2, logits, routing, activation=Activation.GELU_GATED, router_weight_on=on)
        got = moe_forward_reference(x, w13, w2, logits, routing, activation="gelu_gated", router_weight_on=on.value)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="^router_weight_on: expected one of"):
        moe_reference(x, w13, w2, weights, ids, router_weight_on="both")
    with pytest.raises(ValueError, match="^activation: expected one of"):
        moe_forward_reference(x, w13, w2, logits, routing, activation="relu")


def test_routing_config_checks_its_types():
    assert RoutingConfig(top_k=2, routed_scaling_factor=2).routed_scaling_factor == 2.0
    for kwargs, error, name in [
        (dict(routed_scaling_factor="2.5"), TypeError, "routed_scaling_factor"),
        (dict(routed_scaling_factor=True), TypeError, "routed_scaling_factor"),
        (dict(routed_scaling_factor=torch.ones(2)), TypeError, "routed_scaling_factor"),
        (dict(routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor"),
        (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor"),
        (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
        (dict(renormalize="no"), TypeError, "renormalize"),
        (dict(scoring="sigmoid_grouped", num_expert_group=2.0, topk_group=1), TypeError, "num_expert_group"),
        (dict(scoring="sigmoid_grouped", num_expert_group=True, topk_group=1), TypeError, "num_expert_group"),
        (dict(scoring="sigmoid_grouped", num_expert_group=4, topk_group="2"), TypeError, "topk_group"),
    ]:
        with pytest.raises(error, match=f"^{name}: expected"):
            RoutingConfig(top_k=2, **kwargs)


@pytest.mark.parametrize("activation", list(Activation))
def test_forward_small_integers_exact(activation):
    """Small-integer inputs: every product and sum is exact in fp32 (SwiGLU's sigmoid is not, so compare
    against the loop in fp64 with a tight bound)."""
    x, w13, w2, _, _ = make_layer(10, 16, 8, 8, integer=True, seed=9)
    gen = torch.Generator().manual_seed(10)
    ids = distinct_ids(10, 2, 8, gen)
    weights = torch.randint(1, 4, (10, 2), generator=gen).float() / 4
    out = moe_forward_reference(x, w13, w2, None, RoutingConfig(top_k=2), topk_weights=weights, topk_ids=ids,
                                activation=activation, align=4)
    want = moe_loop(x, w13, w2, weights.double(), ids, activation)
    assert rel_err(out, want) < 1e-6


def test_forward_expert_map_slots_off_rank_add_zero():
    x, w13_all, w2_all, _, _ = make_layer(12, 16, 8, 8, seed=11)
    local = [1, 4, 6]
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(3, dtype=torch.int32)
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(12))
    routing = RoutingConfig(top_k=3)
    out = moe_forward_reference(x, w13_all[local], w2_all[local], logits, routing, expert_map=expert_map, align=4)
    weights, ids = route_loop(logits, routing)
    want = moe_loop(x, w13_all[local], w2_all[local], weights, ids, expert_map=expert_map)
    assert rel_err(out, want) < 1e-5
    # the sum over ranks of disjoint expert sets is the single-device layer
    rest = [e for e in range(8) if e not in local]
    other_map = torch.full((8,), -1, dtype=torch.int32)
    other_map[rest] = torch.arange(len(rest), dtype=torch.int32)
    out_rest = moe_forward_reference(x, w13_all[rest], w2_all[rest], logits, routing, expert_map=other_map, align=4)
    full = moe_forward_reference(x, w13_all, w2_all, logits, routing, align=4)
    assert rel_err(out + out_rest, full) < 1e-5


def test_both_references_read_off_rank_ids_as_dispatch_does():
    """An id outside [0, len(expert_map)) or [0, E), a map entry outside [0, E) and an int64 value past int32 are
    off-rank (docs/design.md): the slot adds zero in moe_reference as in moe_forward_reference (dispatch), no
    IndexError and no wrap."""
    x, w13, w2, _, _ = make_layer(4, 16, 8, 4, seed=21)
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(22))
    ids = torch.tensor([[1, 2**32 + 1], [0, 3], [7, 2], [-1, 2**40]], dtype=torch.int64)
    expert_map = torch.tensor([0, 1, 2**32 + 3, 3, -1, 5, 2], dtype=torch.int64)  # 7 global ids, 4 local experts
    for emap in (None, expert_map):
        on_rank = []  # the local expert of each slot, -1 off-rank
        for i in ids.reshape(-1).tolist():
            local = i if emap is None else (int(emap[i]) if 0 <= i < emap.shape[0] else -1)
            on_rank.append(local if 0 <= local < 4 else -1)
        want = moe_loop(x, w13, w2, weights, torch.tensor(on_rank).reshape(4, 2))
        got = moe_reference(x, w13, w2, weights, ids, expert_map=emap)
        assert torch.equal(got, moe_forward_reference(x, w13, w2, None, None, topk_weights=weights, topk_ids=ids,
                                                      expert_map=emap))
        assert rel_err(got, want) < 1e-6


def test_forward_all_tokens_one_expert_and_zero_token_experts():
    x, w13, w2, _, _ = make_layer(16, 16, 8, 8, seed=13)
    logits = torch.full((16, 8), -5.0)
    logits[:, 3] = 5.0  # everybody's first choice is expert 3; second choice: expert 0 by tie-break
    routing = RoutingConfig(top_k=2, renormalize=False)
    out = moe_forward_reference(x, w13, w2, logits, routing, align=16)
    weights, ids = route_loop(logits, routing)
    assert set(ids[:, 0].tolist()) == {3} and set(ids[:, 1].tolist()) == {0}
    assert rel_err(out, moe_loop(x, w13, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_low_precision_within_2x_of_torch(dtype):
    """The pipeline in bf16/fp16 (fp32 accumulation, stage outputs in the input dtype) is as accurate as a
    plain same-dtype torch computation, within 2x."""
    x, w13, w2, _, _ = make_layer(24, 64, 32, 8, dtype=dtype, seed=14)
    logits = torch.randn(24, 8, generator=torch.Generator().manual_seed(15))
    routing = RoutingConfig(top_k=2)
    out = moe_forward_reference(x, w13, w2, logits, routing, align=16)
    assert out.dtype == dtype
    weights, ids = route_loop(logits, routing)
    want = moe_loop(x.double(), w13.double(), w2.double(), weights, ids)
    # same-dtype torch run: per slot, matmuls in `dtype`
    plain = torch.zeros(24, 64, dtype=torch.float32)
    for t in range(24):
        for j in range(2):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            a = (torch.nn.functional.silu(h[:32].float()) * h[32:].float()).to(dtype)
            plain[t] += float(weights[t, j]) * (w2[e] @ a).float()
    torch_err = rel_err(plain.to(dtype), want)
    assert rel_err(out, want) <= 2 * torch_err + 1e-3


@pytest.mark.parametrize("activation", list(Activation))
def test_fp64_reference_is_fp64_throughout(activation):
    """moe_reference(dtype=float64) against a per-token fp64 loop: fp64 round-off, not the fp32 epilogue's."""
    from moe2cta.grouped_gemm.epilogue import gated_activation

    gen = torch.Generator().manual_seed(5)
    tokens, hidden, inter, experts, k = 12, 64, 32, 4, 2
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=torch.float64) / 8
    w2 = torch.randn(experts, hidden, inter, generator=gen, dtype=torch.float64) / 6
    weights = torch.rand(tokens, k, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, experts, (tokens, k), generator=gen)
    got = moe_reference(x, w13, w2, weights, ids, activation, dtype=torch.float64)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            h = w13[ids[t, j]] @ x[t]
            expected[t] += weights[t, j] * (w2[ids[t, j]] @ gated_activation(h[:inter], h[inter:], activation))
    assert float((got - expected).norm() / expected.norm()) < 1e-13


def test_references_run_fp32_matmuls_at_highest_precision_whatever_the_process_set(monkeypatch):
    """A process that set "medium" (bf16 fp32 matmuls on a CPU with bf16 units, TF32 on a GPU) gets the same
    reference as at "highest", and its setting back. The precision each reference's epilogue runs under is recorded,
    so that the test fails without the guard also on a CPU whose "medium" changes nothing."""
    import moe2cta.grouped_gemm.reference as gemm_reference
    import moe2cta.reference as layer_reference

    seen = []
    for module in (layer_reference, gemm_reference):
        real = module.apply_activation

        def recording(gate, up, activation, real=real):
            seen.append(torch.get_float32_matmul_precision())
            return real(gate, up, activation)

        monkeypatch.setattr(module, "apply_activation", recording)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(32, 256, generator=gen)
    w13 = torch.randn(4, 128, 256, generator=gen) / 16
    w2 = torch.randn(4, 256, 64, generator=gen) / 8
    logits = torch.randn(32, 4, generator=gen)
    weights, ids = route_reference(logits, RoutingConfig(top_k=2))
    routing = RoutingConfig(top_k=2)
    exact = (moe_reference(x, w13, w2, weights, ids), moe_forward_reference(x, w13, w2, logits, routing))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert torch.equal(moe_reference(x, w13, w2, weights, ids), exact[0])
        assert torch.equal(moe_forward_reference(x, w13, w2, logits, routing), exact[1])
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen and set(seen) == {"highest"}


def test_fp32_matmuls_under_torchs_per_backend_precision_switches():
    """torch >= 2.9's per-backend switches (after which torch refuses the global query): each set to "ieee" inside,
    restored after."""
    from moe2cta.grouped_gemm.reference import fp32_matmuls

    switches = [torch.backends.cuda.matmul, torch.backends.mkldnn.matmul]
    if not all(hasattr(s, "fp32_precision") for s in switches):
        pytest.skip("this torch has no per-backend fp32 precision switches")
    saved = [s.fp32_precision for s in switches]
    try:
        switches[0].fp32_precision, switches[1].fp32_precision = "tf32", "bf16"
        inside = []
        with fp32_matmuls():
            inside = [s.fp32_precision for s in switches]
        assert inside == ["ieee", "ieee"]
        assert [s.fp32_precision for s in switches] == ["tf32", "bf16"]
        x = torch.randn(8, 64)
        moe_reference(x, torch.randn(2, 64, 64), torch.randn(2, 64, 32), torch.rand(8, 1), torch.randint(0, 2, (8, 1)))
    finally:
        for switch, value in zip(switches, saved):
            switch.fp32_precision = value
        torch.set_float32_matmul_precision("highest")  # (the default; leaves the legacy query usable)


def test_forward_reference_takes_one_routing():
    x, w13, w2 = torch.randn(4, 64), torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    logits = torch.randn(4, 2)
    weights, ids = route_reference(logits, RoutingConfig(top_k=1))
    routing = RoutingConfig(top_k=1)
    with pytest.raises(ValueError, match="topk_weights, topk_ids: expected both or neither, got topk_ids alone"):
        moe_forward_reference(x, w13, w2, None, routing, topk_ids=ids)
    with pytest.raises(ValueError, match="expected both or neither, got topk_weights alone"):
        moe_forward_reference(x, w13, w2, logits, routing, topk_weights=weights)
    with pytest.raises(ValueError, match="router_logits: expected either router_logits or .* got both"):
        moe_forward_reference(x, w13, w2, logits, routing, topk_weights=weights, topk_ids=ids)
    with pytest.raises(ValueError, match="router_logits: .* got neither"):
        moe_forward_reference(x, w13, w2, None, routing)
    torch.testing.assert_close(moe_forward_reference(x, w13, w2, None, routing, topk_weights=weights, topk_ids=ids),
                               moe_forward_reference(x, w13, w2, logits, routing))
