"""Every bad input gets a ValueError / TypeError naming the argument, before any kernel runs."""
from __future__ import annotations

import pytest
import torch

import moe2cta
from moe2cta import Backend, IdCheck, RoutingConfig, Scoring, fused_moe, is_supported
from moe2cta.api import _layer_support
from moe2cta.config import MoEConfig

T, H, I, E, K = 5, 32, 16, 8, 2


def good_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return dict(
        hidden=torch.randn(T, H, generator=gen).to(dtype),
        w13=(torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(dtype),
        w2=(torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype),
        router_logits=torch.randn(T, E, generator=gen),
        routing=RoutingConfig(top_k=K),
    )


def precomputed_inputs():
    kw = good_inputs()
    del kw["router_logits"]
    kw["topk_ids"] = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [7, 0]], dtype=torch.int32)
    kw["topk_weights"] = torch.full((T, K), 0.5)
    return kw


def call(kw):
    kw = dict(kw)
    return fused_moe(kw.pop("hidden"), kw.pop("w13"), kw.pop("w2"), kw.pop("router_logits", None), **kw)


def test_good_inputs_run():
    assert call(good_inputs()).shape == (T, H)
    assert call(precomputed_inputs()).shape == (T, H)


def _set(**changes):
    def mutate(kw):
        kw.update(changes)
        return kw
    return mutate


def _drop(*names):
    def mutate(kw):
        for name in names:
            kw.pop(name, None)
        return kw
    return mutate


BAD_LOGIT_CALLS = [
    # (id, mutation, exception, argument named in the message)
    ("hidden-not-tensor", _set(hidden=[[1.0] * H] * T), TypeError, "hidden"),
    ("hidden-1d", _set(hidden=torch.randn(H)), ValueError, "hidden"),
    ("hidden-3d", _set(hidden=torch.randn(1, T, H)), ValueError, "hidden"),
    ("hidden-wrong-H", _set(hidden=torch.randn(T, H + 1)), ValueError, "hidden"),
    ("hidden-int", _set(hidden=torch.ones(T, H, dtype=torch.int32)), TypeError, "hidden"),
    ("w13-2d", _set(w13=torch.randn(2 * I, H)), ValueError, "w13"),
    ("w13-odd-rows", _set(w13=torch.randn(E, 2 * I + 1, H)), ValueError, "w13"),
    ("w13-not-tensor", _set(w13=None), TypeError, "w13"),
    ("w2-2d", _set(w2=torch.randn(H, I)), ValueError, "w2"),
    ("w2-wrong-E", _set(w2=torch.randn(E + 1, H, I)), ValueError, "w2"),
    ("w2-wrong-H", _set(w2=torch.randn(E, H + 2, I)), ValueError, "w2"),
    ("w2-wrong-I", _set(w2=torch.randn(E, H, I + 2)), ValueError, "w2"),
    ("w2-transposed", _set(w2=torch.randn(E, I, H)), ValueError, "w2"),
    ("logits-1d", _set(router_logits=torch.randn(E)), ValueError, "router_logits"),
    ("logits-wrong-E", _set(router_logits=torch.randn(T, E + 1)), ValueError, "router_logits"),
    ("logits-wrong-T", _set(router_logits=torch.randn(T + 1, E)), ValueError, "router_logits"),
    ("logits-int", _set(router_logits=torch.ones(T, E, dtype=torch.int64)), TypeError, "router_logits"),
    ("fp32-weights-bf16-hidden", _set(hidden=torch.randn(T, H).bfloat16()), TypeError, "w13"),
    ("w2-dtype", _set(w2=torch.randn(E, H, I).half()), TypeError, "w2"),
    ("b13-dtype", _set(b13=torch.randn(E, 2 * I).half()), TypeError, "b13"),
    ("b13-shape", _set(b13=torch.randn(E, I)), ValueError, "b13"),
    ("b2-shape", _set(b2=torch.randn(E, I)), ValueError, "b2"),
    ("top_k-gt-E", _set(routing=RoutingConfig(top_k=E + 1)), ValueError, "top_k"),
    ("groups-not-dividing-E", _set(routing=RoutingConfig(top_k=2, scoring=Scoring.SIGMOID_GROUPED, num_expert_group=3,
                                                         topk_group=2)), ValueError, "num_expert_group"),
    ("groups-of-one", _set(routing=RoutingConfig(top_k=2, scoring=Scoring.SIGMOID_GROUPED, num_expert_group=8,
                                                 topk_group=4)), ValueError, "num_expert_group"),
    ("topk_group-too-few-experts", _set(routing=RoutingConfig(top_k=5, scoring=Scoring.SIGMOID_GROUPED,
                                                              num_expert_group=4, topk_group=2)), ValueError, "topk_group"),
    ("routing-wrong-type", _set(routing={"top_k": 2}), TypeError, "routing"),
    ("routing-missing", _set(routing=None), ValueError, "routing"),
    ("neither-logits-nor-ids", _drop("router_logits"), ValueError, "router_logits"),
    ("bias-without-grouped", _set(e_score_correction_bias=torch.zeros(E)), ValueError, "e_score_correction_bias"),
    ("expert_map-float", _set(expert_map=torch.zeros(E)), TypeError, "expert_map"),
    ("expert_map-short", _set(expert_map=torch.arange(E - 1, dtype=torch.int32)), ValueError, "expert_map"),
    ("expert_map-values", _set(expert_map=torch.arange(E, dtype=torch.int32) + 1), ValueError, "expert_map"),
    ("align-zero", _set(align=0), ValueError, "align"),
    ("backend-unknown", _set(backend="cuda"), ValueError, "backend"),
    ("activation-unknown", _set(activation="relu"), ValueError, "activation"),
    ("id_check-unknown", _set(id_check="maybe"), ValueError, "id_check"),
    ("router_weight_on-unknown", _set(router_weight_on="middle"), ValueError, "router_weight_on"),
]


