"""CPU tier of the router kernels: every Triton kernel against its torch twin, small shapes.

Without a CUDA GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (set for each test only: the
kernel modules decorate their kernels per interpreter mode on first use); with a GPU the same tests run
compiled on the GPU.
"""
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

from moe2cta.router import (
    Dispatch,
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

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = RouterBackend.TRITON


@pytest.fixture(autouse=True)
def _interpreter_without_gpu(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def assert_dispatch_equal(got: Dispatch, want: Dispatch):
    for name in ("counts", "token_offsets", "row_offsets", "tile_offsets", "sorted_slots", "slot_rows"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == torch.int32 and g.shape == w.shape, name
        assert torch.equal(g.cpu(), w.cpu()), f"{name}: {g.cpu().tolist()} != {w.cpu().tolist()}"
    assert got.align == want.align and tuple(got.tile_heights) == tuple(want.tile_heights)


def assert_route_equal(got, want):
    (w, i), (rw, ri) = got, want
    assert i.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(i.cpu(), ri.cpu()), f"ids {i.cpu().tolist()} != {ri.cpu().tolist()}"
    torch.testing.assert_close(w.cpu(), rw.cpu(), rtol=1e-6, atol=0, equal_nan=True)


ROUTE_CASES = [
    # (scoring, dtype, E, k, config extras, bias dtype)
    ("softmax", torch.bfloat16, 16, 4, {}, None),
    ("softmax", torch.float32, 24, 3, {"renormalize": False}, None),
    ("topk_softmax", torch.float16, 16, 2, {}, None),
    ("sigmoid_top1", torch.bfloat16, 16, 1, {"renormalize": False}, None),
    ("sigmoid_top1", torch.float32, 24, 3, {"renormalize": True, "routed_scaling_factor": 1.5}, None),
    ("sigmoid_grouped", torch.float32, 32, 4, {"num_expert_group": 4, "topk_group": 2,
                                               "routed_scaling_factor": 2.5}, torch.bfloat16),
    ("sigmoid_grouped", torch.bfloat16, 16, 3, {"renormalize": False}, torch.float32),
    # deepseek-v3's shape (the [T, G, E / G] group view) and a group count / E of no power of two (a pass per group)
    ("sigmoid_grouped", torch.bfloat16, 256, 8, {"num_expert_group": 8, "topk_group": 4,
                                                 "routed_scaling_factor": 2.5}, torch.float32),
    ("sigmoid_grouped", torch.float32, 24, 4, {"num_expert_group": 3, "topk_group": 2}, torch.float32),
]


@pytest.mark.parametrize("scoring,dtype,num_experts,top_k,extra,bias_dtype", ROUTE_CASES)
def test_route_matches_reference(scoring, dtype, num_experts, top_k, extra, bias_dtype):
    torch.manual_seed(zlib.crc32(repr((scoring, num_experts, top_k)).encode()) % 1000)
    config = RoutingConfig(top_k=top_k, scoring=scoring, **extra)
    logits = (torch.randn(9, num_experts) * 2).to(dtype).to(DEVICE)
    bias = None if bias_dtype is None else (torch.randn(num_experts) * 0.2).to(bias_dtype).to(DEVICE)
    assert_route_equal(route(logits, config, bias, backend=TRITON), route_reference(logits, config, bias))


@pytest.mark.parametrize("scoring", list(Scoring))
def test_route_ties_nan_inf(scoring):
    """Small-integer logits force ties (lower index wins); NaN and -inf rows select in index order."""
    torch.manual_seed(3)
    num_experts = 16
    extra = {"num_expert_group": 4, "topk_group": 2} if scoring is Scoring.SIGMOID_GROUPED else {}
    config = RoutingConfig(top_k=3, scoring=scoring, **extra)
    logits = torch.randint(-2, 3, (6, num_experts)).float()
    logits[1, 5] = float("nan")
    logits[2] = float("nan")
    logits[3, :8] = -float("inf")
    logits[4] = -float("inf")
    logits = logits.to(DEVICE)
    assert_route_equal(route(logits, config, backend=TRITON), route_reference(logits, config))


def test_route_empty_and_validation():
    config = RoutingConfig(top_k=2)
    w, i = route(torch.empty(0, 8, device=DEVICE), config, backend=TRITON)
    assert w.shape == (0, 2) and i.shape == (0, 2)
    with pytest.raises(TypeError, match="logits"):
        route(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE), config, backend=TRITON)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        route(torch.randn(2, 8, device=DEVICE), RoutingConfig(top_k=2, scoring="sigmoid_grouped"),
              torch.randn(7, device=DEVICE), backend=TRITON)
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(2, 8, device=DEVICE), RoutingConfig(top_k=17), backend=TRITON)
    with pytest.raises(ValueError, match="backend"):
        route(torch.randn(2, 8, device=DEVICE), config, backend="cuda-magic")


def _random_ids(num_tokens, top_k, num_experts, gen, skew=None):
    """Distinct experts per token; skew: None (uniform), 'one' (expert 1 in every token), 'few'."""
    if num_tokens == 0:
        return torch.empty(0, top_k, dtype=torch.int32)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if skew == "one":
        scores[:, 1] = 2.0
    elif skew == "few":  # most experts get no token
        scores[:, top_k + 2:] = -1.0
    return scores.topk(top_k, dim=1).indices.to(torch.int32)


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,align,heights",
    [(0, 2, 8, 16, (16, 64, 128, 256)), (1, 4, 8, 128, (16, 64, 128, 256)), (7, 2, 24, 16, (16, 64)),
     (33, 3, 24, 1, (1, 2, 4, 8)), (20, 4, 16, 8, (8,))],
)
@pytest.mark.parametrize("skew", [None, "one", "few"])
def test_dispatch_single_program(num_tokens, top_k, num_experts, align, heights, skew):
    gen = torch.Generator().manual_seed(num_tokens * 31 + top_k)
    ids = _random_ids(num_tokens, top_k, num_experts, gen, skew).to(DEVICE)
    got = dispatch(ids, num_experts, align=align, tile_heights=heights, backend=TRITON,
                   scheme=DispatchScheme.SINGLE_PROGRAM)
    assert_dispatch_equal(got, dispatch_reference(ids, num_experts, align=align, tile_heights=heights))


