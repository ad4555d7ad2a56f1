"""Public API: fused_moe / MoELayer / route / is_supported / enums / CLI, on every backend this machine has.

CPU tier: the TORCH backend against the fp32 twin; the TRITON backend under the Triton interpreter (in a
subprocess with TRITON_INTERPRET=1, so the mode of this process and of the other test files is untouched). GPU tier (marker gpu): every backend the device supports, no host sync on the hot
path, CUDA-graph replay with a changed routing.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import moe2cta
from moe2cta import (
    Activation,
    Backend,
    IdCheck,
    MoEConfig,
    MoELayer,
    RouterWeightOn,
    RoutingConfig,
    Scoring,
    fused_moe,
    is_supported,
    moe_reference,
    route,
)
from moe2cta.cli import main as cli_main
from moe2cta.router.reference import route_reference

REPO = pathlib.Path(__file__).resolve().parents[1]


def make(num_tokens, hidden, inter, num_experts, dtype=torch.float32, device="cpu", bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    layer = dict(
        hidden=rnd(num_tokens, hidden),
        w13=rnd(num_experts, 2 * inter, hidden, scale=hidden ** -0.5),
        w2=rnd(num_experts, hidden, inter, scale=inter ** -0.5),
        logits=(torch.randn(num_tokens, num_experts, generator=gen) * 2).to(device),
    )
    if bias:
        layer["b13"] = rnd(num_experts, 2 * inter, scale=0.3)
        layer["b2"] = rnd(num_experts, hidden, scale=0.3)
    return layer


def rel_err(got, want) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-12))


VARIANTS = [
    ("softmax-swiglu", RoutingConfig(top_k=2), Activation.SWIGLU, False, RouterWeightOn.OUTPUT),
    ("topk-softmax-oai-bias", RoutingConfig(top_k=4, scoring=Scoring.TOPK_SOFTMAX), Activation.SWIGLU_OAI, True,
     RouterWeightOn.OUTPUT),
    ("llama4-input-weight", RoutingConfig(top_k=1, scoring=Scoring.SIGMOID_TOP1), Activation.SWIGLU, False,
     RouterWeightOn.INPUT),
    ("dsv3-gelu", RoutingConfig(top_k=3, scoring=Scoring.SIGMOID_GROUPED, num_expert_group=4, topk_group=2,
                                routed_scaling_factor=2.5), Activation.GELU_GATED, False, RouterWeightOn.OUTPUT),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_fused_moe_torch_backend_matches_reference(variant):
    _, routing, activation, bias, weight_on = variant
    layer = make(11, 32, 16, 8, bias=bias, seed=1)
    corr = torch.linspace(-0.1, 0.1, 8) if routing.scoring is Scoring.SIGMOID_GROUPED else None
    out = fused_moe(layer["hidden"], layer["w13"], layer["w2"], layer["logits"], routing=routing, activation=activation,
                    router_weight_on=weight_on, b13=layer.get("b13"), b2=layer.get("b2"),
                    e_score_correction_bias=corr, backend="torch")
    weights, ids = route_reference(layer["logits"], routing, corr)
    want = moe_reference(layer["hidden"], layer["w13"], layer["w2"], weights, ids, activation, layer.get("b13"),
                         layer.get("b2"), router_weight_on=weight_on, dtype=torch.float64)
    assert out.shape == layer["hidden"].shape and out.dtype == torch.float32
    assert rel_err(out, want) < 1e-5


def test_precomputed_routing_equals_logits_path():
    layer = make(9, 16, 8, 8, seed=2)
    routing = RoutingConfig(top_k=2)
    from_logits = fused_moe(layer["hidden"], layer["w13"], layer["w2"], layer["logits"], routing=routing)
    weights, ids = route(layer["logits"], routing, backend="torch")
    precomputed = fused_moe(layer["hidden"], layer["w13"], layer["w2"], topk_weights=weights, topk_ids=ids)
    int64_ids = fused_moe(layer["hidden"], layer["w13"], layer["w2"], topk_weights=weights.double(),
                          topk_ids=ids.long(), routing=routing)
    assert torch.equal(from_logits, precomputed) and torch.equal(from_logits, int64_ids)


def test_layer_prepares_once_and_reports_backend():
    layer = make(6, 16, 8, 8, seed=3)
    moe = MoELayer(layer["w13"], layer["w2"], routing=RoutingConfig(top_k=2))
    assert moe.backend is Backend.TORCH
    assert moe.backend_reason.endswith("auto -> torch") and "cute:" in moe.backend_reason
    assert "backend=torch" in repr(moe)
    assert moe.config == MoEConfig(RoutingConfig(top_k=2))
    out = moe(layer["hidden"], layer["logits"])
    assert torch.equal(out, fused_moe(layer["hidden"], layer["w13"], layer["w2"], layer["logits"],
                                      routing=RoutingConfig(top_k=2)))
    explicit = MoELayer(layer["w13"], layer["w2"], routing=RoutingConfig(top_k=2), backend="torch")
    assert explicit.backend_reason == "torch: requested"
    only_ids = MoELayer(layer["w13"], layer["w2"], routing=None)
    weights, ids = route(layer["logits"], RoutingConfig(top_k=2))
    assert torch.equal(only_ids(layer["hidden"], topk_weights=weights, topk_ids=ids), out)
    with pytest.raises(ValueError, match="^routing"):
        only_ids(layer["hidden"], layer["logits"])


def test_edge_token_counts():
    for num_tokens in (0, 1):
        layer = make(num_tokens, 16, 8, 8, seed=4)
        out = fused_moe(layer["hidden"], layer["w13"], layer["w2"], layer["logits"], routing=RoutingConfig(top_k=2))
        assert out.shape == (num_tokens, 16)
        if num_tokens:
            weights, ids = route_reference(layer["logits"], RoutingConfig(top_k=2))
            want = moe_reference(layer["hidden"], layer["w13"], layer["w2"], weights, ids, dtype=torch.float64)
            assert rel_err(out, want) < 1e-5


def test_e256_k8_and_all_tokens_on_one_expert():
    layer = make(8, 16, 8, 256, seed=5)
    routing = RoutingConfig(top_k=8)
    out = fused_moe(layer["hidden"], layer["w13"], layer["w2"], layer["logits"], routing=routing)
    weights, ids = route_reference(layer["logits"], routing)
    assert rel_err(out, moe_reference(layer["hidden"], layer["w13"], layer["w2"], weights, ids, dtype=torch.float64)) < 1e-5
    ids = torch.full((8, 1), 77, dtype=torch.int32)
    weights = torch.rand(8, 1, generator=torch.Generator().manual_seed(6))
    out = fused_moe(layer["hidden"], layer["w13"], layer["w2"], topk_weights=weights, topk_ids=ids)
    want = moe_reference(layer["hidden"], layer["w13"], layer["w2"], weights, ids, dtype=torch.float64)
    assert rel_err(out, want) < 1e-5


def test_expert_map_through_the_api():
    layer = make(10, 16, 8, 8, seed=7)
    local = [0, 3, 5]
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(3, dtype=torch.int32)
    routing = RoutingConfig(top_k=2)
    out = fused_moe(layer["hidden"], layer["w13"][local], layer["w2"][local], layer["logits"], routing=routing,
                    expert_map=expert_map)
    weights, ids = route_reference(layer["logits"], routing)
    want = moe_reference(layer["hidden"], layer["w13"][local], layer["w2"][local], weights, ids,
                         expert_map=expert_map, dtype=torch.float64)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_2x_of_same_dtype_torch(dtype):
    layer = make(32, 64, 32, 8, dtype=dtype, seed=8)
    routing = RoutingConfig(top_k=2)
    out = fused_moe(layer["hidden"], layer["w13"], layer["w2"], layer["logits"], routing=routing)
    assert out.dtype == dtype
    weights, ids = route_reference(layer["logits"], routing)
    want = moe_reference(layer["hidden"], layer["w13"], layer["w2"], weights, ids, dtype=torch.float64)
    same_dtype = moe_reference(layer["hidden"], layer["w13"], layer["w2"], weights, ids, dtype=dtype)
    assert rel_err(out, want) <= 2 * rel_err(same_dtype, want) + 1e-3


def test_nan_and_inf_logits_stay_in_their_token():
    """Definition (moe2cta.api docstring): a NaN / +inf logit under SOFTMAX makes that token's output NaN;
    other scorings never pick a NaN expert; other tokens are untouched."""
    layer = make(6, 16, 8, 8, seed=9)
    logits = layer["logits"].clone()
    logits[1, 2] = float("nan")
    logits[4, 5] = float("inf")
    clean_rows = [0, 2, 3, 5]
    routing = RoutingConfig(top_k=2)
    out = fused_moe(layer["hidden"], layer["w13"], layer["w2"], logits, routing=routing)
    clean = fused_moe(layer["hidden"], layer["w13"], layer["w2"], layer["logits"], routing=routing)
    assert torch.isnan(out[1]).all() and torch.isnan(out[4]).all()
    assert rel_err(out[clean_rows], clean[clean_rows]) < 1e-6  # equal up to the GEMMs' batch shapes
    topk_softmax = RoutingConfig(top_k=2, scoring=Scoring.TOPK_SOFTMAX)
    out = fused_moe(layer["hidden"], layer["w13"], layer["w2"], logits, routing=topk_softmax)
    assert torch.isfinite(out[1]).all()  # the NaN expert is never chosen
    assert torch.isnan(out[4]).all()  # +inf among the chosen logits: softmax over the k is NaN
    _, ids = route(logits, topk_softmax)
    assert 2 not in ids[1].tolist()
    neg_inf = layer["logits"].clone()
    neg_inf[3, :4] = -float("inf")  # -inf is an ordinary logit (probability 0)
    out = fused_moe(layer["hidden"], layer["w13"], layer["w2"], neg_inf, routing=routing)
    assert torch.isfinite(out).all()


def test_route_api(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(10))
    routing = RoutingConfig(top_k=3, scoring="topk_softmax")
    from test_reference import route_loop  # (an independent fp64 loop, not the twin route() runs on the CPU)

    weights, ids = route(logits, routing)
    want_w, want_ids = route_loop(logits, routing)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=2e-6, atol=0)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    with pytest.raises(ValueError, match="^logits"):
        route(logits[0], routing)
    with pytest.raises(ValueError, match="^backend"):
        route(logits, routing, backend="triton")  # CPU tensors without the interpreter


def test_enums_and_config_parse_strings():
    assert Backend.parse("TRITON") is Backend.TRITON and Backend.parse(Backend.CUTE) is Backend.CUTE
    assert IdCheck.parse("skip") is IdCheck.SKIP
    assert moe2cta.Gemm1Input.parse("gathered_copy") is moe2cta.Gemm1Input.GATHERED_COPY
    layer = make(4, 16, 8, 4)
    with pytest.raises(ValueError, match="^gemm1_input"):
        MoELayer(layer["w13"], layer["w2"], routing=RoutingConfig(top_k=2), backend="torch", gemm1_input="rows")
    config = MoEConfig(RoutingConfig(top_k=2), activation="swiglu_oai", router_weight_on="input", align=64)
    assert config.activation is Activation.SWIGLU_OAI and config.router_weight_on is RouterWeightOn.INPUT
    assert config.top_k == 2 and config.tile_heights == (16, 64, 128, 256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.align = 128
    for name in ("route", "fused_moe", "is_supported", "MoELayer", "Backend", "MoEConfig", "RoutingConfig"):
        assert name in moe2cta.__all__


def test_is_supported_reasons_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer = make(4, 16, 8, 8, seed=11)
    args = (layer["hidden"], layer["w13"], layer["w2"])
    assert is_supported("torch", *args) == (True, "")
    ok, reason = is_supported("triton", *args)
    assert not ok and "CUDA" in reason
    ok, reason = is_supported("auto", *args)
    assert ok and reason.endswith("auto -> torch")
    ok, reason = is_supported("torch", layer["hidden"].half(), layer["w13"], layer["w2"])
    assert not ok and "float16" in reason
    with pytest.raises(ValueError, match="^hidden"):
        is_supported("torch", layer["hidden"][:, :8], layer["w13"], layer["w2"])
    with pytest.raises(ValueError, match="^top_k: expected <= num_experts"):
        is_supported("torch", *args, routing=RoutingConfig(top_k=9))


def test_auto_never_picks_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layer = make(4, 16, 8, 8, seed=12)
    moe = MoELayer(layer["w13"], layer["w2"], routing=RoutingConfig(top_k=2))
    assert moe.backend is Backend.TORCH


def test_backend_plan_for_batch():
    plan = moe2cta.BackendPlan(Backend.TRITON, Backend.CUTE, 128)
    assert plan.backends == (Backend.TRITON, Backend.CUTE)
    assert plan.for_batch(0, 8, 128) is Backend.TRITON
    assert plan.for_batch(2048, 8, 128) is Backend.TRITON  # 128 rows per expert: still decode-sized
    assert plan.for_batch(2049, 8, 128) is Backend.CUTE
    single = moe2cta.BackendPlan.single(Backend.TRITON)
    assert single.backends == (Backend.TRITON,) and single.for_batch(10**6, 8, 1) is Backend.TRITON
    by_tokens = moe2cta.BackendPlan(Backend.TRITON, Backend.CUTE, decode_max_tokens=3)  # AUTO's kind of split
    assert [by_tokens.for_batch(t, 8, 128) for t in (0, 3, 4, 4096)] == [Backend.TRITON] * 2 + [Backend.CUTE] * 2
    both = moe2cta.BackendPlan(Backend.TRITON, Backend.CUTE, 1, 100)  # a batch is decode-sized under both limits
    assert [both.for_batch(t, 8, 128) for t in (16, 17, 100)] == [Backend.TRITON, Backend.CUTE, Backend.CUTE]
    # AUTO's TRITON batches: below the token GEMVs' limit for the expert size (qwen3-30b-a3b 9.4 MB: 8 tokens;
    # qwen3-235b-a22b 38 MB: 4; deepseek-v3 88 MB: 2; mixtral-8x7b 352 MB: none), or a layer's explicit limit
    mb = 1 << 20
    assert [moe2cta.auto_triton_max_tokens(b) for b in (9 * mb, 38 * mb, 88 * mb, 352 * mb)] == [7, 3, 1, 0]
    assert moe2cta.auto_triton_max_tokens(352 * mb, token_gemv_max_tokens=5) == 5
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="^expert_bytes"):
            moe2cta.auto_triton_max_tokens(bad)
        with pytest.raises(ValueError, match="^token_gemv_max_tokens"):
            moe2cta.auto_triton_max_tokens(mb, token_gemv_max_tokens=bad)
    with pytest.raises(TypeError, match="^prefill: expected a Backend"):
        moe2cta.BackendPlan(Backend.TRITON, "cute")
    for field in ("decode_max_rows_per_expert", "decode_max_tokens"):
        with pytest.raises(ValueError, match=f"^{field}: expected a number >= 0"):
            moe2cta.BackendPlan(Backend.TRITON, Backend.CUTE, **{field: -1})
    layer = make(4, 16, 8, 8, seed=13)
    moe = MoELayer(layer["w13"], layer["w2"], routing=RoutingConfig(top_k=2), backend="torch")
    assert moe.backend_for(4) is Backend.TORCH and moe.backend_for(4, top_k=3) is Backend.TORCH
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="^num_tokens"):
            moe.backend_for(bad)
    with pytest.raises(ValueError, match="^top_k"):
        moe.backend_for(4, top_k=0)
    with pytest.raises(ValueError, match="^top_k: this layer has no routing"):
        MoELayer(layer["w13"], layer["w2"], routing=None, backend="torch").backend_for(4)


@pytest.mark.parametrize("capability,split", [((9, 0), True), ((10, 0), False)])
def test_auto_splits_by_batch_size_where_measured(monkeypatch, capability, split):
    """AUTO with both GPU backends supported: the TRITON / CUTE split on sm_90 only (measured there); TRITON
    alone elsewhere; one supported backend: that one."""
    import moe2cta.api as api

    supported = {Backend.TRITON: True, Backend.CUTE: True}
    monkeypatch.setattr(api, "_layer_support", lambda backend, **facts: (supported[backend], f"{backend.value}: off"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    facts = dict(dtype=torch.bfloat16, device=torch.device("cuda", 0), hidden=256, intermediate=128,
                 num_experts=16, num_global_experts=16, config=MoEConfig(RoutingConfig(top_k=4)))
    plan, reason = api._select_backend(Backend.AUTO, **facts)
    if split:  # 256 x 128 experts: the token GEMVs' first row (8 tokens), so TRITON up to 7
        assert plan == moe2cta.BackendPlan(Backend.TRITON, Backend.CUTE, decode_max_tokens=7)
        assert "cute above" in reason and "up to 7 tokens" in reason
        big, _ = api._select_backend(Backend.AUTO, expert_bytes=200 << 20, **facts)
        assert big == moe2cta.BackendPlan(Backend.TRITON, Backend.CUTE, decode_max_tokens=0)
        pinned, _ = api._select_backend(Backend.AUTO, token_gemv_max_tokens=2, **facts)
        assert pinned.decode_max_tokens == 2
    else:
        assert plan == moe2cta.BackendPlan.single(Backend.TRITON) and reason == "auto -> triton"
    supported[Backend.TRITON] = False
    plan, reason = api._select_backend(Backend.AUTO, **facts)
    assert plan == moe2cta.BackendPlan.single(Backend.CUTE) and reason == "triton: off; auto -> cute"
    plan, reason = api._select_backend(Backend.CUTE, **facts)
    assert plan.backends == (Backend.CUTE,) and reason == "cute: requested"
    supported[Backend.CUTE] = False
    with pytest.raises(ValueError, match="^backend: cute cannot run this layer: cute: off"):
        api._select_backend(Backend.CUTE, **facts)


def test_cute_needs_a_bundle_directory_that_exists_where_the_dsl_is_absent(monkeypatch, tmp_path):
    """Without the CuTe DSL the layer's CUTE check asks for a bundle directory that exists and holds kernels of this
    version's sources: a mistyped MOE2CTA_KERNEL_DIR or a stale bundle turns CUTE off at planning (AUTO then plans
    Triton) instead of failing at the first prefill."""
    import moe2cta.api as api
    from moe2cta.grouped_gemm import cute_runtime as rt

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(rt, "dsl_available", lambda: False)
    _layer_support = api._layer_support
    facts = dict(dtype=torch.bfloat16, device=torch.device("cuda", 0), hidden=256, intermediate=128,
                 num_experts=16, num_global_experts=16, config=MoEConfig(RoutingConfig(top_k=4)))
    for value, expected in ((None, "MOE2CTA_KERNEL_DIR unset"), (tmp_path / "typo", "typo does not exist")):
        if value is None:
            monkeypatch.delenv(rt.KERNEL_DIR_ENV, raising=False)
        else:
            monkeypatch.setenv(rt.KERNEL_DIR_ENV, str(value))
        ok, reason = api._layer_support(Backend.CUTE, **facts)
        assert not ok and reason.startswith("cute: neither the CuTe DSL compiler nor a kernel bundle") and expected in reason
    # a directory that exists but can serve no sm90 kernel to this version: empty, or built from other kernel sources
    monkeypatch.setenv(rt.KERNEL_DIR_ENV, str(tmp_path))
    ok, reason = api._layer_support(Backend.CUTE, **facts)
    assert not ok and "holds no sm90_grouped_gemm kernel" in reason
    key = rt.KernelKey("sm90_grouped_gemm", "sm_90a", "bfloat16", 256, 128, 16, (128, 128, 64), (1, 1, 1), "swiglu")
    rt._write_manifest_entry(tmp_path, key.file_stem(), {"key": key.to_json(), "kernel_sources": "0" * 64})
    ok, reason = api._layer_support(Backend.CUTE, **facts)
    assert not ok and "was built from other kernel sources than this moe2cta's" in reason
    # AUTO then plans Triton, and says so beyond backend_reason: the deployment named a bundle it cannot use
    monkeypatch.setattr(api, "_layer_support", lambda backend, **f: (True, "") if backend is Backend.TRITON
                        else _layer_support(backend, **f))
    monkeypatch.setattr(api, "_WARNED_BUNDLE_REASONS", set())
    with pytest.warns(RuntimeWarning, match="AUTO plans without the CuTe kernels: cute: neither .* other kernel sources"):
        plan, _ = api._select_backend(Backend.AUTO, **facts)
    assert plan == moe2cta.BackendPlan.single(Backend.TRITON)
    with warnings.catch_warnings():  # once per reason (fused_moe plans on every call), whatever the warning filters
        warnings.simplefilter("error")
        assert api._select_backend(Backend.AUTO, **facts)[0] == moe2cta.BackendPlan.single(Backend.TRITON)
    monkeypatch.delenv(rt.KERNEL_DIR_ENV)  # no bundle named: nothing to warn of
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert api._select_backend(Backend.AUTO, **facts)[0] == moe2cta.BackendPlan.single(Backend.TRITON)
    monkeypatch.setenv(rt.KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(api, "_layer_support", _layer_support)
    monkeypatch.setenv(rt.KERNEL_PROVENANCE_ENV, "warn")  # (an A/B against an older bundle)
    assert api._layer_support(Backend.CUTE, **facts) == (True, "")
    monkeypatch.delenv(rt.KERNEL_PROVENANCE_ENV)
    rt._write_manifest_entry(tmp_path, key.file_stem(), {"key": key.to_json(),
                                                         "kernel_sources": rt.kernel_sources_digest(key.family)})
    ok, reason = api._layer_support(Backend.CUTE, **facts)
    assert ok, reason


_SPLIT_SCRIPT = textwrap.dedent(
    """
    import torch, moe2cta
    import moe2cta.api as api
    from moe2cta import Backend, RoutingConfig
    from moe2cta.grouped_gemm.epilogue import pack_gate_up_rows
    # A split layer (TRITON up to 32 rows per expert, CUTE above) on the CPU: the Triton kernel runs in the
    # interpreter on the packed w13; the CUTE forward is a recording stand-in (no CuTe on a CPU).
    calls = []
    api._select_backend = lambda requested, **facts: (api.BackendPlan(Backend.TRITON, Backend.CUTE, 32), "split")
    api._prepare_cute = lambda layer: {"module": None, "packed_w13": pack_gate_up_rows(layer.w13)}
    api._FORWARD[Backend.CUTE] = lambda layer, hidden, w, i, disp: calls.append(hidden.shape[0]) or hidden * 0
    torch.manual_seed(1)
    H, I, E, k = 64, 48, 4, 2
    w13 = torch.randn(E, 2 * I, H) / H ** 0.5
    w2 = torch.randn(E, H, I) / I ** 0.5
    b13, b2 = torch.randn(E, 2 * I) * 0.1, torch.randn(E, H) * 0.1
    layer = moe2cta.MoELayer(w13, w2, routing=RoutingConfig(top_k=k), b13=b13, b2=b2, align=16)
    assert layer.backend is Backend.TRITON and layer.prefill_backend is Backend.CUTE
    assert "backend=triton/cute" in repr(layer)
    packed = layer.prepared["packed_w13"]
    assert not torch.equal(packed, w13) and torch.equal(layer.w13, w13)
    for T in (1, 9, 64):  # 64 tokens * 2 / 4 experts = 32 rows per expert: the last decode size
        assert layer.backend_for(T) is Backend.TRITON
        h, logits = torch.randn(T, H), torch.randn(T, E)
        out = layer(h, logits)
        w, i = moe2cta.route(logits, layer.config.routing, backend="torch")
        ref = moe2cta.moe_reference(h, w13, w2, w, i, b13=b13, b2=b2, dtype=torch.float64)
        err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, (T, err)
    assert calls == []
    assert layer.backend_for(65) is Backend.CUTE
    layer(torch.randn(65, H), torch.randn(65, E))
    assert calls == [65]
    print("SPLIT-OK")
    """
)


def test_split_layer_runs_triton_on_the_packed_w13_under_interpreter():
    if importlib.util.find_spec("moe2cta.grouped_gemm.triton_grouped_gemm") is None:
        pytest.skip("missing module moe2cta.grouped_gemm.triton_grouped_gemm")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _SPLIT_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0 and "SPLIT-OK" in result.stdout, (result.stdout[-2000:], result.stderr[-4000:])


# ----------------------------------------------------------------------------------------------------------
# CLI


def test_sm90_gather_padding_follows_the_gemm1_kernel():
    """The gather copies a token row into A's padding rows only where the sm90 GEMM1 is the regular (TOKENS_AS_M)
    kernel, which multiplies them; the swapped-operand kernels (decode and wide tiles) load none of them whole."""
    from moe2cta.api import sm90_gather_padding
    from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
    from moe2cta.presets import get_preset
    from moe2cta.router import GatherPadding

    preset = get_preset("qwen3-30b-a3b")
    problem = s90.Sm90Problem(s90.GemmStage.GEMM1, 2 * preset.intermediate, preset.hidden, preset.num_experts,
                              torch.bfloat16, preset.activation)
    for rows_per_expert, expected in ((8, GatherPadding.LEAVE), (128, GatherPadding.LEAVE),
                                      (512, GatherPadding.TOKEN_ROW), (2048, GatherPadding.TOKEN_ROW)):
        operands = s90.default_config(problem, rows_per_expert=rows_per_expert).operands
        assert (operands is s90.Operands.TOKENS_AS_M) == (expected is GatherPadding.TOKEN_ROW), rows_per_expert
        assert sm90_gather_padding(s90, problem, None, rows_per_expert) is expected, rows_per_expert
    # an explicit (tuned) configuration decides, not the default
    assert sm90_gather_padding(s90, problem, s90.regular_config(problem), 128) is GatherPadding.TOKEN_ROW


def test_cli_usage_and_unknown(capsys):
    assert cli_main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
    assert cli_main([]) == 2
    no_command = capsys.readouterr()
    assert "plan" in no_command.err and no_command.out == ""  # a usage error: usage on stderr
    assert cli_main(["frobnicate"]) == 2
    assert "unknown subcommand" in capsys.readouterr().err
    assert cli_main(["--version"]) == 0
    assert moe2cta.__version__ in capsys.readouterr().out


def test_cli_backends(capsys):
    assert cli_main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton" in out and "cute" in out


def test_cli_missing_module_is_a_message(monkeypatch, capsys):
    import moe2cta.cli as cli

    monkeypatch.setitem(cli.SUBCOMMANDS, "plan", ("moe2cta.no_such_module", "x"))
    assert cli.main(["plan"]) == 2
    assert "not part of this build" in capsys.readouterr().err


@pytest.mark.parametrize("command,module", [("plan", "moe2cta.plan_cli"), ("aot", "moe2cta.aot"),
                                            ("bench", "moe2cta.serving_bench.cli")])
def test_cli_subcommand_help(command, module, capsys):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not in this tree yet")
    try:
        status = cli_main([command, "--help"])
    except SystemExit as exc:  # argparse exits after printing help
        status = exc.code
    assert status in (0, None)
    assert "usage" in capsys.readouterr().out.lower()


# ----------------------------------------------------------------------------------------------------------
# TRITON backend under the interpreter (CPU, fp32 / fp16: the interpreter mis-computes bf16 tl.dot)

_TRITON_SCRIPT = textwrap.dedent(
    """
    import torch, moe2cta
    from moe2cta import Activation, RoutingConfig, Scoring
    torch.manual_seed(0)
    T, H, I, E = 11, 64, 32, 8
    cases = [
        (torch.float32, RoutingConfig(top_k=2), Activation.SWIGLU, False, "output", None),
        (torch.float16, RoutingConfig(top_k=4, scoring=Scoring.TOPK_SOFTMAX), Activation.SWIGLU_OAI, True, "output", None),
        (torch.float32, RoutingConfig(top_k=1, scoring=Scoring.SIGMOID_TOP1), Activation.GELU_GATED, False, "input", None),
        (torch.float32, RoutingConfig(top_k=2), Activation.SWIGLU, False, "output", [1, 4, 6]),
    ]
    for dtype, routing, act, bias, weight_on, local in cases:
        h = torch.randn(T, H).to(dtype)
        w13 = (torch.randn(E, 2 * I, H) / H ** 0.5).to(dtype)
        w2 = (torch.randn(E, H, I) / I ** 0.5).to(dtype)
        logits = torch.randn(T, E)
        b13 = (torch.randn(E, 2 * I) * 0.1).to(dtype) if bias else None
        b2 = (torch.randn(E, H) * 0.1).to(dtype) if bias else None
        expert_map = None
        if local is not None:
            expert_map = torch.full((E,), -1, dtype=torch.int32)
            expert_map[local] = torch.arange(len(local), dtype=torch.int32)
            w13, w2 = w13[local].contiguous(), w2[local].contiguous()
        layer = moe2cta.MoELayer(w13, w2, routing=routing, activation=act, b13=b13, b2=b2, router_weight_on=weight_on,
                                 expert_map=expert_map, align=16, backend="triton")
        assert layer.backend is moe2cta.Backend.TRITON
        # 11 tokens: dispatch + grouped GEMMs + combine; 2 tokens: the token GEMVs (small experts: up to 8)
        for T in (11, 2):
            assert layer._runs_token_gemvs(T) == (T == 2)
            out = layer(h[:T], logits[:T])
            w, i = moe2cta.route(logits[:T], routing, backend="torch")
            ref = moe2cta.moe_reference(h[:T], w13, w2, w, i, act, b13, b2, expert_map=expert_map,
                                        router_weight_on=moe2cta.RouterWeightOn(weight_on), dtype=torch.float64)
            same = moe2cta.moe_reference(h[:T], w13, w2, w, i, act, b13, b2, expert_map=expert_map,
                                         router_weight_on=moe2cta.RouterWeightOn(weight_on), dtype=dtype)
            scale = ref.abs().max().item()
            err = (out.double() - ref).abs().max().item() / scale
            bound = 2 * (same.double() - ref).abs().max().item() / scale + (1e-5 if dtype == torch.float32 else 1e-3)
            assert out.dtype == dtype and err <= bound, (T, dtype, routing, err, bound)
            ids_out = layer(h[:T], topk_weights=w, topk_ids=i)
            assert (ids_out.double() - ref).abs().max().item() / scale <= bound
            # int64 ids and bf16 / fp64 weights reach the kernels as given (no narrowing or widening launch): the
            # result of converting them first, bit for bit
            real_int32_ids = moe2cta.router.api.int32_ids
            moe2cta.router.api.int32_ids = None  # the kernel backends must not narrow the ids
            try:
                for wd in (torch.bfloat16, torch.float64):
                    given = layer(h[:T], topk_weights=w.to(wd), topk_ids=i.long())
                    assert torch.equal(given, layer(h[:T], topk_weights=w.to(wd).float(), topk_ids=i)), (T, wd)
                if expert_map is not None:  # an int64 expert map, read as given too
                    wide = moe2cta.MoELayer(w13, w2, routing=routing, activation=act, b13=b13, b2=b2,
                                            router_weight_on=weight_on, expert_map=expert_map.long(), align=16,
                                            backend="triton")
                    assert torch.equal(wide(h[:T], logits[:T]), out), T
            finally:
                moe2cta.router.api.int32_ids = real_int32_ids
    never = moe2cta.MoELayer(w13, w2, routing=routing, align=16, backend="triton", token_gemv_max_tokens=0)
    assert not never._runs_token_gemvs(1)
    for bad in (-1, 1.5, True):
        try:
            moe2cta.MoELayer(w13, w2, routing=routing, backend="triton", token_gemv_max_tokens=bad)
        except ValueError as e:
            assert str(e).startswith("token_gemv_max_tokens: expected an int >= 0 or None"), e
        else:
            raise AssertionError(bad)
    # w13 handed over packed (w13_layout="chunked"): both Triton paths read it as is, same bound
    routing, act = RoutingConfig(top_k=2), Activation.SWIGLU_OAI
    h = torch.randn(11, H)
    w13 = torch.randn(E, 2 * I, H) / H ** 0.5
    w2 = torch.randn(E, H, I) / I ** 0.5
    b13, b2 = torch.randn(E, 2 * I) * 0.1, torch.randn(E, H) * 0.1
    logits = torch.randn(11, E)
    packed = moe2cta.MoELayer(moe2cta.pack_gate_up_rows(w13), w2, routing=routing, activation=act, b13=b13, b2=b2,
                              align=16, backend="triton", w13_layout="chunked")
    assert moe2cta.api._kernel_w13(packed) == (packed.w13, moe2cta.W13Layout.CHUNKED)
    for T in (11, 2):
        w, i = moe2cta.route(logits[:T], routing, backend="torch")
        ref = moe2cta.moe_reference(h[:T], w13, w2, w, i, act, b13, b2, dtype=torch.float64)
        same = moe2cta.moe_reference(h[:T], w13, w2, w, i, act, b13, b2, dtype=torch.float32)
        scale = ref.abs().max().item()
        err = (packed(h[:T], logits[:T]).double() - ref).abs().max().item() / scale
        bound = 2 * (same.double() - ref).abs().max().item() / scale + 1e-5
        assert err <= bound, ("chunked", T, err, bound)
    # weights with other strides (views of K-major copies): the grouped GEMMs take them; the token GEMVs need
    # contiguous weights, so every batch size runs the grouped path instead of failing at T <= 8
    strided13, strided2 = w13.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2)
    layer = moe2cta.MoELayer(strided13, strided2, routing=routing, activation=act, b13=b13, b2=b2, align=16,
                             backend="triton")
    for T in (11, 2):
        assert not layer._runs_token_gemvs(T)
        w, i = moe2cta.route(logits[:T], routing, backend="torch")
        ref = moe2cta.moe_reference(h[:T], w13, w2, w, i, act, b13, b2, dtype=torch.float64)
        same = moe2cta.moe_reference(h[:T], w13, w2, w, i, act, b13, b2, dtype=torch.float32)
        scale = ref.abs().max().item()
        err = (layer(h[:T], logits[:T]).double() - ref).abs().max().item() / scale
        bound = 2 * (same.double() - ref).abs().max().item() / scale + 1e-5
        assert err <= bound, ("strided", T, err, bound)
    print("TRITON-OK", len(cases))
    """
)


def test_triton_backend_under_interpreter():
    missing = [m for m in ("moe2cta.router.api", "moe2cta.grouped_gemm.triton_grouped_gemm")
               if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"missing module(s): {', '.join(missing)}")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0 and "TRITON-OK" in result.stdout, (result.stdout[-2000:], result.stderr[-4000:])


# ----------------------------------------------------------------------------------------------------------
# GPU tier

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["auto", "triton", "cute"])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 128, 1024])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gpu_backend_matches_reference(backend, num_tokens, bias):
    layer = make(num_tokens, 256, 128, 16, dtype=torch.bfloat16, device="cuda", seed=20, bias=bias)
    routing = RoutingConfig(top_k=4)
    activation = Activation.SWIGLU_OAI if bias else Activation.SWIGLU  # gpt-oss-120b's kind of layer
    args = (layer["hidden"], layer["w13"], layer["w2"])
    ok, reason = is_supported(backend, *args, routing=routing)
    if not ok:
        pytest.skip(reason)
    moe = MoELayer(layer["w13"], layer["w2"], routing=routing, backend=backend, activation=activation,
                   b13=layer.get("b13"), b2=layer.get("b2"))
    if bias and moe.prepared:  # the CuTe path: biases in the epilogue layout once, at construction
        from moe2cta.grouped_gemm.sm90_grouped_gemm import KernelBias

        assert isinstance(moe.prepared["b13"], KernelBias) and isinstance(moe.prepared["b2"], KernelBias)
    out = moe(layer["hidden"], layer["logits"])
    assert out.shape == (num_tokens, 256) and out.dtype == torch.bfloat16
    if num_tokens == 0:
        return
    weights, ids = route(layer["logits"], routing, backend="torch")
    refs = [moe_reference(*args, weights, ids, activation, layer.get("b13"), layer.get("b2"), dtype=dtype)
            for dtype in (torch.float64, torch.bfloat16)]
    assert rel_err(out, refs[0]) <= 2 * rel_err(refs[1], refs[0]) + 1e-3, moe.backend_reason


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["auto", "triton", "cute"])
@pytest.mark.parametrize("num_tokens", [1, 7, 128, 1024])
def test_gpu_routing_of_any_dtype_is_read_as_given(backend, num_tokens):
    """Precomputed routing in a torch model's dtypes (bf16 / fp64 weights, int64 ids) gives the layer's output for the
    same routing in fp32 / int32, bit for bit, eagerly and replayed in a CUDA graph, and launches no kernel more (the
    layer converted them on the device up to stop 54: a clamp and a cast for the ids, a cast for the weights)."""
    layer = make(num_tokens, 256, 128, 16, dtype=torch.bfloat16, device="cuda", seed=21, bias=True)
    routing = RoutingConfig(top_k=4)
    ok, reason = is_supported(backend, layer["hidden"], layer["w13"], layer["w2"], routing=routing)
    if not ok:
        pytest.skip(reason)
    moe = MoELayer(layer["w13"], layer["w2"], routing=routing, backend=backend, activation=Activation.SWIGLU_OAI,
                   b13=layer["b13"], b2=layer["b2"])
    weights, ids = route(layer["logits"], routing)
    weights = weights.to(torch.bfloat16).float()  # representable in bf16: every variant multiplies the same values
    hidden = layer["hidden"]
    want = moe(hidden, topk_weights=weights, topk_ids=ids.to(torch.int32))

    def kernels(fn) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    engine = kernels(lambda: moe(hidden, topk_weights=weights, topk_ids=ids.to(torch.int32)))
    for wdtype in (torch.bfloat16, torch.float64):
        given_w, given_i = weights.to(wdtype), ids.to(torch.int64)
        assert torch.equal(moe(hidden, topk_weights=given_w, topk_ids=given_i), want), wdtype
        assert kernels(lambda: moe(hidden, topk_weights=given_w, topk_ids=given_i)) == engine, wdtype
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(hidden, topk_weights=given_w, topk_ids=given_i)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), wdtype


def _sm90_cute_case(num_tokens, inter, seed, bias, device="cuda"):
    """A 16-expert top-4 layer (H = 256, the given I) with gpt-oss's kind of activation where it has biases, and the
    arguments is_supported and the references take; skips where the CuTe backend cannot run it."""
    layer = make(num_tokens, 256, inter, 16, dtype=torch.bfloat16, device=device, seed=seed, bias=bias)
    routing = RoutingConfig(top_k=4)
    activation = Activation.SWIGLU_OAI if bias else Activation.SWIGLU
    args = (layer["hidden"], layer["w13"], layer["w2"])
    ok, reason = is_supported("cute", *args, routing=routing)
    if not ok:
        pytest.skip(reason)
    return layer, routing, activation, args


def _within_2x_of_bf16_torch(out, layer, args, routing, activation) -> bool:
    """||out - fp64|| / ||fp64|| <= 2 x a bf16 torch run's + 1e-3 (both references on the torch router's choice)."""
    weights, ids = route(layer["logits"], routing, backend="torch")
    refs = [moe_reference(*args, weights, ids, activation, layer.get("b13"), layer.get("b2"), dtype=dtype)
            for dtype in (torch.float64, torch.bfloat16)]
    return rel_err(out, refs[0]) <= 2 * rel_err(refs[1], refs[0]) + 1e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [300, 512, 1024, 1200, 4096])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gpu_cute_gemm1_on_token_rows_matches_the_gathered_copy(num_tokens, bias):
    """sm_90, Gemm1Input.TOKEN_ROWS: GEMM1 reads the token rows itself, with no gather launch, on the regular kernel
    (1200 / 4096 tokens: 300 / 1024 rows per expert) and on the wide tiles (300 / 512 / 1024 tokens: 75 / 128 / 256
    rows per expert; they copy only their units' valid rows); the output is bit-identical to GATHERED_COPY's and
    AUTO's (the same rows are multiplied) and matches fp64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("ASource.TOKEN_ROWS is the sm_90 kernel's")
    layer, routing, activation, args = _sm90_cute_case(num_tokens, 128, 23, bias)
    layers = [MoELayer(layer["w13"], layer["w2"], routing=routing, backend="cute", activation=activation,
                       b13=layer.get("b13"), b2=layer.get("b2"), gemm1_input=source)
              for source in ("token_rows", "gathered_copy", "auto")]
    prepared = layers[0].prepared
    engaged = moe2cta.api._token_rows_config(prepared["module"], prepared["problems"][0], None, num_tokens * 4 / 16)
    assert engaged is not None and engaged.wide == (num_tokens in (300, 512, 1024))
    out, out_copy, out_auto = (moe(layer["hidden"], layer["logits"]) for moe in layers)
    assert torch.equal(out, out_copy) and torch.equal(out, out_auto)
    assert _within_2x_of_bf16_torch(out, layer, args, routing, activation)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cute_expert_classes_match_reference_and_replay_in_a_graph():
    """sm_90, more than WIDE288_MAX_EXPERTS experts at ~200 rows per expert (144 experts, top-8, 3600 tokens; H 256,
    I 2048): each GEMM runs as three launches (the 160- and 288-row wide tiles and the regular kernel), each on the
    counts of its class's experts. Skewed logits put experts in every class; the output matches fp64 within 2x of a
    bf16 torch run, and a CUDA graph of the forward replays to the eager output bit for bit on new inputs."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("expert classes are the sm_90 family's")
    from moe2cta.grouped_gemm import sm90_grouped_gemm as s90

    num_tokens, experts = 3600, 144
    layer = make(num_tokens, 256, 2048, experts, dtype=torch.bfloat16, device="cuda", seed=31)
    routing = RoutingConfig(top_k=8)
    skew = torch.linspace(-1.5, 1.5, experts, device="cuda")
    layer["logits"] = layer["logits"] + skew
    args = (layer["hidden"], layer["w13"], layer["w2"])
    moe = MoELayer(layer["w13"], layer["w2"], routing=routing, backend="cute")
    problems = moe.prepared["problems"]
    classes = [s90.expert_classes(p, num_tokens * 8 / experts) for p in problems]
    assert [len(c) for c in classes] == [3, 3], classes
    _, ids = route(layer["logits"], routing, backend="torch")
    counts = torch.bincount(ids.flatten().long(), minlength=experts).to(torch.int32)
    per_class = s90.class_counts(counts, moe.prepared["class_bounds"])
    assert torch.equal(per_class.sum(0), counts) and bool((per_class.count_nonzero(1) > 0).all()), per_class
    out = moe(layer["hidden"], layer["logits"])
    assert _within_2x_of_bf16_torch(out, layer, args, routing, Activation.SWIGLU)
    graph = torch.cuda.CUDAGraph()
    hidden, logits = layer["hidden"].clone(), layer["logits"].clone()
    moe(hidden, logits)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        replayed = moe(hidden, logits)
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        hidden.copy_(torch.randn(hidden.shape, generator=gen, device="cuda").to(hidden.dtype))
        logits.copy_(torch.randn(logits.shape, generator=gen, device="cuda") * 2 + skew * seed)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, moe(hidden, logits))


def tuned_test_cache(path, gpu: str, gemm2_default: bool = False):
    """The tuning cache of test_gpu_cute_layer_with_a_tuning_cache (H = 256, I = 128, E = 16, bucket 1024): GEMM1's
    entry is the family default (what `moe2cta tune` stores when the default wins), GEMM2's a 128x128 tile (or,
    gemm2_default, the default too)."""
    from moe2cta import planner, tuning

    cache = tuning.TuningCache(path)
    gemm2 = None if gemm2_default else planner.make_candidate("sm_90a", "single", 128, 128, 64, 4)
    for kind, n, k, fields, candidate in (
        (planner.GemmKind.GEMM1, 256, 256, dict(activation=Activation.SWIGLU), None),
        (planner.GemmKind.GEMM2, 256, 128, dict(has_row_scale=True), gemm2),
    ):
        problem = tuning.bucket_problem(kind, 16, n, k, 1024, **fields)
        candidate = candidate or tuning.family_default_candidate(problem, "sm_90a")
        key = tuning.TuningKey(gpu, "bfloat16", 16, n, k, tuning.epilogue_name(kind, **fields), 1024)
        cache.put(tuning.TuningEntry(key, candidate, 1e-4))
    return cache


@pytest.mark.gpu
@needs_cuda
def test_gpu_cute_layer_with_a_tuning_cache(tmp_path, monkeypatch):
    """sm_90, a tuning cache for the batch's bucket: an entry that is the default's kernel runs as the default (GEMM1
    on the token rows, bit-identical to the untuned layer); another tuned kernel runs (GEMM1 then gathers) and
    matches fp64 within 2x of a bf16 torch run."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 family's tuning path")
    from moe2cta import tuning

    layer, routing, activation, args = _sm90_cute_case(4096, 128, 29, False)  # 1024 rows per expert
    cache = tuned_test_cache(tmp_path / "tuning.json", torch.cuda.get_device_name())
    make_layer = lambda **kw: MoELayer(layer["w13"], layer["w2"], routing=routing, backend="cute", **kw)  # noqa: E731
    untuned, tuned = make_layer(), make_layer(tuning_cache=cache)
    g1, g2, source = tuning.kernel_configs_for_layer("sm_90a", 256, 128, 16, 4, 4096, cache=cache)
    assert source == "tuned (bucket 1024)" and g2.tile_n == 128
    prepared = tuned.prepared
    assert moe2cta.api._sm90_tuned_configs(prepared["module"], prepared["problems"], (g1, g2), 1024.0) == (None, g2)
    out_untuned = untuned(layer["hidden"], layer["logits"])
    out_tuned = tuned(layer["hidden"], layer["logits"])
    assert _within_2x_of_bf16_torch(out_tuned, layer, args, routing, activation)
    # both entries the defaults' kernels: the layer runs the untuned layer's kernels, GEMM1 on the token rows
    token_rows_configs = []
    real = moe2cta.api._token_rows_config
    monkeypatch.setattr(moe2cta.api, "_token_rows_config",
                        lambda *a: token_rows_configs.append(real(*a)) or token_rows_configs[-1])
    defaults = tuned_test_cache(tmp_path / "defaults.json", torch.cuda.get_device_name(), gemm2_default=True)
    assert torch.equal(make_layer(tuning_cache=defaults)(layer["hidden"], layer["logits"]), out_untuned)
    assert len(token_rows_configs) == 1 and token_rows_configs[0] is not None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["cute", "auto"])