@pytest.mark.parametrize("case", BAD_LOGIT_CALLS, ids=[c[0] for c in BAD_LOGIT_CALLS])
def test_bad_input_with_logits(case):
    _, mutate, exc, argument = case
    with pytest.raises(exc) as info:
        call(mutate(good_inputs()))
    assert str(info.value).startswith(argument), str(info.value)


def _ids(values):
    return _set(topk_ids=torch.tensor(values, dtype=torch.int32))


BAD_PRECOMPUTED = [
    ("ids-ge-E", _ids([[0, 1], [2, 3], [4, 5], [6, 8], [7, 0]]), ValueError, "topk_ids"),
    ("ids-negative-without-map", _ids([[0, 1], [2, 3], [4, -1], [6, 7], [7, 0]]), ValueError, "topk_ids"),
    ("ids-float", _set(topk_ids=torch.zeros(T, K)), TypeError, "topk_ids"),
    ("ids-1d", _set(topk_ids=torch.zeros(T, dtype=torch.int32)), ValueError, "topk_ids"),
    ("ids-wrong-T", _set(topk_ids=torch.zeros(T + 1, K, dtype=torch.int32)), ValueError, "topk_ids"),
    ("ids-zero-k", _set(topk_ids=torch.zeros(T, 0, dtype=torch.int32), topk_weights=torch.zeros(T, 0)), ValueError,
     "topk_ids"),
    ("ids-k-gt-E", _set(topk_ids=torch.zeros(T, E + 1, dtype=torch.int32), topk_weights=torch.zeros(T, E + 1),
                        routing=None), ValueError, "topk_ids"),
    ("ids-k-vs-routing", _set(topk_ids=torch.zeros(T, 3, dtype=torch.int32), topk_weights=torch.zeros(T, 3)),
     ValueError, "topk_ids"),
    ("weights-shape", _set(topk_weights=torch.zeros(T, K + 1)), ValueError, "topk_weights"),
    ("weights-int", _set(topk_weights=torch.zeros(T, K, dtype=torch.int32)), TypeError, "topk_weights"),
    ("weights-missing", _drop("topk_weights"), ValueError, "topk_weights"),
    ("ids-missing", _drop("topk_ids"), ValueError, "topk_ids"),
    ("logits-and-ids", _set(router_logits=torch.randn(T, E)), ValueError, "router_logits"),
    ("map-negative-id", _set(expert_map=torch.arange(E, dtype=torch.int32),
                             topk_ids=torch.tensor([[0, 1], [2, 3], [4, -2], [6, 7], [7, 0]], dtype=torch.int32)),
     ValueError, "topk_ids"),
]