@pytest.mark.parametrize("num_tokens,top_k,block_slots", [(50, 3, 16), (40, 4, 32), (5, 2, 64)])
@pytest.mark.parametrize("skew", [None, "one"])
def test_dispatch_multi_block(num_tokens, top_k, block_slots, skew):
    num_experts = 12
    gen = torch.Generator().manual_seed(num_tokens + block_slots)
    ids = _random_ids(num_tokens, top_k, num_experts, gen, skew).to(DEVICE)
    got = dispatch(ids, num_experts, align=16, backend=TRITON, scheme=DispatchScheme.MULTI_BLOCK,
                   block_slots=block_slots)
    assert_dispatch_equal(got, dispatch_reference(ids, num_experts, align=16))


@pytest.mark.parametrize("scheme", [DispatchScheme.SINGLE_PROGRAM, DispatchScheme.MULTI_BLOCK])
def test_dispatch_expert_map_and_dropped_slots(scheme):
    """Expert parallelism: 16 global experts, 6 on this rank; slot ids of -1 are off-rank too."""
    gen = torch.Generator().manual_seed(7)
    ids = _random_ids(11, 3, 16, gen)
    ids[2, 1] = -1
    expert_map = torch.full((16,), -1, dtype=torch.int32)
    expert_map[torch.tensor([3, 4, 9, 10, 11, 15])] = torch.arange(6, dtype=torch.int32)
    ids, expert_map = ids.to(DEVICE), expert_map.to(DEVICE)
    got = dispatch(ids, 6, align=8, expert_map=expert_map, backend=TRITON, scheme=scheme, block_slots=16)
    want = dispatch_reference(ids, 6, align=8, expert_map=expert_map)
    assert_dispatch_equal(got, want)
    assert (got.slot_rows == -1).any()


@pytest.mark.parametrize("scheme", [DispatchScheme.SINGLE_PROGRAM, DispatchScheme.MULTI_BLOCK])
def test_dispatch_ids_outside_the_experts_are_off_rank(scheme):
    """The contract for ids the layer does not range-check (id_check=skip): ids >= E, ids past the map's end and map
    values >= E get no row (slot_rows -1) in the kernel and in its torch twin alike."""
    gen = torch.Generator().manual_seed(8)
    ids = _random_ids(7, 2, 6, gen)
    ids[0, 1], ids[3, 0], ids[5, 1] = 6, 1000, -7
    ids = ids.to(DEVICE)
    got = dispatch(ids, 6, align=4, backend=TRITON, scheme=scheme, block_slots=16)
    want = dispatch_reference(ids, 6, align=4)
    assert_dispatch_equal(got, want)
    assert want.slot_rows.view(7, 2)[0, 1] == -1 and want.slot_rows.view(7, 2)[3, 0] == -1
    expert_map = torch.tensor([0, 1, 2, 3, 9, -1, 4, 5], dtype=torch.int32, device=DEVICE)  # global 4 maps past E
    ids = _random_ids(7, 2, 8, gen)
    ids[1, 0], ids[2, 1], ids[4, 0] = 4, 8, 1000  # mapped past E, at and past the map's end
    ids = ids.to(DEVICE)
    got = dispatch(ids, 6, align=4, expert_map=expert_map, backend=TRITON, scheme=scheme, block_slots=16)
    want = dispatch_reference(ids, 6, align=4, expert_map=expert_map)
    assert_dispatch_equal(got, want)
    assert (want.slot_rows.view(7, 2)[[1, 2, 4], [0, 1, 0]] == -1).all()


