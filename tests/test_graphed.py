"""GraphedMoELayer (moe2cta.graphed): one CUDA graph per batch size, padded batches, eager fallback.

CPU tier: the size lookup, the padding bookkeeping (against a model of the static buffers over random call
sequences) and the argument errors. GPU tier (marker gpu): every call equals the layer's own eager forward on the
padded batch bit for bit, on each GPU backend and both input forms; the static inputs hold that batch where the
graph reads it; the output modes; the eager fallback; the input errors; a failed capture (moe2cta.capture, which
GraphedMoELayer, the tuner and the benchmark's timing use) leaves the caller's stream and torch's RNG usable.
"""
from __future__ import annotations

import random

import pytest
import torch

from moe2cta import GraphedMoELayer, GraphInputs, GraphOutput, MoELayer, RoutingConfig, is_supported, route
from moe2cta.graphed import capture_size_for, padding_rows

from test_api import _within_2x_of_bf16_torch, make


def test_capture_size_for_takes_the_smallest_size_that_holds_the_batch():
    sizes = (1, 4, 16, 64)
    assert [capture_size_for(t, sizes) for t in (0, 1, 2, 4, 5, 16, 17, 64, 65)] == [None, 1, 4, 4, 16, 16, 64, 64, None]


def test_padding_rows_leave_padding_where_each_replay_reads_it():
    """A model of the static inputs over random call sequences: before every replay of size S for T tokens,
    rows T..S-1 hold padding, and rows at or above the returned dirty count hold padding after the call."""
    rng = random.Random(0)
    sizes = (1, 4, 16, 64)
    for _ in range(200):
        rows = ["pad"] * sizes[-1]  # what each static row holds
        dirty = 0
        for _ in range(30):
            tokens = rng.randint(1, sizes[-1])
            size = capture_size_for(tokens, sizes)
            rows[:tokens] = ["token"] * tokens
            start, end, dirty = padding_rows(tokens, size, dirty)
            assert start == tokens and end <= size
            rows[start:end] = ["pad"] * (end - start)
            assert all(r == "pad" for r in rows[tokens:size]), (tokens, size)
            assert all(r == "pad" for r in rows[dirty:])
    # repeated calls of one size write no padding
    assert padding_rows(3, 4, 3) == (3, 3, 3)


def _cpu_layer(**kwargs):
    layer = make(4, 64, 32, 8)
    return MoELayer(layer["w13"], layer["w2"], routing=RoutingConfig(top_k=2), backend="torch", **kwargs)


def test_arguments_are_named_in_errors():
    moe = _cpu_layer()
    with pytest.raises(TypeError, match="layer: expected a MoELayer"):
        GraphedMoELayer(object(), [1])
    with pytest.raises(ValueError, match="batch_sizes"):
        GraphedMoELayer(moe, [])
    with pytest.raises(ValueError, match="batch_sizes"):
        GraphedMoELayer(moe, [4, 0])
    with pytest.raises(TypeError, match="batch_sizes"):
        GraphedMoELayer(moe, 4)
    with pytest.raises(ValueError, match="inputs"):
        GraphedMoELayer(moe, [1], inputs="logits")
    with pytest.raises(ValueError, match="output"):
        GraphedMoELayer(moe, [1], output="view")
    with pytest.raises(ValueError, match="top_k: only for inputs='topk'"):
        GraphedMoELayer(moe, [1], top_k=2)
    with pytest.raises(ValueError, match="top_k: expected an int in"):
        GraphedMoELayer(moe, [1], inputs="topk", top_k=9)
    with pytest.raises(ValueError, match="top_k: the layer routes top_k=2"):  # its calls would take 2 slots
        GraphedMoELayer(moe, [1], inputs="topk", top_k=3)
    layer = make(4, 64, 32, 8)
    no_routing = MoELayer(layer["w13"], layer["w2"], routing=None, backend="torch")
    with pytest.raises(ValueError, match="inputs: router_logits needs a layer built with a routing"):
        GraphedMoELayer(no_routing, [1])
    with pytest.raises(ValueError, match="top_k: this layer has no routing"):
        GraphedMoELayer(no_routing, [1], inputs=GraphInputs.TOPK)
    # valid arguments on a layer that cannot be captured: the reason names the layer
    with pytest.raises(ValueError, match="layer: CUDA graphs need a layer on a CUDA device"):
        GraphedMoELayer(moe, [1, 8], inputs="topk", output=GraphOutput.STATIC_BUFFER)
    with pytest.raises(ValueError, match="layer: id_check=check reads topk_ids"):
        GraphedMoELayer(_cpu_layer(id_check="check"), [1])