@pytest.mark.parametrize("num_tokens", [1, 300, 4096])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gpu_cute_layer_with_a_partial_n_block(backend, num_tokens, bias):
    """I = 200: GEMM1's N = 400 has no 64-multiple N tile, so the sm_90 regular kernel runs 256-wide tiles with a
    partial last n-block (TMA zero-fills the missing weight rows, the store clips), and GEMM2's K = 200 ends in a
    partial K tile. Needs the bundle of `moe2cta.aot build --model custom:256,200,16,4[,swiglu_oai,bias]`."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the partial n-block is the sm_90 regular kernel's")
    layer, routing, activation, args = _sm90_cute_case(num_tokens, 200, 24, bias)
    moe = MoELayer(layer["w13"], layer["w2"], routing=routing, backend=backend, activation=activation,
                   b13=layer.get("b13"), b2=layer.get("b2"))
    out = moe(layer["hidden"], layer["logits"])
    assert _within_2x_of_bf16_torch(out, layer, args, routing, activation), moe.backend_reason


@pytest.mark.gpu
@needs_cuda
def test_gpu_auto_splits_on_sm90():
    """On sm_90 with the CuTe kernels available, AUTO runs TRITON (on the packed w13) for decode-sized batches
    and CUTE above; test_gpu_backend_matches_reference checks both sides' results."""
    layer = make(8, 256, 128, 16, dtype=torch.bfloat16, device="cuda", seed=22)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the split is measured on sm_90 only")
    ok, reason = is_supported("cute", layer["hidden"], layer["w13"], layer["w2"], routing=RoutingConfig(top_k=4))
    if not ok:
        pytest.skip(reason)
    moe = MoELayer(layer["w13"], layer["w2"], routing=RoutingConfig(top_k=4))
    assert (moe.backend, moe.prefill_backend) == (Backend.TRITON, Backend.CUTE), moe.backend_reason
    limit = moe2cta.auto_triton_max_tokens(moe._expert_bytes)  # 256 x 128 experts: 7 tokens
    assert limit == 7 and moe.plan.decode_max_tokens == limit
    assert moe.backend_for(limit) is Backend.TRITON and moe.backend_for(limit + 1) is Backend.CUTE
    assert "packed_w13" in moe.prepared


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend,num_tokens", [("triton", 4), ("triton", 64), ("cute", 64), ("auto", 1024)])
def test_gpu_fused_moe_has_no_host_sync(backend, num_tokens):
    """fused_moe prepares a layer per call: after the first call on a device (kernels, per-device constants) no
    call reads the device back, the expert classes' bounds included (they were copied to the device per call)."""
    layer = make(num_tokens, 256, 128, 16, dtype=torch.bfloat16, device="cuda", seed=23)
    routing = RoutingConfig(top_k=4)
    ok, reason = is_supported(backend, layer["hidden"], layer["w13"], layer["w2"], routing=routing)
    if not ok:
        pytest.skip(reason)
    args = (layer["hidden"], layer["w13"], layer["w2"], layer["logits"])
    first = fused_moe(*args, routing=routing, backend=backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = fused_moe(*args, routing=routing, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, again)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("backend,num_tokens", [("triton", 4), ("triton", 64), ("auto", 1024)])
def test_gpu_layer_runs_on_its_device_whichever_is_current(backend, num_tokens):
    """Weights and inputs on cuda:1 while cuda:0 is current: every launch (Triton's follow the current device) runs on
    cuda:1, and the result equals the layer's run with cuda:1 current."""
    layer = make(num_tokens, 256, 128, 16, dtype=torch.bfloat16, device="cuda:1", seed=24)
    routing = RoutingConfig(top_k=4)
    ok, reason = is_supported(backend, layer["hidden"], layer["w13"], layer["w2"], routing=routing)
    if not ok:
        pytest.skip(reason)
    moe = MoELayer(layer["w13"], layer["w2"], routing=routing, backend=backend)
    with torch.cuda.device(1):
        want = moe(layer["hidden"], layer["logits"])
        torch.cuda.synchronize()
    with torch.cuda.device(0):
        got = moe(layer["hidden"], layer["logits"])
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert got.device == torch.device("cuda", 1) and torch.equal(got, want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend,num_tokens", [("triton", 64), ("cute", 64), ("auto", 4), ("auto", 64),
                                                ("auto", 1024)])