def test_dispatch_rewrites_stale_rows():
    """A second call into fresh buffers must not depend on a first; also int64 ids are accepted."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(2):
        ids = _random_ids(9, 2, 8, gen).to(DEVICE)
        assert_dispatch_equal(dispatch(ids.long(), 8, align=4, backend=TRITON), dispatch_reference(ids, 8, align=4))


def test_dispatch_validation():
    ids = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="topk_ids"):
        dispatch(ids.float(), 8, backend=TRITON)
    with pytest.raises(ValueError, match="align"):
        dispatch(ids, 8, align=0, backend=TRITON)
    with pytest.raises(ValueError, match="tile_heights"):
        dispatch(ids, 8, tile_heights=(16, 32, 64, 128, 256), backend=TRITON)
    with pytest.raises(ValueError, match="num_experts"):
        dispatch(ids, 513, backend=TRITON)
    with pytest.raises(ValueError, match="block_slots"):
        dispatch(ids, 8, backend=TRITON, scheme=DispatchScheme.MULTI_BLOCK, block_slots=24)
    for backend in (TRITON, RouterBackend.TORCH):
        with pytest.raises(ValueError, match="^scheme: expected one of"):
            dispatch(ids, 8, backend=backend, scheme="fast")


@pytest.mark.parametrize("dtype,hidden_size,with_scale", [(torch.float16, 40, False), (torch.float32, 64, True),
                                                          (torch.bfloat16, 48, True)])
def test_gather_matches_reference(dtype, hidden_size, with_scale):
    torch.manual_seed(hidden_size)
    num_tokens, top_k, num_experts = 13, 3, 8
    ids = _random_ids(num_tokens, top_k, num_experts, torch.Generator().manual_seed(1)).to(DEVICE)
    disp = dispatch_reference(ids, num_experts, align=8)
    hidden = torch.randn(num_tokens, hidden_size).to(dtype).to(DEVICE)
    scale = torch.rand(num_tokens, top_k, device=DEVICE) if with_scale else None
    got = gather(hidden, disp, top_k, scale=scale, backend=TRITON)
    want = gather_reference(hidden, disp, top_k, scale)
    valid = disp.sorted_slots >= 0
    assert got.shape == want.shape
    if with_scale and dtype is torch.bfloat16 and DEVICE == "cpu":
        # the interpreter rounds fp32 -> bf16 by truncation (GPU: round to nearest even): 1 ulp apart
        torch.testing.assert_close(got[valid].cpu(), want[valid].cpu(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got[valid].cpu(), want[valid].cpu())


@pytest.mark.parametrize("backend", [TRITON, RouterBackend.TORCH])
def test_gather_writes_row_weights(backend):
    """With slot_weights, the gather also writes each valid row's router weight (GEMM2's row scale) and leaves
    the padding rows and off-rank slots (row -1) alone; the weights are fp32 and exact."""
    num_tokens, top_k, hidden_size = 11, 4, 40
    ids = _random_ids(num_tokens, top_k, 16, torch.Generator().manual_seed(3))
    expert_map = torch.where(torch.arange(16) < 12, torch.arange(16), -1).to(torch.int32)
    ids, expert_map = ids.to(DEVICE), expert_map.to(DEVICE)
    disp = dispatch_reference(ids, 12, align=8, expert_map=expert_map)
    hidden = torch.randn(num_tokens, hidden_size, device=DEVICE).to(torch.float16)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    row_w = torch.full((disp.sorted_slots.numel(),), -7.0, device=DEVICE)
    got = gather(hidden, disp, top_k, backend=backend, slot_weights=weights, row_weights_out=row_w)
    slots = disp.sorted_slots.long().cpu()
    valid = slots >= 0
    assert torch.equal(got[valid.to(got.device)].cpu(), gather_reference(hidden, disp, top_k)[valid.to(got.device)].cpu())
    assert torch.equal(row_w.cpu()[valid], weights.reshape(-1).cpu()[slots[valid]])
    assert bool((row_w.cpu()[~valid] == -7.0).all())  # padding rows untouched
    with pytest.raises(ValueError, match="slot_weights, row_weights_out"):
        gather(hidden, disp, top_k, backend=backend, slot_weights=weights)
    with pytest.raises(ValueError, match="row_weights_out"):
        gather(hidden, disp, top_k, backend=backend, slot_weights=weights, row_weights_out=row_w[:-1])
    with pytest.raises(TypeError, match="slot_weights"):
        gather(hidden, disp, top_k, backend=backend, slot_weights=(weights * 8).int(), row_weights_out=row_w)
    for wdtype in (torch.bfloat16, torch.float16, torch.float64):  # read as given, widened (or rounded) to fp32
        narrow = weights.to(wdtype)
        got_w = torch.full_like(row_w, -7.0)
        gather(hidden, disp, top_k, backend=backend, slot_weights=narrow, row_weights_out=got_w)
        assert torch.equal(got_w.cpu()[valid], narrow.float().reshape(-1).cpu()[slots[valid]]), wdtype


@pytest.mark.parametrize("backend", [TRITON, RouterBackend.TORCH])
def test_scatter_row_weights_is_the_gathers_row_weights(backend):
    """scatter_row_weights writes exactly what gather's row_weights_out gets (each valid row's router weight), with
    no gather: padding rows and off-rank slots (row -1) are left alone. Bad arguments name themselves."""
    from moe2cta.router import scatter_row_weights

    num_tokens, top_k = 300, 4  # more slots than one program's block
    ids = _random_ids(num_tokens, top_k, 16, torch.Generator().manual_seed(4))
    expert_map = torch.where(torch.arange(16) < 12, torch.arange(16), -1).to(torch.int32)
    ids, expert_map = ids.to(DEVICE), expert_map.to(DEVICE)
    disp = dispatch_reference(ids, 12, align=8, expert_map=expert_map)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    got = torch.full((disp.sorted_slots.numel(),), -7.0, device=DEVICE)
    assert scatter_row_weights(weights, disp, got, backend=backend) is got
    # each row holding slot s gets weights.flat[s]; padding rows (sorted_slots -1) keep -7
    slots = disp.sorted_slots.long().cpu()
    valid = slots >= 0
    got = got.cpu()
    assert valid.any() and (~valid).any()
    assert torch.equal(got[valid], weights.reshape(-1).cpu()[slots[valid]])
    assert torch.equal(got[~valid], torch.full_like(got[~valid], -7.0))
    with pytest.raises(ValueError, match="out"):
        scatter_row_weights(weights, disp, got[:-1], backend=backend)
    with pytest.raises(TypeError, match="slot_weights"):
        scatter_row_weights((weights * 8).int(), disp, got, backend=backend)
    for wdtype in (torch.bfloat16, torch.float16, torch.float64):  # read as given, widened (or rounded) to fp32
        narrow = weights.to(wdtype)
        got_w = scatter_row_weights(narrow, disp, torch.full_like(got, -7.0).to(DEVICE), backend=backend).cpu()
        assert torch.equal(got_w[valid], narrow.float().reshape(-1).cpu()[slots[valid]]), wdtype
        assert torch.equal(got_w[~valid], torch.full_like(got_w[~valid], -7.0))
    with pytest.raises(ValueError, match="slot_weights"):
        scatter_row_weights(weights[:-1], disp, got, backend=backend)
    assert scatter_row_weights(weights, disp, got.to(DEVICE), backend=backend, top_k=top_k) is not None
    with pytest.raises(ValueError, match=r"slot_weights: expected shape \[T, 4\] \(top_k columns\), got \(4, 300\)"):
        scatter_row_weights(weights.t().contiguous(), disp, got.to(DEVICE), backend=backend, top_k=top_k)


@pytest.mark.parametrize("dtype,out_dtype,with_weights", [(torch.float16, None, True), (torch.float32, None, False),
                                                          (torch.bfloat16, torch.float32, True)])
def test_combine_matches_reference(dtype, out_dtype, with_weights):
    torch.manual_seed(5)
    num_tokens, top_k, hidden_size = 10, 4, 72
    ids = _random_ids(num_tokens, top_k, 16, torch.Generator().manual_seed(2))
    expert_map = torch.where(torch.arange(16) < 12, torch.arange(16), -1).to(torch.int32)
    ids, expert_map = ids.to(DEVICE), expert_map.to(DEVICE)
    disp = dispatch_reference(ids, 12, align=4, expert_map=expert_map)
    y = torch.randn(disp.sorted_slots.numel(), hidden_size).to(dtype).to(DEVICE)
    weights = torch.rand(num_tokens, top_k, device=DEVICE) if with_weights else None
    if with_weights:  # a NaN weight on an off-rank slot must add nothing
        off = (disp.slot_rows.view(num_tokens, top_k) < 0).nonzero()
        if len(off):
            weights[off[0, 0], off[0, 1]] = float("nan")
    got = combine(y, disp, weights, num_tokens, top_k, out_dtype=out_dtype, backend=TRITON)
    want = combine_reference(y, disp, weights, num_tokens, top_k, out_dtype)
    assert got.dtype == want.dtype and not torch.isnan(got).any()
    # fp32 accumulation of the same products: a few ulps of the output dtype at most.
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[got.dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=tol, atol=tol)
    again = combine(y, disp, weights, num_tokens, top_k, out_dtype=out_dtype, backend=TRITON)
    assert torch.equal(got, again)
    if with_weights:  # weights of another float dtype are read as given: the result of widening them first
        for wdtype in (torch.bfloat16, torch.float64):
            narrow = weights.to(wdtype)
            got_w = combine(y, disp, narrow, num_tokens, top_k, out_dtype=out_dtype, backend=TRITON)
            assert torch.equal(got_w, combine(y, disp, narrow.float(), num_tokens, top_k, out_dtype=out_dtype,
                                              backend=TRITON)), wdtype
    for backend in (TRITON, RouterBackend.TORCH):  # fewer rows than the dispatch addresses: named, not read
        with pytest.raises(ValueError, match=r"^y: expected at least \d+ rows"):
            combine(y[:4], disp, weights, num_tokens, top_k, out_dtype=out_dtype, backend=backend)


@pytest.mark.parametrize("use_map", [False, True])
def test_route_dispatch_fused(use_map):
    torch.manual_seed(9)
    num_experts, num_tokens = 16, 5
    config = RoutingConfig(top_k=3, scoring=Scoring.SOFTMAX)
    logits = torch.randn(num_tokens, num_experts).to(torch.bfloat16).to(DEVICE)
    expert_map = None
    local = num_experts
    if use_map:
        expert_map = torch.where(torch.arange(16) % 2 == 0, torch.arange(16) // 2, -1).to(torch.int32).to(DEVICE)
        local = 8
    weights, ids, disp = route_dispatch(logits, config, local, align=8, expert_map=expert_map, backend=TRITON)
    rw, ri = route_reference(logits, config)
    assert_route_equal((weights, ids), (rw, ri))
    assert_dispatch_equal(disp, dispatch_reference(ri, local, align=8, expert_map=expert_map))
    if use_map:  # an int64 map is read as given (no narrowing launch), its values compared as int64
        wide = expert_map.long()
        wide[2] = 2**32 + wide[2]  # past int32: off-rank, not wrapped back onto its local expert
        _, ids64, disp64 = route_dispatch(logits, config, local, align=8, expert_map=wide, backend=TRITON)
        assert_dispatch_equal(disp64, dispatch_reference(ri, local, align=8, expert_map=wide))


# ------------------------------------------------------------------ LOGIT_INT32 keys (v3) vs SCORE_INT64
from moe2cta.router.routing_triton import GroupReduce, KeyPacking, resolve_key_packing, route_variant  # noqa: E402

LOGIT_SCORINGS = [("softmax", True), ("softmax", False), ("topk_softmax", True), ("sigmoid_top1", False)]


def _hard_logits(num_tokens, num_experts, gen):
    """Random rows plus rows built to break a careless packed-key top-k: ties, -inf, NaN, +inf, -0.0 / +0.0,
    exp underflow at the k-th place, tiny logits absorbed by the max."""
    x = torch.randn(num_tokens, num_experts, generator=gen) * 2
    x[1] = torch.randint(-2, 3, (num_experts,), generator=gen).float()  # many ties
    x[2, 1] = float("nan")
    x[3] = float("nan")
    x[4, : num_experts // 2] = -float("inf")
    x[5] = -float("inf")
    x[6, 3] = float("inf")
    x[7] = torch.where(torch.arange(num_experts) % 2 == 0, torch.tensor(-0.0), torch.tensor(0.0))
    x[7, num_experts - 1] = -1.0
    x[8] = -200.0 - torch.arange(num_experts).float()  # one survivor of exp, the rest underflow (p = 0)
    x[8, num_experts // 2] = 50.0
    x[9] = torch.linspace(-1e-6, 1e-6, num_experts)  # absorbed by the max 4.0: softmax ties
    x[9, num_experts - 1] = 4.0
    x[10] = -x[10].abs() - 1.0  # only negative logits
    return x


@pytest.mark.parametrize("scoring,renormalize", LOGIT_SCORINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (256, 5)])
def test_route_logit_int32_keys(scoring, renormalize, dtype, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_experts + top_k)
    config = RoutingConfig(top_k=top_k, scoring=scoring, renormalize=renormalize, routed_scaling_factor=1.25)
    logits = _hard_logits(12, num_experts, gen).to(dtype).to(DEVICE)
    assert resolve_key_packing(KeyPacking.AUTO, dtype, scoring) is KeyPacking.LOGIT_INT32
    want = route_reference(logits, config)
    assert_route_equal(route(logits, config, backend=TRITON), want)  # AUTO picks LOGIT_INT32
    assert_route_equal(route_variant(logits, config, key_packing="logit_int32", block_t=4, num_warps=1), want)
    assert_route_equal(route_variant(logits, config, key_packing="score_int64"), want)


def test_route_logit_int32_all_experts_and_blocks():
    """k == E (no candidate k+1), and a block of one ambiguous row (fallback) next to plain rows."""
    gen = torch.Generator().manual_seed(5)
    config = RoutingConfig(top_k=8)
    logits = _hard_logits(12, 8, gen).to(torch.bfloat16).to(DEVICE)
    assert_route_equal(route_variant(logits, config, key_packing="logit_int32", block_t=2, num_warps=1),
                       route_reference(logits, config))
    config = RoutingConfig(top_k=3)
    logits = (torch.randn(16, 32, generator=gen) * 3).to(torch.bfloat16)
    logits[13] = -300.0
    logits[13, 0] = 0.0  # exp underflows past the first expert: the selection ties at p = 0
    logits = logits.to(DEVICE)
    for block_t in (1, 4, 16):
        assert_route_equal(route_variant(logits, config, key_packing="logit_int32", block_t=block_t),
                           route_reference(logits, config))


def test_route_fp32_and_grouped_keep_score_int64():
    gen = torch.Generator().manual_seed(6)
    assert resolve_key_packing("auto", torch.float32, "softmax") is KeyPacking.SCORE_INT64
    assert resolve_key_packing("auto", torch.bfloat16, "sigmoid_grouped") is KeyPacking.SCORE_INT64
    with pytest.raises(ValueError, match="key_packing"):
        resolve_key_packing(KeyPacking.LOGIT_INT32, torch.float32, "softmax")
    with pytest.raises(ValueError, match="key_packing"):
        resolve_key_packing("packed_in_a_hurry", torch.bfloat16, "softmax")
    config = RoutingConfig(top_k=4)
    logits = _hard_logits(12, 24, gen).to(DEVICE)
    with pytest.raises(ValueError, match="key_packing"):
        route_variant(logits, config, key_packing=KeyPacking.LOGIT_INT32)
    assert_route_equal(route_variant(logits, config, block_t=8, num_warps=2), route_reference(logits, config))
    grouped = RoutingConfig(top_k=3, scoring="sigmoid_grouped", num_expert_group=4, topk_group=2)
    bias = (torch.randn(16, generator=gen) * 0.1).to(DEVICE)
    logits = _hard_logits(12, 16, gen).to(torch.bfloat16).to(DEVICE)
    assert_route_equal(route(logits, grouped, bias, backend=TRITON), route_reference(logits, grouped, bias))


@pytest.mark.parametrize("num_experts,groups,topk_group,block_t", [(64, 8, 3, 1), (64, 8, 3, 4), (32, 4, 1, 2)])
def test_grouped_route_view_and_per_group_agree(num_experts, groups, topk_group, block_t):
    """GroupReduce.AUTO (the [T, G, E / G] view: E and G powers of two) and PER_GROUP select the same experts
    with the same weights, on tie-heavy logits with NaN and -inf rows."""
    gen = torch.Generator().manual_seed(num_experts + groups + block_t)
    config = RoutingConfig(top_k=4, scoring="sigmoid_grouped", num_expert_group=groups, topk_group=topk_group)
    logits = _hard_logits(12, num_experts, gen)
    logits, bias = logits.to(DEVICE), (torch.randn(num_experts, generator=gen) * 0.1).to(DEVICE)
    want = route_reference(logits, config, bias)
    for reduce in (GroupReduce.AUTO, "per_group"):
        assert_route_equal(route_variant(logits, config, bias, group_reduce=reduce, block_t=block_t), want)
    with pytest.raises(ValueError, match="group_reduce"):
        route_variant(logits, config, bias, group_reduce="pairwise")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_route_dispatch_fused_logit_keys(dtype):
    """The fused decode launch shares route_token_block: AUTO -> LOGIT_INT32 there too."""
    gen = torch.Generator().manual_seed(8)
    config = RoutingConfig(top_k=4)
    logits = _hard_logits(12, 16, gen).to(dtype).to(DEVICE)
    weights, ids, disp = route_dispatch(logits, config, align=8, backend=TRITON)
    rw, ri = route_reference(logits, config)
    assert_route_equal((weights, ids), (rw, ri))
    assert_dispatch_equal(disp, dispatch_reference(ri, 16, align=8))


@pytest.mark.parametrize("block_slots", [16, 32, 64])
def test_dispatch_block_slots_variants(block_slots):
    """The multi-block dispatch is identical for every slots-per-program choice (bench variants)."""
    gen = torch.Generator().manual_seed(block_slots)
    ids = _random_ids(60, 4, 24, gen, "few").to(DEVICE)
    got = dispatch(ids, 24, align=16, backend=TRITON, scheme=DispatchScheme.MULTI_BLOCK, block_slots=block_slots)
    assert_dispatch_equal(got, dispatch_reference(ids, 24, align=16))


def test_combine_compiles_for_sm90_with_dependent_launch():
    """Compiled (not interpreted) for sm_90a here: the dependent-launch prologue lowers to griddepcontrol.
    In a fresh process: this one may have triton's language patched for the interpreter."""
    pytest.importorskip("triton.backends.nvidia")
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from moe2cta.router import permute_triton
        fn = permute_triton.jit_functions().combine_kernel
        consts = dict(TOP_K=8, HAS_WEIGHTS=True, BLOCK_T=2, BLOCK_H=1024, DEPENDENT_LAUNCH=2)
        def ty(n):
            if n in consts: return "constexpr"
            if n == "slot_rows_ptr": return "*i32"
            if n == "weights_ptr": return "*fp32"
            return "*bf16" if n.endswith("_ptr") else "i32"
        sig = {n: ty(n) for n in fn.arg_names}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True})
        print("wait" if "griddepcontrol.wait" in k.asm["ptx"] else "",
              "launch" if "griddepcontrol.launch_dependents" in k.asm["ptx"] else "")
    """)
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["wait", "launch"]


@pytest.mark.parametrize("backend", [TRITON, RouterBackend.TORCH])
@pytest.mark.parametrize("with_scale", [False, True])
def test_gather_token_row_padding(backend, with_scale):
    """GatherPadding.TOKEN_ROW: every expert padding row (below row_offsets[E]) holds hidden[0] unscaled, the
    rows past the last expert's tiles are as with LEAVE (TRITON: untouched, TORCH: zeros), and the valid rows
    are what LEAVE writes."""
    num_tokens, top_k, hidden_size = 9, 3, 72
    ids = _random_ids(num_tokens, top_k, 10, torch.Generator().manual_seed(7))
    ids[:, 0] = 2  # one expert gets many rows, several get none
    ids = ids.to(DEVICE)
    disp = dispatch_reference(ids, 10, align=8)
    hidden = torch.randn(num_tokens, hidden_size, device=DEVICE).to(torch.float16)
    scale = torch.rand(num_tokens, top_k, device=DEVICE) if with_scale else None
    rows = disp.sorted_slots.numel()
    out = torch.full((rows, hidden_size), -3.0, device=DEVICE, dtype=torch.float16)
    got = gather(hidden, disp, top_k, scale=scale, out=out, backend=backend, padding="token_row")
    leave = gather(hidden, disp, top_k, scale=scale, backend=backend)
    slots = disp.sorted_slots.long().cpu()
    used = torch.arange(rows) < int(disp.row_offsets[-1])
    pad, valid, unused = used & (slots < 0), slots >= 0, ~used
    assert int(pad.sum()) > 0 and int(unused.sum()) > 0  # the case exercises both kinds of non-valid rows
    got = got.cpu()
    assert torch.equal(got[valid], leave.cpu()[valid])
    assert torch.equal(got[pad], hidden[0].cpu().expand(int(pad.sum()), -1))
    assert bool((got[unused] == (-3.0 if backend is TRITON else 0.0)).all())
    with pytest.raises(ValueError, match="padding"):
        gather(hidden, disp, top_k, backend=backend, padding="zeros")


def test_permute_launch_params_take_one_vector_per_thread_and_row():
    """BLOCK_H covers one 16-byte vector per thread of 4 warps at most (two made the combine 2-27% slower at the
    layer's prefill shapes: results/permute-h200-2026-12-01/); narrow rows take fewer warps."""
    from moe2cta.router.permute_triton import permute_launch_params

    assert permute_launch_params(7168, 2) == (1024, 4)
    assert permute_launch_params(2880, 2) == (1024, 4)
    assert permute_launch_params(4096, 4) == (512, 4)
    assert permute_launch_params(512, 2) == (512, 2)
    assert permute_launch_params(40, 2) == (64, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_and_combine_span_several_column_blocks(dtype):
    """Rows wider than one BLOCK_H (1024 columns for 16-bit types), with a masked tail block: the gather (row weights,
    TOKEN_ROW padding) and the combine match their references."""
    num_tokens, top_k, num_experts, hidden_size = 6, 2, 4, 1024 + 40
    gen = torch.Generator().manual_seed(3)
    ids = _random_ids(num_tokens, top_k, num_experts, gen).to(DEVICE)
    disp = dispatch_reference(ids, num_experts, align=8)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype).to(DEVICE)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(DEVICE)
    max_rows = disp.sorted_slots.numel()
    row_weights = torch.zeros(max_rows, device=DEVICE)
    got = gather(hidden, disp, top_k, backend=TRITON, slot_weights=weights, row_weights_out=row_weights,
                 padding="token_row")
    want = gather_reference(hidden, disp, top_k)
    used = torch.arange(max_rows, device=DEVICE) < disp.row_offsets[-1]
    want[used & (disp.sorted_slots < 0)] = hidden[0]
    assert torch.equal(got[used].cpu(), want[used].cpu())
    rows = disp.slot_rows.long()
    assert torch.equal(row_weights[rows[rows >= 0]].cpu(), weights.reshape(-1)[rows >= 0].cpu())
    y = torch.randn(max_rows, hidden_size, generator=gen).to(dtype).to(DEVICE)
    out = combine(y, disp, None, num_tokens, top_k, backend=TRITON)
    ref = combine_reference(y, disp, None, num_tokens, top_k, dtype)
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), rtol=tol, atol=tol)