# ----------------------------------------------------------------------------------------------------------
# GPU tier

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SIZES = (1, 4, 16, 64)
CALLS = (3, 16, 1, 64, 7, 40, 4, 12)  # sizes 4, 16, 1, 64, 16, 64, 4, 16: padding left by larger calls gets rewritten


def _gpu_layer(backend, seed=40):
    layer = make(64, 256, 128, 16, dtype=torch.bfloat16, device="cuda", seed=seed)
    routing = RoutingConfig(top_k=4)
    ok, reason = is_supported(backend, layer["hidden"], layer["w13"], layer["w2"], routing=routing)
    if not ok:
        pytest.skip(reason)
    return MoELayer(layer["w13"], layer["w2"], routing=routing, backend=backend), layer


def _inputs(tokens, seed, inputs):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 256, generator=gen).to("cuda", torch.bfloat16)
    logits = (torch.randn(tokens, 16, generator=gen) * 2).to("cuda")
    if inputs is GraphInputs.ROUTER_LOGITS:
        return hidden, dict(router_logits=logits)
    weights, ids = route(logits, RoutingConfig(top_k=4), backend="torch")
    return hidden, dict(topk_weights=weights.to("cuda"), topk_ids=ids.to("cuda", torch.int64))


def _padded(hidden, kwargs, size, inputs):
    """The batch a replay of `size` multiplies: the tokens, then padding rows (zero hidden, token 0's routing)."""
    pad = size - hidden.shape[0]
    hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
    if inputs is GraphInputs.ROUTER_LOGITS:
        logits = kwargs["router_logits"]
        return hidden, dict(router_logits=torch.cat([logits, logits[:1].expand(pad, -1)]))
    ids = kwargs["topk_ids"]
    return hidden, dict(topk_weights=torch.cat([kwargs["topk_weights"], kwargs["topk_weights"].new_zeros(pad, 4)]),
                        topk_ids=torch.cat([ids, ids[:1].expand(pad, -1)]))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("inputs", list(GraphInputs), ids=lambda m: m.value)
@pytest.mark.parametrize("backend", ["triton", "cute", "auto"])
def test_gpu_graphed_equals_the_eager_forward_of_the_padded_batch(backend, inputs):
    moe, layer = _gpu_layer(backend)
    graphed = GraphedMoELayer(moe, SIZES, inputs=inputs)
    graphed.capture([64, 16])  # the rest on first use
    assert graphed.captured_sizes == (16, 64)
    for n, tokens in enumerate(CALLS):
        hidden, kwargs = _inputs(tokens, 100 + n, inputs)
        out = graphed(hidden, **kwargs)
        size = capture_size_for(tokens, SIZES)
        padded_hidden, padded_kwargs = _padded(hidden, kwargs, size, inputs)
        want = moe(padded_hidden, **padded_kwargs)[:tokens]
        assert out.shape == (tokens, 256) and out.dtype == torch.bfloat16
        assert torch.equal(out, want), (backend, tokens, size)
        # where the replay read them, the static inputs held that padding
        static = [graphed._hidden[:size]] + [buffer[:size] for buffer in graphed._routing_buffers]
        wanted = [padded_hidden] + list(padded_kwargs.values())
        for buffer, want_rows in zip(static, wanted):
            assert torch.equal(buffer, want_rows.to(buffer.dtype)), (backend, tokens, size)
    assert graphed.captured_sizes == SIZES and graphed.eager_calls == 0
    # accuracy of a graphed call against fp64 (the tokens of the layer's own test inputs)
    if inputs is GraphInputs.ROUTER_LOGITS:
        tokens = dict(hidden=layer["hidden"][:40], logits=layer["logits"][:40])
        out = graphed(tokens["hidden"], tokens["logits"])
        assert _within_2x_of_bf16_torch(out, tokens, (tokens["hidden"], layer["w13"], layer["w2"]),
                                        RoutingConfig(top_k=4), moe.config.activation)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_gpu_graphed_topk_ids_of_either_width(backend):
    """The static ids are int64: int32 ids and int64 ids (one past int32's range: off-rank, adding nothing) copy in
    exactly, one copy each, and the replay equals the eager forward of the padded batch."""
    moe, _ = _gpu_layer(backend)
    graphed = GraphedMoELayer(moe, SIZES, inputs=GraphInputs.TOPK)
    hidden, kwargs = _inputs(5, 7, GraphInputs.TOPK)
    wide = kwargs["topk_ids"].clone()
    wide[2, 1] = 2**32 + 1  # narrowed to int32 it would wrap onto expert 1
    for ids in (kwargs["topk_ids"].to(torch.int32), wide):
        call = dict(topk_weights=kwargs["topk_weights"], topk_ids=ids)
        out = graphed(hidden, **call)
        padded_hidden, padded = _padded(hidden, call, capture_size_for(5, SIZES), GraphInputs.TOPK)
        assert torch.equal(out, moe(padded_hidden, **padded)[:5]), ids.dtype
    assert graphed._ids.dtype == torch.int64 and int(graphed._ids[2, 1]) == 2**32 + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("inputs", list(GraphInputs), ids=lambda m: m.value)
