"""GPU tier of the router kernels (marker gpu): random and skewed routings on CUDA, against the torch twins
run on the same GPU; CUDA-graph capture and replay with a changed routing; no host synchronization.
"""
import pytest
import torch

from moe2cta.router import (
    DispatchScheme,
    RouterBackend,
    RoutingConfig,
    Scoring,
    combine,
    combine_reference,
    dispatch,
    dispatch_reference,
    gather,
    gather_reference,
    route,
    route_dispatch,
    route_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TRITON = RouterBackend.TRITON
FIELDS = ("counts", "token_offsets", "row_offsets", "tile_offsets", "sorted_slots", "slot_rows")


def assert_dispatch_equal(got, want):
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape and g.dtype == torch.int32, name
        assert torch.equal(g, w), f"{name}: first mismatch at {(g != w).nonzero()[:4].flatten().tolist()}"


def selection_key(logits, config, bias):
    """The score the reference selects on (NaN as -inf), to judge near-ties."""
    x = logits.float()
    if config.scoring is Scoring.SOFTMAX:
        return torch.softmax(x, -1)
    if config.scoring is Scoring.SIGMOID_GROUPED:
        s = torch.sigmoid(x)
        return s + bias.float() if bias is not None else s
    return x


def assert_route_close(got, want, logits, config, bias, exact_ids):
    (w, i), (rw, ri) = got, want
    if exact_ids:
        assert torch.equal(i, ri), f"ids differ in {(i != ri).any(1).sum().item()} tokens"
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=0, equal_nan=True)
        return
    # fp32 logits: a softmax / sigmoid rounding one ulp apart can reorder two scores that are equal to
    # within an ulp. Ids must match except on such near-ties; weights where the ids match.
    rows = (i != ri).any(1)
    assert rows.float().mean().item() < 1e-3, f"ids differ in {rows.sum().item()} tokens"
    if rows.any():
        key = selection_key(logits, config, bias)[rows]
        mine, ref = key.gather(1, i[rows].long()), key.gather(1, ri[rows].long())
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(w[~rows], rw[~rows], rtol=1e-6, atol=0, equal_nan=True)


ROUTE_CONFIGS = [
    (8, RoutingConfig(top_k=2), None),  # Mixtral
    (128, RoutingConfig(top_k=8), None),  # Qwen3-30B-A3B
    (128, RoutingConfig(top_k=4, scoring=Scoring.TOPK_SOFTMAX), None),
    (128, RoutingConfig(top_k=1, scoring=Scoring.SIGMOID_TOP1, renormalize=False), None),  # Llama4
    (256, RoutingConfig(top_k=8, scoring=Scoring.SIGMOID_GROUPED, num_expert_group=8, topk_group=4,
                        routed_scaling_factor=2.5), "bias"),  # DeepSeek-V3
    (512, RoutingConfig(top_k=16, renormalize=False), None),
]


@pytest.mark.parametrize("case", range(len(ROUTE_CONFIGS)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_route_gpu(case, dtype):
    num_experts, config, bias_kind = ROUTE_CONFIGS[case]
    gen = torch.Generator(device="cuda").manual_seed(case)
    bias = torch.randn(num_experts, device="cuda", generator=gen) * 0.05 if bias_kind else None
    for num_tokens in (1, 7, 128, 65536):
        logits = (torch.randn(num_tokens, num_experts, device="cuda", generator=gen) * 2).to(dtype)
        got = route(logits, config, bias, backend=TRITON)
        assert_route_close(got, route_reference(logits, config, bias), logits, config, bias,
                           exact_ids=dtype is not torch.float32)


def test_route_gpu_nan_inf_rows():
    config = RoutingConfig(top_k=4)
    logits = torch.randn(64, 128, device="cuda")
    logits[3, 7] = float("nan")
    logits[5] = float("nan")
    logits[9, :100] = -float("inf")
    logits[11, 2] = float("inf")
    got = route(logits, config, backend=TRITON)
    want = route_reference(logits, config)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0, equal_nan=True)


def routed_ids(num_tokens, top_k, num_experts, popularity, gen):
    """topk_ids with distinct experts per token, experts drawn with a chosen popularity."""
    if popularity == "uniform":
        logp = torch.zeros(num_experts, device="cuda")
    elif popularity == "zipf":
        logp = -1.2 * torch.log(torch.arange(1, num_experts + 1, device="cuda", dtype=torch.float32))
    elif popularity == "dirichlet":
        logp = torch.log(torch.distributions.Dirichlet(torch.full((num_experts,), 0.3)).sample().cuda() + 1e-12)
    elif popularity == "all_to_one":
        logp = torch.full((num_experts,), -30.0, device="cuda")
        logp[num_experts // 3] = 30.0
    elif popularity == "zero_token_experts":
        logp = torch.full((num_experts,), -float("inf"), device="cuda")
        logp[: top_k + 1] = 0.0
    else:
        raise ValueError(popularity)
    u = torch.rand(num_tokens, num_experts, device="cuda", generator=gen).clamp_min(1e-20)
    gumbel = -torch.log(-torch.log(u))
    return (logp + gumbel).topk(top_k, dim=1).indices.to(torch.int32)


@pytest.mark.parametrize("popularity", ["uniform", "zipf", "dirichlet", "all_to_one", "zero_token_experts"])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (512, 16)])
def test_dispatch_gpu(popularity, num_experts, top_k):
    gen = torch.Generator(device="cuda").manual_seed(num_experts + top_k)
    for num_tokens in (0, 1, 7, 128, 4096, 65536):
        ids = routed_ids(num_tokens, top_k, num_experts, popularity, gen)
        got = dispatch(ids, num_experts, backend=TRITON)
        assert_dispatch_equal(got, dispatch_reference(ids, num_experts))