def test_next_pow2():
    """The launch helpers' power of two (plain ints; Triton's next_power_of_2 is a slow constexpr function)."""
    from moe2cta.router.config import next_pow2

    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 16, 17, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 16, 32, 1024, 1024, 2048]


# ------------------------------------------------------------------ strided inputs, wide ids, degenerate sizes
def test_strided_correction_bias_and_expert_map_are_read_by_their_strides():
    """A non-contiguous e_score_correction_bias or int32 expert_map (a view with stride 2) routes and dispatches like
    its contiguous copy, in route, dispatch and the fused route_dispatch (the kernels read them with stride 1)."""
    gen = torch.Generator().manual_seed(31)
    config = RoutingConfig(top_k=2, scoring="sigmoid_grouped", num_expert_group=4, topk_group=2)
    logits = torch.randn(5, 8, generator=gen).to(DEVICE)
    wide = torch.randn(16, generator=gen).to(DEVICE)
    wide[1::2] = 50.0  # what a stride-1 read of the view would take
    bias = wide[::2]
    assert not bias.is_contiguous()
    assert_route_equal(route(logits, config, bias, backend=TRITON), route_reference(logits, config, bias.contiguous()))
    weights, ids, _ = route_dispatch(logits, config, e_score_correction_bias=bias, backend=TRITON)
    assert_route_equal((weights, ids), route_reference(logits, config, bias.contiguous()))
    big = torch.full((16,), -1, dtype=torch.int32, device=DEVICE)
    big[::2] = torch.arange(8, device=DEVICE, dtype=torch.int32) % 4
    expert_map = big[::2]
    ids = torch.tensor([[0, 1], [2, 3], [5, 6]], dtype=torch.int32, device=DEVICE)
    for scheme in (DispatchScheme.SINGLE_PROGRAM, DispatchScheme.MULTI_BLOCK):
        assert_dispatch_equal(dispatch(ids, 4, align=1, expert_map=expert_map, backend=TRITON, scheme=scheme),
                              dispatch_reference(ids, 4, align=1, expert_map=expert_map.contiguous()))
    _, _, disp = route_dispatch(logits, config, 4, align=1, expert_map=expert_map, backend=TRITON)
    _, ref_ids = route_reference(logits, config)
    assert_dispatch_equal(disp, dispatch_reference(ref_ids, 4, align=1, expert_map=expert_map.contiguous()))