@pytest.mark.parametrize("case", BAD_PRECOMPUTED, ids=[c[0] for c in BAD_PRECOMPUTED])
def test_bad_precomputed_routing(case):
    _, mutate, exc, argument = case
    with pytest.raises(exc) as info:
        call(mutate(precomputed_inputs()))
    assert str(info.value).startswith(argument), str(info.value)


def test_minus_one_ids_allowed_with_expert_map():
    kw = precomputed_inputs()
    kw["topk_ids"] = torch.tensor([[0, 1], [2, 3], [4, -1], [6, 7], [7, 0]], dtype=torch.int32)
    kw["expert_map"] = torch.arange(E, dtype=torch.int32)
    out = call(kw)
    assert torch.isfinite(out).all()


def test_id_check_skip_does_not_read_values():
    """IdCheck.SKIP leaves the range check to the caller (the hot path); CHECK catches the same input."""
    kw = precomputed_inputs()
    kw["topk_ids"] = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 9], [7, 0]], dtype=torch.int32)
    layer = moe2cta.MoELayer(kw["w13"], kw["w2"], routing=kw["routing"], id_check=IdCheck.SKIP)
    problem = layer.validate(kw["hidden"], topk_weights=kw["topk_weights"], topk_ids=kw["topk_ids"])
    assert problem.num_tokens == T and problem.top_k == K
    with pytest.raises(ValueError, match="^topk_ids"):
        moe2cta.MoELayer(kw["w13"], kw["w2"], routing=kw["routing"], id_check="check").validate(
            kw["hidden"], topk_weights=kw["topk_weights"], topk_ids=kw["topk_ids"])


def test_grouped_bias_shape():
    kw = good_inputs()
    kw["routing"] = RoutingConfig(top_k=2, scoring=Scoring.SIGMOID_GROUPED, num_expert_group=4, topk_group=2)
    kw["e_score_correction_bias"] = torch.zeros(E + 1)
    with pytest.raises(ValueError, match="^e_score_correction_bias"):
        call(kw)
    kw["e_score_correction_bias"] = torch.zeros(E)
    assert call(kw).shape == (T, H)


def test_routing_config_errors_name_their_field():
    with pytest.raises(ValueError, match="^top_k"):
        RoutingConfig(top_k=0)
    with pytest.raises(ValueError, match="^topk_group"):
        RoutingConfig(top_k=2, scoring="sigmoid_grouped", num_expert_group=4, topk_group=5)
    with pytest.raises(ValueError, match="^num_expert_group"):
        RoutingConfig(top_k=2, scoring="sigmoid_grouped", num_expert_group=4)
    with pytest.raises(ValueError, match="^num_expert_group"):
        RoutingConfig(top_k=2, num_expert_group=4, topk_group=2)  # groups need SIGMOID_GROUPED
    with pytest.raises(ValueError, match="^scoring"):
        RoutingConfig(top_k=2, scoring="argmax")
    with pytest.raises(TypeError, match="^routing"):
        MoEConfig(routing="softmax")
    with pytest.raises(ValueError, match="^tile_heights"):
        MoEConfig(RoutingConfig(top_k=2), tile_heights=(16, 0))