@pytest.mark.parametrize("scheme", [DispatchScheme.SINGLE_PROGRAM, DispatchScheme.MULTI_BLOCK])
def test_dispatch_gpu_expert_map(scheme):
    gen = torch.Generator(device="cuda").manual_seed(5)
    ids = routed_ids(100, 8, 256, "zipf", gen)
    expert_map = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    expert_map[64:128] = torch.arange(64, dtype=torch.int32, device="cuda")
    got = dispatch(ids, 64, align=64, expert_map=expert_map, backend=TRITON, scheme=scheme)
    assert_dispatch_equal(got, dispatch_reference(ids, 64, align=64, expert_map=expert_map))


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("num_experts,config", [(128, RoutingConfig(top_k=8)),
                                                (256, RoutingConfig(top_k=8, scoring=Scoring.SIGMOID_GROUPED,
                                                                    num_expert_group=8, topk_group=4))])
def test_route_dispatch_fused_gpu(num_tokens, num_experts, config):
    logits = torch.randn(num_tokens, num_experts, device="cuda").to(torch.bfloat16)
    weights, ids, disp = route_dispatch(logits, config, backend=TRITON)
    rw, ri = route_reference(logits, config)
    assert torch.equal(ids, ri)
    torch.testing.assert_close(weights, rw, rtol=1e-6, atol=0)
    assert_dispatch_equal(disp, dispatch_reference(ri, num_experts))