def test_int64_ids_and_map_values_past_int32_stay_off_rank():
    """int64 ids or map entries beyond int32's range are off-rank (slot_rows -1) as in the torch twin; narrowing them
    to the kernels' int32 must not wrap them onto an expert (2**32 + 1 -> 1)."""
    ids = torch.tensor([[1, 2**32 + 1], [-2**40, 3]], dtype=torch.int64, device=DEVICE)
    want = dispatch_reference(ids, 4, align=1)
    assert_dispatch_equal(dispatch(ids, 4, align=1, backend=TRITON), want)
    assert want.slot_rows.tolist() == [0, -1, -1, 1]
    expert_map = torch.tensor([0, 2**32 + 1, 1, -2**33], dtype=torch.int64, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    want = dispatch_reference(ids, 4, align=1, expert_map=expert_map)
    assert_dispatch_equal(dispatch(ids, 4, align=1, expert_map=expert_map, backend=TRITON), want)
    assert want.slot_rows.tolist() == [0, -1, 1, -1]
    from moe2cta.router.api import int32_ids  # what the layer narrows int64 ids with for the TORCH backend

    narrowed = int32_ids(torch.tensor([2**32 + 1, -2**40, 3, -1]))
    assert narrowed.dtype == torch.int32 and narrowed.tolist() == [2**31 - 1, -1, 3, -1]


def test_infinite_correction_bias_ranks_its_groups_last():
    """A bias of +inf and -inf in one group makes its score NaN (inf + -inf); the group ranks last, in the kernel
    (both group reductions) as in the twin, instead of no group being kept."""
    from moe2cta.router.routing_triton import route_variant

    config = RoutingConfig(top_k=3, scoring="sigmoid_grouped", num_expert_group=4, topk_group=4)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    bias = torch.tensor([float("inf"), float("-inf")] * 4, device=DEVICE)
    want = route_reference(logits, config, bias)
    for group_reduce in ("auto", "per_group"):
        assert_route_equal(route_variant(logits, config, bias, group_reduce=group_reduce), want)


def test_gather_and_combine_check_their_sizes_and_degenerate_rows():
    """num_tokens / top_k must be ints (named in the error); an empty expert_map is refused in both backends; with
    H = 0 the gather still writes the row weights."""
    ids = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32, device=DEVICE)
    disp = dispatch(ids, 4, align=4, backend=TRITON)
    y = torch.randn(disp.sorted_slots.numel(), 8, device=DEVICE)
    for backend in (TRITON, RouterBackend.TORCH):
        for num_tokens, top_k, name in ((2.0, 2, "num_tokens"), (-2, -2, "num_tokens"), (2, 0, "top_k")):
            with pytest.raises(ValueError, match=f"^{name}: expected an int"):
                combine(y, disp, None, num_tokens, top_k, backend=backend)
        with pytest.raises(ValueError, match="^top_k: expected an int"):
            gather(torch.randn(2, 8, device=DEVICE), disp, 2.0, backend=backend)
        with pytest.raises(ValueError, match="^expert_map: expected at least one entry"):
            dispatch(ids, 4, expert_map=torch.empty(0, dtype=torch.int32, device=DEVICE), backend=backend)
        with pytest.raises(TypeError, match="^tile_heights: expected a tuple"):
            dispatch(ids, 4, tile_heights=16, backend=backend)
        weights = torch.rand(2, 2, device=DEVICE)
        rows = torch.full((disp.sorted_slots.numel(),), -5.0, device=DEVICE)
        gather(torch.empty(2, 0, device=DEVICE), disp, 2, backend=backend, slot_weights=weights, row_weights_out=rows)
        valid = disp.slot_rows.long()
        assert torch.equal(rows[valid], weights.reshape(-1))
    from moe2cta.router.api import GatherPadding
    assert GatherPadding.parse("TOKEN_ROW") is GatherPadding.TOKEN_ROW


def test_triton_dispatch_names_a_batch_past_its_slot_limit(monkeypatch):
    """dispatch_triton.py's limit (T*k < 2**31 / 1024: its int32 block x bin offsets) is checked on the host."""
    import moe2cta.router.api as router_api

    monkeypatch.setattr(router_api, "MAX_DISPATCH_SLOTS", 64)  # (on DEVICE: the interpreter only without a GPU)
    ids = torch.randint(0, 8, (40, 2), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="^topk_ids: the TRITON dispatch takes T\\*k < 64 slots, got 80"):
        router_api.dispatch(ids, 8, backend="triton")
    router_api.dispatch(ids[:30], 8, backend="triton")  # 60 slots