@pytest.mark.parametrize("moved", ["w13", "w2", "router_logits", "b2"])
def test_tensors_on_different_devices(moved):
    """'meta' tensors stand in for a second device: only .device is read before the error."""
    kw = good_inputs()
    if moved == "b2":
        kw["b2"] = torch.zeros(E, H, device="meta")
    elif moved == "w13":  # w13 and w2 agree with each other but not with hidden
        kw["w13"] = kw["w13"].to("meta")
        kw["w2"] = kw["w2"].to("meta")
    else:
        kw[moved] = kw[moved].to("meta")
    with pytest.raises(ValueError, match=f"^{moved}: expected a tensor on"):
        call(kw)


def test_topk_on_other_device():
    kw = precomputed_inputs()
    kw["topk_ids"] = kw["topk_ids"].to("meta")
    kw["topk_weights"] = kw["topk_weights"].to("meta")
    with pytest.raises(ValueError, match="^topk_ids: expected a tensor on cpu"):
        call(kw)


def test_unsupported_backend_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kw = good_inputs()
    ok, reason = is_supported("cute", kw["hidden"], kw["w13"], kw["w2"], routing=kw["routing"])
    assert not ok and reason.startswith("cute:")
    with pytest.raises(ValueError, match="^backend: cute cannot run this layer: cute: needs a CUDA"):
        call({**kw, "backend": Backend.CUTE})
    layer = moe2cta.MoELayer(kw["w13"], kw["w2"], routing=kw["routing"], backend="auto")
    assert layer.backend is Backend.TORCH
    assert "cute:" in layer.backend_reason and "triton:" in layer.backend_reason


def test_hidden_size_the_cute_backend_cannot_tile(monkeypatch):
    """On an sm_90 device, H=100 is refused with the reason (checked with a stand-in capability query)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    config = MoEConfig(RoutingConfig(top_k=2))
    facts = dict(dtype=torch.bfloat16, device=torch.device("cuda", 0), intermediate=128, num_experts=8,
                 num_global_experts=8, config=config)
    ok, reason = _layer_support(Backend.CUTE, hidden=100, **facts)
    assert not ok and "hidden size H=100 is not a multiple of 64" in reason
    ok, reason = _layer_support(Backend.CUTE, hidden=128, **{**facts, "dtype": torch.float32})
    assert not ok and "bfloat16 or float16" in reason
    ok, reason = _layer_support(Backend.CUTE, hidden=128, **{**facts, "config": MoEConfig(RoutingConfig(top_k=2), align=64)})
    assert not ok and "align=64" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    ok, reason = _layer_support(Backend.CUTE, hidden=128, **facts)
    assert not ok and "sm_80" in reason


def test_checked_weights_skip_the_weight_checks_not_the_input_checks():
    """validate_moe(checked_weights=...) (a MoELayer's call: its weights were checked when it was built) still checks
    every input against those shapes, naming it."""
    from moe2cta.validation import check_weights, validate_moe

    w13, w2 = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    shapes = check_weights(w13, w2)
    routing = RoutingConfig(top_k=2)
    problem = validate_moe(torch.randn(3, 8), w13, w2, router_logits=torch.randn(3, 4), routing=routing,
                           checked_weights=shapes)
    assert (problem.num_tokens, problem.hidden, problem.intermediate, problem.top_k) == (3, 8, 8, 2)
    with pytest.raises(ValueError, match="hidden"):
        validate_moe(torch.randn(3, 7), w13, w2, router_logits=torch.randn(3, 4), routing=routing, checked_weights=shapes)
    with pytest.raises(ValueError, match="router_logits"):
        validate_moe(torch.randn(3, 8), w13, w2, router_logits=torch.randn(2, 4), routing=routing, checked_weights=shapes)
    with pytest.raises(TypeError, match="w13"):
        validate_moe(torch.randn(3, 8, dtype=torch.float16), w13, w2, router_logits=torch.randn(3, 4), routing=routing,
                     checked_weights=shapes)
    with pytest.raises(ValueError, match="checked_weights"):
        validate_moe(torch.randn(3, 8), w13, w2, router_logits=torch.randn(3, 4), routing=routing,
                     checked_weights=(4, 8))