@pytest.mark.parametrize("num_tokens", [1, 4096])
def test_gather_combine_gpu(num_tokens):
    num_experts, top_k, hidden_size = 128, 8, 2048
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    ids = routed_ids(num_tokens, top_k, num_experts, "zipf", gen)
    disp = dispatch(ids, num_experts, backend=TRITON)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    scale = torch.rand(num_tokens, top_k, device="cuda", generator=gen)
    valid = disp.sorted_slots >= 0
    for s in (None, scale):
        a1 = gather(hidden, disp, top_k, scale=s, backend=TRITON)
        assert torch.equal(a1[valid], gather_reference(hidden, disp, top_k, s)[valid])
    y = torch.randn(disp.sorted_slots.numel(), hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    out = combine(y, disp, scale, num_tokens, top_k, backend=TRITON)
    ref = combine_reference(y.double(), disp, scale.double(), num_tokens, top_k).float()
    same = combine_reference(y, disp, scale, num_tokens, top_k)
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * (same.float() - ref).abs().max().item() + 1e-6
    for _ in range(3):  # bit-stable
        assert torch.equal(combine(y, disp, scale, num_tokens, top_k, backend=TRITON), out)


@pytest.mark.parametrize("num_tokens", [4, 4096])
def test_cuda_graph_replay_with_new_routing(num_tokens):
    """Capture route + dispatch + gather + combine once; replay after the logits change; no host sync. The weights
    are checked themselves, and each row of the stand-in for the expert GEMMs has its own factor, so a token's k rows
    differ and the combine's output depends on every weight (with equal rows, renormalized weights sum to 1)."""
    num_experts, hidden_size = 128, 256
    config = RoutingConfig(top_k=8)
    logits = torch.randn(num_tokens, num_experts, device="cuda").to(torch.bfloat16)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda").to(torch.bfloat16)
    rows = route_dispatch(logits, config, backend=TRITON)[2].sorted_slots.shape[0]  # static: T, k and E fix it
    factors = (0.5 + torch.rand(rows, 1, device="cuda")).to(torch.bfloat16)

    def step():
        weights, ids, disp = route_dispatch(logits, config, backend=TRITON)
        a1 = gather(hidden, disp, config.top_k, backend=TRITON)
        y = a1 * factors  # stand-in for the expert GEMMs (padding rows are garbage; combine never reads them)
        return weights, ids, disp, combine(y, disp, weights, num_tokens, config.top_k, backend=TRITON)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, disp, out = step()
    for seed in range(3):
        torch.manual_seed(100 + seed)
        logits.copy_(torch.randn(num_tokens, num_experts, device="cuda").to(torch.bfloat16))
        if seed == 2:  # skew: every token prefers the same experts
            logits[:, :8] += 20
        graph.replay()
        torch.cuda.synchronize()
        rw, ri = route_reference(logits, config)
        assert torch.equal(ids, ri)
        torch.testing.assert_close(weights, rw, rtol=1e-6, atol=0)
        want = dispatch_reference(ri, num_experts)
        assert_dispatch_equal(disp, want)
        ref = combine_reference(gather_reference(hidden, want, 8) * factors, want, rw, num_tokens, 8)
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------ v3: LOGIT_INT32 keys, launch variants
from moe2cta.router.routing_triton import route_variant  # noqa: E402


def hard_rows(num_experts, gen):
    """Rows that break a careless packed-key top-k (see tests/test_router_triton.py::_hard_logits)."""
    x = torch.randn(12, num_experts, device="cuda", generator=gen) * 2
    x[1] = torch.randint(-2, 3, (num_experts,), device="cuda", generator=gen).float()
    x[2, 1] = float("nan")
    x[3] = float("nan")
    x[4, : num_experts // 2] = -float("inf")
    x[5] = -float("inf")
    x[6, 3] = float("inf")
    x[7] = torch.where(torch.arange(num_experts, device="cuda") % 2 == 0, -0.0, 0.0)
    x[8] = -200.0 - torch.arange(num_experts, device="cuda").float()
    x[8, num_experts // 2] = 50.0
    x[9] = torch.linspace(-1e-6, 1e-6, num_experts, device="cuda")
    x[9, num_experts - 1] = 4.0
    x[10] = -x[10].abs() - 1.0
    return x


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("topk_softmax", True),
                                                 ("sigmoid_top1", False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (512, 16)])
def test_route_gpu_logit_int32_keys(scoring, renormalize, dtype, num_experts, top_k):
    """AUTO (LOGIT_INT32 here) and the forced v2 packing, on random rows with hard rows spliced in at
    several places of a large T (ambiguous rows take the block fallback)."""
    gen = torch.Generator(device="cuda").manual_seed(num_experts + top_k)
    config = RoutingConfig(top_k=top_k, scoring=scoring, renormalize=renormalize)
    logits = torch.randn(32768, num_experts, device="cuda", generator=gen) * 2
    for at in (0, 1000, 32768 - 12):
        logits[at:at + 12] = hard_rows(num_experts, gen)
    logits = logits.to(dtype)
    want = route_reference(logits, config)
    for got in (route(logits, config, backend=TRITON), route_variant(logits, config, key_packing="score_int64"),
                route_variant(logits, config, key_packing="logit_int32", block_t=32, num_warps=8)):
        assert torch.equal(got[1], want[1]), f"ids differ in {(got[1] != want[1]).any(1).sum().item()} tokens"
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("block_t,num_warps", [(4, 1), (8, 2), (16, 4), (32, 4), (32, 8), (64, 8)])
def test_route_gpu_launch_variants(block_t, num_warps):
    """Every launch the benchmark compares gives the reference result (E=128, k=8, bf16, T=32768)."""
    gen = torch.Generator(device="cuda").manual_seed(block_t * num_warps)
    config = RoutingConfig(top_k=8)
    logits = torch.randn(32768, 128, device="cuda", generator=gen).to(torch.bfloat16)
    want = route_reference(logits, config)
    for packing in ("logit_int32", "score_int64"):
        w, i = route_variant(logits, config, key_packing=packing, block_t=block_t, num_warps=num_warps)
        assert torch.equal(i, want[1])
        torch.testing.assert_close(w, want[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("block_slots", [256, 512, 1024, 2048])
def test_dispatch_gpu_block_slots(block_slots):
    gen = torch.Generator(device="cuda").manual_seed(block_slots)
    for popularity in ("uniform", "zipf", "all_to_one"):
        ids = routed_ids(32768, 8, 128, popularity, gen)
        got = dispatch(ids, 128, backend=TRITON, scheme=DispatchScheme.MULTI_BLOCK, block_slots=block_slots)
        assert_dispatch_equal(got, dispatch_reference(ids, 128))