def test_gpu_hot_path_has_no_host_sync_and_replays_in_a_graph(backend, num_tokens):
    """auto: 4 tokens run TRITON (its token GEMVs), 64 (16 rows per expert: the swapped decode kernels) and 1024 (256
    rows per expert) CUTE where AUTO splits."""
    layer = make(num_tokens, 256, 128, 16, dtype=torch.bfloat16, device="cuda", seed=21)
    routing = RoutingConfig(top_k=4)
    ok, reason = is_supported(backend, layer["hidden"], layer["w13"], layer["w2"], routing=routing)
    if not ok:
        pytest.skip(reason)
    moe = MoELayer(layer["w13"], layer["w2"], routing=routing, backend=backend)
    hidden, logits = layer["hidden"], layer["logits"].clone()
    moe(hidden, logits)  # compile / load kernels outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(hidden, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(hidden, logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(hidden, logits)
    new_logits = torch.randn(logits.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(22))
    logits.copy_(new_logits)
    graph.replay()
    torch.cuda.synchronize()
    weights, ids = route(new_logits, routing, backend="torch")
    want = moe_reference(hidden, layer["w13"], layer["w2"], weights, ids, dtype=torch.float64)
    same = moe_reference(hidden, layer["w13"], layer["w2"], weights, ids, dtype=torch.bfloat16)
    assert rel_err(static_out, want) <= 2 * rel_err(same, want) + 1e-3


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_packed_w13_handed_to_the_layer(variant):
    """w13_layout="chunked": the layer takes w13 already packed (one copy) and computes what the public layout
    does; the TORCH twin unpacks it per call, so the outputs are identical."""
    _, routing, activation, bias, weight_on = variant
    layer = make(11, 32, 16, 8, bias=bias, seed=5)
    corr = torch.linspace(-0.1, 0.1, 8) if routing.scoring is Scoring.SIGMOID_GROUPED else None
    common = dict(routing=routing, activation=activation, router_weight_on=weight_on, b13=layer.get("b13"),
                  b2=layer.get("b2"), e_score_correction_bias=corr, backend="torch")
    packed = moe2cta.pack_gate_up_rows(layer["w13"])
    assert torch.equal(moe2cta.unpack_gate_up_rows(packed), layer["w13"])
    public_layer = MoELayer(layer["w13"], layer["w2"], **common)
    packed_layer = MoELayer(packed, layer["w2"], w13_layout="chunked", **common)
    assert packed_layer.w13 is packed and packed_layer.w13_layout is moe2cta.W13Layout.CHUNKED
    assert "w13_layout=chunked" in repr(packed_layer)
    want = public_layer(layer["hidden"], layer["logits"])
    assert torch.equal(packed_layer(layer["hidden"], layer["logits"]), want)
    got = fused_moe(layer["hidden"], packed, layer["w2"], layer["logits"], w13_layout=moe2cta.W13Layout.CHUNKED,
                    **common)
    assert torch.equal(got, want)