def test_gpu_graphed_inputs_written_in_place(inputs):
    """A batch written into static_inputs() views (no input copy), the first call of a size capturing it lazily: the
    capture keeps the batch, and the result equals the copying call's and the padded batch's eager forward."""
    moe, _ = _gpu_layer("triton")
    in_place = GraphedMoELayer(moe, SIZES, inputs=inputs, output=GraphOutput.STATIC_BUFFER)
    copying = GraphedMoELayer(moe, SIZES, inputs=inputs)
    for n, tokens in enumerate((5, 16, 2, 5)):
        hidden, kwargs = _inputs(tokens, 200 + n, inputs)
        views = in_place.static_inputs(tokens)
        for view, source in zip(views, (hidden, *kwargs.values())):
            view.copy_(source)
        out = in_place(*views[:2]) if inputs is GraphInputs.ROUTER_LOGITS else in_place(
            views[0], topk_weights=views[1], topk_ids=views[2])
        assert out.data_ptr() == in_place._graphs[capture_size_for(tokens, SIZES)][1].data_ptr()
        padded_hidden, padded_kwargs = _padded(hidden, kwargs, capture_size_for(tokens, SIZES), inputs)
        assert torch.equal(out, moe(padded_hidden, **padded_kwargs)[:tokens]), tokens
        assert torch.equal(out, copying(hidden, **kwargs)), tokens
    assert in_place.captured_sizes == (4, 16)
    with pytest.raises(ValueError, match=r"num_tokens: expected an int in \[1, 64\]"):
        in_place.static_inputs(65)
    with pytest.raises(ValueError, match="num_tokens"):
        in_place.static_inputs(0)


@pytest.mark.gpu
@needs_cuda
def test_gpu_graphed_runs_empty_and_oversized_batches_eagerly():
    moe, layer = _gpu_layer("triton")
    graphed = GraphedMoELayer(moe, (1, 8))
    out = graphed(layer["hidden"][:0], layer["logits"][:0])
    assert out.shape == (0, 256) and graphed.eager_calls == 1
    out = graphed(layer["hidden"][:20], layer["logits"][:20])
    assert torch.equal(out, moe(layer["hidden"][:20], layer["logits"][:20])) and graphed.eager_calls == 2
    assert graphed.captured_sizes == ()


@pytest.mark.gpu
@needs_cuda
def test_gpu_graphed_output_modes():
    """COPY returns a tensor of its own; STATIC_BUFFER a view of the graph's output that the next call overwrites."""
    moe, layer = _gpu_layer("triton")
    copied = GraphedMoELayer(moe, (8,))
    static = GraphedMoELayer(moe, (8,), output="static_buffer")
    first_copy = copied(layer["hidden"][:8], layer["logits"][:8])
    first_view = static(layer["hidden"][:8], layer["logits"][:8])
    kept = first_view.clone()
    assert torch.equal(first_copy, kept)
    assert first_view.data_ptr() == static._graphs[8][1].data_ptr()
    assert first_copy.data_ptr() != copied._graphs[8][1].data_ptr()
    second_copy = copied(layer["hidden"][8:16], layer["logits"][8:16])
    static(layer["hidden"][8:16], layer["logits"][8:16])
    assert torch.equal(first_view, second_copy)  # overwritten in place
    assert torch.equal(first_copy, kept)  # untouched
    # weights changed in place are read by the next replay
    moe.w2.mul_(2)
    assert torch.equal(copied(layer["hidden"][:8], layer["logits"][:8]), moe(layer["hidden"][:8], layer["logits"][:8]))


