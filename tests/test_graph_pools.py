"""CUDA graphs of two MoE layers in one shared memory pool, replayed alternately (GPU tier).

Serving engines capture one graph per batch size into one shared memory pool and replay them in any order; a
graph then reuses, as its own scratch, memory that an earlier capture of the pool freed. The DYNAMIC schedulers
once kept their work counter in a tensor made lazily per stream, the first time inside a capture: it came from such
freed memory, the earlier graph's replays overwrote it, and the GEMM skipped tiles (stop 32: the benchmark's
Triton column at mixtral-8x7b T >= 512 ran in 22 us instead of 1 ms once its graphs shared a pool with the CuTe
layer's). Each launch now zeroes its own counter (a memset node of its graph). These tests capture a CuTe layer and
a Triton layer of a mixtral-8x7b shape (8 experts: both run DYNAMIC GEMMs at these sizes) into one pool, replay
them alternately, and compare every replay with the eager forward bit for bit.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2  # mixtral-8x7b


@pytest.mark.parametrize("first, tokens", [("cute", 512), ("triton", 2048)])
def test_two_layers_share_a_graph_pool(first, tokens):
    import moe2cta

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    dev = torch.device("cuda")
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=dev, dtype=torch.bfloat16) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=dev, dtype=torch.bfloat16) / INTER**0.5
    inputs = [(torch.randn(tokens, HIDDEN, generator=gen, device=dev, dtype=torch.bfloat16),
               torch.randn(tokens, EXPERTS, generator=gen, device=dev)) for _ in range(3)]
    layers = {}
    for name in (first, "triton" if first == "cute" else "cute"):
        ok, why = moe2cta.is_supported(name, inputs[0][0], w13, w2)
        if not ok:
            pytest.skip(f"{name}: {why}")
        layers[name] = moe2cta.MoELayer(w13, w2, routing=moe2cta.RoutingConfig(top_k=TOP_K), backend=name)
    want = {(name, i): layer(*args) for name, layer in layers.items() for i, args in enumerate(inputs)}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch recommends
        for layer in layers.values():
            for args in inputs:
                layer(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs, outs = {}, {}
    for name, layer in layers.items():  # `first` is captured first, as a serving engine captures batch sizes in turn
        for i, args in enumerate(inputs):
            graphs[name, i] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name, i], pool=pool):
                outs[name, i] = layer(*args)
    wrong = []
    for r in range(4 * len(inputs)):
        for name in (list(layers) if r % 2 == 0 else list(layers)[::-1]):
            i = r % len(inputs)
            outs[name, i].fill_(float("nan"))
            graphs[name, i].replay()
            torch.cuda.synchronize()
            if not torch.equal(outs[name, i], want[name, i]):
                wrong.append(f"round {r} {name} input {i}")
    assert not wrong, f"graph replays in the shared pool that differ from the eager forward: {wrong}"


@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_graphed_layer_sizes_share_their_pool(backend):
    """GraphedMoELayer captures every batch size into one pool (largest first); calls of two sizes in turn, each
    compared with the eager forward of the same tokens (both sizes run DYNAMIC GEMMs at this mixtral-8x7b shape)."""
    import moe2cta

    gen = torch.Generator(device="cuda").manual_seed(11)
    dev = torch.device("cuda")
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=dev, dtype=torch.bfloat16) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=dev, dtype=torch.bfloat16) / INTER**0.5
    sizes = (512, 2048)
    inputs = {s: (torch.randn(s, HIDDEN, generator=gen, device=dev, dtype=torch.bfloat16),
                  torch.randn(s, EXPERTS, generator=gen, device=dev)) for s in sizes}
    ok, why = moe2cta.is_supported(backend, inputs[512][0], w13, w2)
    if not ok:
        pytest.skip(why)
    layer = moe2cta.MoELayer(w13, w2, routing=moe2cta.RoutingConfig(top_k=TOP_K), backend=backend)
    want = {s: layer(*inputs[s]) for s in sizes}
    graphed = moe2cta.GraphedMoELayer(layer, sizes)
    graphed.capture()
    wrong = [f"call {r} T={s}" for r in range(4) for s in (sizes if r % 2 else sizes[::-1])
             if not torch.equal(graphed(*inputs[s]), want[s])]
    assert graphed.eager_calls == 0
    assert not wrong, f"graph replays that differ from the eager forward: {wrong}"