def test_packed_w13_argument_errors():
    w13, w2 = torch.randn(4, 2 * 16, 32), torch.randn(4, 32, 16)
    routing = RoutingConfig(top_k=2)
    with pytest.raises(ValueError, match=r"^w13_layout: expected one of \['gate_then_up', 'chunked'\]"):
        MoELayer(w13, w2, routing=routing, backend="torch", w13_layout="packed")
    with pytest.raises(ValueError, match=r"^w13_layout: expected one of"):
        fused_moe(torch.randn(3, 32), w13, w2, torch.randn(3, 4), routing=routing, w13_layout=2)
    # I = 12 is not a whole number of 8-row gate / up chunks
    with pytest.raises(ValueError, match=r"^w13: w13_layout=chunked needs I a multiple of 8 .* got I=12"):
        MoELayer(torch.randn(4, 24, 32), torch.randn(4, 32, 12), routing=routing, backend="torch", w13_layout="chunked")
    MoELayer(torch.randn(4, 24, 32), torch.randn(4, 32, 12), routing=routing, backend="torch")  # public: any I


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["auto", "triton", "cute"])
def test_gpu_packed_w13_layer_holds_one_copy(backend):
    """A layer handed w13 packed allocates no second copy (a public one packs a copy where CUTE runs) and computes
    bit for bit what the public layer computes (same kernels on the same packed bytes) on every path."""
    layer = make(1024, 256, 128, 16, dtype=torch.bfloat16, device="cuda", seed=23)
    routing = RoutingConfig(top_k=4)
    ok, reason = is_supported(backend, layer["hidden"], layer["w13"], layer["w2"], routing=routing)
    if not ok:
        pytest.skip(reason)
    packed = moe2cta.pack_gate_up_rows(layer["w13"])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    packed_layer = MoELayer(packed, layer["w2"], routing=routing, backend=backend, w13_layout="chunked")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < packed.numel() * packed.element_size() // 4
    w13_read, layout = moe2cta.api._kernel_w13(packed_layer)
    assert w13_read is packed and layout is moe2cta.W13Layout.CHUNKED
    public_layer = MoELayer(layer["w13"], layer["w2"], routing=routing, backend=backend)
    for num_tokens in (1, 7, 128, 1024):  # token GEMVs, grouped Triton, and (auto, cute) the CuTe kernels
        hidden, logits = layer["hidden"][:num_tokens], layer["logits"][:num_tokens]
        got = packed_layer(hidden, logits)
        if public_layer.prepared.get("packed_w13") is not None:  # both read packed bytes: identical
            assert torch.equal(got, public_layer(hidden, logits)), (backend, num_tokens)
        weights, ids = route(logits, routing, backend="torch")
        args = (hidden, layer["w13"], layer["w2"], weights, ids)
        want, same = moe_reference(*args, dtype=torch.float64), moe_reference(*args, dtype=torch.bfloat16)
        assert rel_err(got, want) <= 2 * rel_err(same, want) + 1e-3, (backend, num_tokens)