@pytest.mark.gpu
@needs_cuda
def test_gpu_graphed_input_errors_name_the_argument():
    moe, layer = _gpu_layer("triton")
    graphed = GraphedMoELayer(moe, (8,))
    hidden, logits = layer["hidden"][:4], layer["logits"][:4]
    with pytest.raises(TypeError, match="hidden: expected dtype torch.bfloat16"):
        graphed(hidden.float(), logits)
    with pytest.raises(ValueError, match=r"router_logits: expected shape \(4, 16\)"):
        graphed(hidden, logits[:3])
    with pytest.raises(ValueError, match=r"hidden: expected shape \(4, 256\)"):
        graphed(hidden[:, :128], logits)
    with pytest.raises(ValueError, match="router_logits: expected a tensor on cuda"):
        graphed(hidden, logits.cpu())
    with pytest.raises(TypeError, match="router_logits: expected a torch.Tensor"):
        graphed(hidden)
    with pytest.raises(ValueError, match="topk_weights / topk_ids: this GraphedMoELayer takes router_logits"):
        graphed(hidden, logits, topk_ids=torch.zeros(4, 4, dtype=torch.int32, device="cuda"))
    by_ids = GraphedMoELayer(moe, (8,), inputs="topk")
    with pytest.raises(ValueError, match="router_logits: this GraphedMoELayer takes topk_weights"):
        by_ids(hidden, logits)
    with pytest.raises(TypeError, match="topk_ids: expected dtype in"):
        by_ids(hidden, topk_weights=torch.ones(4, 4, device="cuda"), topk_ids=torch.ones(4, 4, device="cuda"))
    assert graphed.captured_sizes == () and by_ids.captured_sizes == ()


@pytest.mark.gpu
@needs_cuda
def test_gpu_failed_capture_leaves_the_stream_and_the_generator_as_they_were():
    """A capture invalidated by a host sync raises, and afterwards the caller's stream is current again and the default
    CUDA generator draws as before (torch.cuda.graph alone leaves both in capture state: torch 2.11). The benchmark's
    timing falls back to eager timing for such a callable and leaves them the same way."""
    from moe2cta.capture import capture_cuda_graph
    from moe2cta.serving_bench.timing import TimingConfig, TimingMode, time_callable

    stream = torch.cuda.Stream()
    x = torch.randn(256, 256, device="cuda")
    with torch.cuda.stream(stream):
        # torch raises the CUDA error (an AcceleratorError, a RuntimeError) from the sync or from capture_end
        with pytest.raises(RuntimeError, match="(?i)captur"):
            with capture_cuda_graph(torch.cuda.CUDAGraph()):
                x @ x
                torch.cuda.synchronize()  # not allowed while capturing
        assert torch.cuda.current_stream() == stream
    assert torch.randn(8, device="cuda").isfinite().all()

    def syncing(a):
        b = a @ a
        torch.cuda.synchronize()
        return b

    before = torch.cuda.current_stream()
    result = time_callable(syncing, [(x,)], torch.device("cuda"), TimingConfig(warmup_calls=1, min_samples=3,
                                                                                 max_samples=5, target_seconds=0.01))
    assert result.mode is TimingMode.CUDA_EVENTS and "graph capture failed" in result.note
    assert torch.cuda.current_stream() == before
    assert torch.randn(8, device="cuda").isfinite().all()


def test_a_call_leaves_no_autograd_history_on_the_static_buffers():
    """Inputs that require grad (router logits from an nn.Linear gate, outside no_grad) are copied into the static
    buffers without autograd history: no call keeps an earlier call's graph (and its activations) alive. The replay
    itself is stood in for (no GPU needed): _replay is the whole per-call path after the checks."""
    import gc
    import weakref

    graphed = GraphedMoELayer.__new__(GraphedMoELayer)
    graphed._hidden, graphed._logits = torch.zeros(4, 8), torch.zeros(4, 3)
    graphed._routing_buffers, graphed._zero_padded, graphed._token0_padded = (graphed._logits,), (graphed._hidden,), (
        graphed._logits,)
    graphed._dirty_rows, graphed.output = 0, GraphOutput.COPY
    out = torch.zeros(4, 8)

    class StandIn:
        def replay(self):
            out.copy_(graphed._hidden * 2)

    graphed._graphs = {4: (StandIn(), out)}
    gate = torch.nn.Linear(8, 3)
    alive = []
    for _ in range(3):
        hidden = torch.randn(2, 8, requires_grad=True)
        activation = hidden * 1.0  # an upstream activation the logits' graph holds
        logits = gate(activation)
        alive.append(weakref.ref(activation))
        result = graphed._replay(4, 2, hidden, (logits,))
        assert torch.equal(result, 2 * hidden.detach()) and not result.requires_grad
        assert graphed._logits.grad_fn is None and not graphed._logits.requires_grad
        del hidden, activation, logits, result
    gc.collect()
    assert all(ref() is None for ref in alive)
