"""moe2cta.adapters: the layer as torch.library custom ops (registry, fake implementations, torch.compile)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe2cta
from moe2cta import Activation, MoELayer, RoutingConfig, Scoring, adapters, moe_reference, route


def _layer(routing, num_experts=8, hidden=64, inter=32, dtype=torch.float32, device="cpu", seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    return MoELayer(w13, w2, routing=routing, **kw)


@pytest.fixture
def registered():
    """Names registered by a test, forgotten after it (the registry is process-wide)."""
    names = []

    def register(name, layer):
        names.append(adapters.register_layer(name, layer))
        return name

    yield register
    for name in names:
        adapters.unregister_layer(name)


ROUTINGS = [
    RoutingConfig(top_k=2),
    RoutingConfig(top_k=3, scoring=Scoring.SIGMOID_GROUPED, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
]


@pytest.mark.parametrize("routing", ROUTINGS, ids=["softmax", "dsv3"])
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_ops_are_the_layer_call(registered, routing, num_tokens):
    bias = torch.randn(8) if routing.scoring is Scoring.SIGMOID_GROUPED else None
    layer = _layer(routing, e_score_correction_bias=bias, activation=Activation.GELU_GATED)
    name = registered("layers.0.experts", layer)
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, logits = torch.randn(num_tokens, 64, generator=gen), torch.randn(num_tokens, 8, generator=gen)
    out = torch.ops.moe2cta.moe_forward(hidden, logits, name)
    assert out.shape == (num_tokens, 64) and out.dtype == hidden.dtype
    assert torch.equal(out, layer(hidden, logits))
    weights, ids = route(logits, routing, bias, backend="torch")
    out_topk = torch.ops.moe2cta.moe_forward_topk(hidden, weights, ids, name)
    assert torch.equal(out_topk, layer(hidden, topk_weights=weights, topk_ids=ids))
    if num_tokens:
        ref = moe_reference(hidden, layer.w13, layer.w2, weights, ids, Activation.GELU_GATED, dtype=torch.float64)
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert out.data_ptr() != hidden.data_ptr() or num_tokens == 0


def test_opcheck_both_ops(registered):
    """Schema, fake tensor, autograd registration and AOT dispatch (dynamic shapes) as torch.library checks them."""
    routing = RoutingConfig(top_k=2)
    name = registered("opcheck", _layer(routing))
    hidden, logits = torch.randn(5, 64), torch.randn(5, 8)
    weights, ids = route(logits, routing, backend="torch")
    for op, args in ((torch.ops.moe2cta.moe_forward.default, (hidden, logits, name)),
                     (torch.ops.moe2cta.moe_forward_topk.default, (hidden, weights, ids, name))):
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, (op, results)


def test_compiled_model_traces_the_op_without_a_graph_break(registered):
    """fullgraph=True fails on any graph break; dynamic=True traces T symbolically through the fake implementation."""
    routing = RoutingConfig(top_k=2)
    layer = _layer(routing, seed=3)
    name = registered("layers.1.experts", layer)

    def block(hidden, logits):  # a residual MoE block as an engine writes it
        return hidden + torch.ops.moe2cta.moe_forward(torch.nn.functional.rms_norm(hidden, (64,)), logits, name)

    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
    for num_tokens in (3, 9):
        hidden, logits = torch.randn(num_tokens, 64), torch.randn(num_tokens, 8)
        assert torch.equal(compiled(hidden, logits), block(hidden, logits))


def test_fake_implementation_checks_shapes(registered):
    name = registered("fake", _layer(RoutingConfig(top_k=2)))
    with FakeTensorMode():
        hidden, logits = torch.empty(4, 64), torch.empty(4, 8)
        out = torch.ops.moe2cta.moe_forward(hidden, logits, name)
        assert out.shape == (4, 64) and out.dtype == torch.float32
        with pytest.raises(ValueError, match="hidden: expected"):
            torch.ops.moe2cta.moe_forward(torch.empty(4, 32), logits, name)
        with pytest.raises(ValueError, match="router_logits: expected"):
            torch.ops.moe2cta.moe_forward(hidden, torch.empty(5, 8), name)
        with pytest.raises(ValueError, match="topk_ids: expected"):
            torch.ops.moe2cta.moe_forward_topk(hidden, torch.empty(4, 2), torch.empty(3, 2, dtype=torch.int32), name)
        # what a tracer can check beyond T and H: the experts' width, k, dtypes
        with pytest.raises(ValueError, match="^router_logits: expected shape"):
            torch.ops.moe2cta.moe_forward(hidden, torch.empty(4, 7), name)
        with pytest.raises(TypeError, match="^hidden: expected dtype torch.float32"):
            torch.ops.moe2cta.moe_forward(hidden.half(), logits, name)
        with pytest.raises(ValueError, match="^topk_ids: expected 2 columns"):
            torch.ops.moe2cta.moe_forward_topk(hidden, torch.empty(4, 3), torch.empty(4, 3, dtype=torch.int32), name)
        with pytest.raises(TypeError, match="^topk_ids: expected dtype"):
            torch.ops.moe2cta.moe_forward_topk(hidden, torch.empty(4, 2), torch.empty(4, 2), name)


def test_registry_errors(registered):
    layer = _layer(RoutingConfig(top_k=2))
    name = registered("dup", layer)
    assert adapters.register_layer(name, layer) == name  # the same layer again: a no-op
    assert adapters.registered_layer(name) is layer
    with pytest.raises(ValueError, match="name: 'dup' is already registered"):
        adapters.register_layer(name, _layer(RoutingConfig(top_k=2)))
    with pytest.raises(ValueError, match="name: expected a non-empty str"):
        adapters.register_layer("", layer)
    with pytest.raises(TypeError, match="layer: expected a moe2cta.MoELayer"):
        adapters.register_layer("x", torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="layer_name: no moe2cta layer is registered as 'missing'"):
        torch.ops.moe2cta.moe_forward(torch.randn(2, 64), torch.randn(2, 8), "missing")
    with pytest.raises(ValueError, match="name: no layer is registered as 'missing'"):
        adapters.unregister_layer("missing")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "cute", "auto"])
def test_gpu_compiled_op_under_cuda_graphs(registered, backend):
    """torch.compile with CUDA graphs (mode="reduce-overhead", Inductor) around the op: the op's output is bit-equal to
    the eager layer call and within 2x of a bf16 torch run, at a decode and a prefill size (the kernels of
    test_api's hot-path test)."""
    routing = RoutingConfig(top_k=4)
    layer = _layer(routing, num_experts=16, hidden=256, inter=128, dtype=torch.bfloat16, device="cuda", seed=31,
                   backend=backend)
    if backend == "cute" and layer.backend is not moe2cta.Backend.CUTE:
        pytest.skip(layer.backend_reason)
    name = registered(f"gpu.{backend}", layer)

    def block(hidden, logits):
        out = torch.ops.moe2cta.moe_forward(hidden, logits, name)
        return out, hidden + out

    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator("cuda").manual_seed(32)
    for num_tokens in (64, 1024, 64):
        hidden = torch.randn(num_tokens, 256, device="cuda", generator=gen).to(torch.bfloat16)
        logits = torch.randn(num_tokens, 16, device="cuda", generator=gen)
        for _ in range(3):  # warm-up runs, then the recorded graph's replays
            out, residual = compiled(hidden, logits)
            out, residual = out.clone(), residual.clone()
        eager = layer(hidden, logits)
        assert torch.equal(out, eager), (backend, num_tokens)
        assert torch.equal(residual, hidden + eager)
        weights, ids = route(logits, routing, backend="torch")
        want = moe_reference(hidden, layer.w13, layer.w2, weights, ids, dtype=torch.float64)
        same = moe_reference(hidden, layer.w13, layer.w2, weights, ids, dtype=torch.bfloat16)
        err = (out.double() - want).abs().max() / want.abs().max()
        assert err <= 2 * (same.double() - want).abs().max() / want.abs().max() + 1e-3


def test_cute_families_make_their_launch_dummies_once():
    """prepare_device (MoELayer calls it at construction, outside any capture pool: CUDA graph trees refuse tensors a
    first launch would leave in their pool) makes each family's never-read tensors once per device, and the launches
    pass exactly those."""
    from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
    from moe2cta.grouped_gemm import sm100_grouped_gemm as s100

    cpu = torch.device("cpu")
    s90.prepare_device(cpu)
    made = s90._UNUSED[(cpu.type, cpu.index)]
    s90.prepare_device("cpu")
    assert s90._UNUSED[(cpu.type, cpu.index)] is made
    static = s90.Sm90GemmConfig(scheduler=s90.Scheduler.STATIC)
    assert all(a is b for a, b in zip(s90._launch_scratch(static, cpu), made))
    dynamic = s90._launch_scratch(s90.Sm90GemmConfig(scheduler=s90.Scheduler.DYNAMIC), cpu)
    assert dynamic[0] is not made[0] and dynamic[1] is made[1]  # a DYNAMIC launch's counters are its own
    s100.prepare_device(cpu)
    dummy = s100._SCRATCH[cpu]
    s100.prepare_device("cpu")
    assert s100._SCRATCH[cpu] is dummy