def test_layer_tuning_cache_argument(tmp_path):
    """tuning_cache: a TuningCache, the path of a cache file, or None; a path that is not a file is a ValueError (a
    typo would otherwise serve untuned), anything else a TypeError, both naming it."""
    from moe2cta import tuning

    w13 = torch.randn(4, 2 * 16, 32)
    w2 = torch.randn(4, 32, 16)
    routing = RoutingConfig(top_k=2)
    with pytest.raises(ValueError, match="tuning_cache: .*tuning.json' is not a file"):
        MoELayer(w13, w2, routing=routing, backend="torch", tuning_cache=tmp_path / "tuning.json")
    tuning.TuningCache(tmp_path / "tuning.json").save()
    layer = MoELayer(w13, w2, routing=routing, backend="torch", tuning_cache=tmp_path / "tuning.json")
    assert isinstance(layer.tuning_cache, tuning.TuningCache)
    cache = tuning.TuningCache(tmp_path / "other.json")
    assert MoELayer(w13, w2, routing=routing, backend="torch", tuning_cache=cache).tuning_cache is cache
    assert MoELayer(w13, w2, routing=routing, backend="torch").tuning_cache is None
    with pytest.raises(TypeError, match="tuning_cache"):
        MoELayer(w13, w2, routing=routing, backend="torch", tuning_cache=3)


def test_cute_plan_keeps_direct_stores_in_32_bit_range():
    """The layer's sm90 plan picks expert classes (160 / 288-row WEIGHTS_AS_M tiles, which store by 32-bit element
    offsets) itself, not through the wrappers' config_for_rows: an output of more than 2**31 - 1 elements plans the
    one regular launch instead (here GEMM2 of H = 24576 at T = 8192, k = 8, E = 256: 98048 rows x 24576), while a
    deepseek-v3-sized layer keeps its classes."""
    import types

    import moe2cta.api as api
    from moe2cta.grouped_gemm import sm90_grouped_gemm as s90

    def layer(hidden, inter=2048, experts=256, k=8):
        problems = (s90.Sm90Problem(s90.GemmStage.GEMM1, 2 * inter, hidden, experts, torch.bfloat16, Activation.SWIGLU,
                                    False, False),
                    s90.Sm90Problem(s90.GemmStage.GEMM2, hidden, inter, experts, torch.bfloat16, None, False, True))
        return types.SimpleNamespace(prepared={"module": s90, "problems": problems},
                                     config=MoEConfig(RoutingConfig(top_k=k)), num_global_experts=experts,
                                     num_experts=experts, hidden_size=hidden, intermediate=inter,
                                     w13=torch.empty(1, dtype=torch.bfloat16), b13=None, tuning_cache=None,
                                     gemm1_input=moe2cta.Gemm1Input.AUTO)

    wide = s90.Operands.WEIGHTS_AS_M
    big = api._make_cute_plan(layer(24576), 8192, 8)
    assert big.classes2 == () and [c.config.operands for c in big.classes1][:2] == [wide, wide]
    deepseek = api._make_cute_plan(layer(7168), 8192, 8)
    assert [c.config.operands for c in deepseek.classes2][:2] == [wide, wide]
    assert s90.direct_store_fits(deepseek.classes2[0].config, layer(24576).prepared["problems"][1], 98048) is False
