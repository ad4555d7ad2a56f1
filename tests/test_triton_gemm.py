"""Triton grouped GEMM (grouped_gemm/triton_grouped_gemm.py) against the torch twins.

CPU tier: every kernel variant under TRITON_INTERPRET=1 on small fp16/fp32 shapes (the interpreter
mis-computes bf16 dots). GPU tier (marker gpu): bf16 on random and skewed routings, T up to 65536, and CUDA
graph capture + replay with a changed routing. The dispatch metadata is built here with plain torch code.
"""
from __future__ import annotations


import dataclasses
import json
import os
import subprocess
import sys
import zlib

import pytest
import triton
import torch

from moe2cta.grouped_gemm import Activation, GemmStage, grouped_gemm1_reference, grouped_gemm2_reference
from moe2cta.grouped_gemm.epilogue import (W13Layout, apply_activation, gated_activation, pack_gate_up_rows,
                                           unpack_gate_up_rows)
from moe2cta.grouped_gemm import triton_grouped_gemm as tg
from moe2cta.grouped_gemm.triton_grouped_gemm import (
    DEFAULT_TILE_HEIGHTS,
    GroupedGemmProblem,
    TileLoad,
    TileScheduler,
    TritonGemmConfig,
    can_implement,
    default_config,
    triton_grouped_gemm1,
    triton_grouped_gemm2,
)

HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- helpers
def make_dispatch(topk_ids: torch.Tensor, num_experts: int, align: int = 128,
                  tile_heights: tuple[int, ...] = DEFAULT_TILE_HEIGHTS) -> dict[str, torch.Tensor]:
    """docs/design.md dispatch metadata in plain torch (stable: rows in slot order within an expert)."""
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten().long()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + align - 1) // align * align
    zero = torch.zeros(1, dtype=torch.long, device=device)
    row_offsets = torch.cat([zero, padded.cumsum(0)])
    token_offsets = torch.cat([zero, counts.cumsum(0)])
    tile_offsets = torch.stack(
        [torch.cat([zero, ((counts + h - 1) // h).cumsum(0)]) for h in tile_heights])
    max_rows = num_tokens * top_k + num_experts * (align - 1)
    order = torch.sort(flat, stable=True).indices  # slots grouped by expert, slot order inside
    rank = torch.arange(flat.numel(), device=device) - token_offsets[flat[order]]
    sorted_slots = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
    sorted_slots[row_offsets[flat[order]] + rank] = order.to(torch.int32)
    return {
        "counts": counts.to(torch.int32),
        "row_offsets": row_offsets.to(torch.int32),
        "tile_offsets": tile_offsets.to(torch.int32).contiguous(),
        "sorted_slots": sorted_slots,
        "max_rows": max_rows,
    }


def random_topk(num_tokens: int, num_experts: int, top_k: int, device="cpu", skew: str = "uniform",
                generator=None) -> torch.Tensor:
    """skew: uniform (distinct experts per token), one (all slots on expert 0 when top_k == 1, else the first
    top_k experts), half (experts of odd index get no tokens)."""
    if skew == "one":
        ids = torch.arange(top_k, device=device).expand(num_tokens, top_k)
    elif skew == "half":
        scores = torch.rand(num_tokens, num_experts, device=device, generator=generator)
        scores[:, 1::2] = -1.0
        ids = scores.topk(top_k, dim=1).indices
    else:
        ids = torch.rand(num_tokens, num_experts, device=device, generator=generator).topk(top_k, dim=1).indices
    return ids.to(torch.int32).contiguous()


def gathered(hidden: torch.Tensor, sorted_slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """a1 in the padded layout; padding rows hold random values (kernels must not depend on them)."""
    a1 = torch.randn(sorted_slots.shape[0], hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    valid = sorted_slots >= 0
    a1[valid] = hidden[(sorted_slots[valid] // top_k).long()]
    return a1


def valid_mask(disp) -> torch.Tensor:
    rows = torch.arange(disp["max_rows"], device=disp["counts"].device)
    starts = disp["row_offsets"][:-1].long()
    ends = starts + disp["counts"].long()
    return ((rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :])).any(dim=1)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_close(out, ref32, same_dtype_run, mask, floor):
    """||out - ref|| / ||ref|| over valid rows within 2x a same-dtype torch run's error (plus a floor)."""
    if mask.sum() == 0:
        return
    assert torch.isfinite(out[mask]).all(), "non-finite or unwritten output in valid rows"
    bound = 2.0 * rel_err(same_dtype_run[mask], ref32[mask]) + floor
    err = rel_err(out[mask], ref32[mask])
    assert err <= bound, f"rel err {err:.3g} > bound {bound:.3g}"


def floor_for(dtype):
    return {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 2e-4}[dtype]


@pytest.fixture
def interpret(monkeypatch):
    """Run Triton kernels in the interpreter on CPU tensors (scoped to the test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def run_gemm1(disp, hidden, w13, top_k, activation, b13=None, use_a_rows=False, config=None,
              w13_layout=W13Layout.GATE_THEN_UP):
    """The kernel on w13 (public layout; CHUNKED: packed here first) and the references on the public w13."""
    a1 = gathered(hidden, disp["sorted_slots"], top_k)
    kernel_w13 = pack_gate_up_rows(w13) if w13_layout is W13Layout.CHUNKED else w13
    kwargs = dict(activation=activation, b13=b13, config=config, w13_layout=w13_layout)
    poison = torch.full((disp["max_rows"], w13.shape[1] // 2), float("nan"), dtype=hidden.dtype,
                        device=hidden.device)
    if use_a_rows:
        a_rows = torch.where(disp["sorted_slots"] >= 0, disp["sorted_slots"] // top_k, -1).to(torch.int32)
        out = triton_grouped_gemm1(hidden, kernel_w13, disp["row_offsets"], disp["counts"], disp["tile_offsets"],
                                   a_rows=a_rows, out=poison, **kwargs)
    else:
        out = triton_grouped_gemm1(a1, kernel_w13, disp["row_offsets"], disp["counts"], disp["tile_offsets"],
                                   out=poison, **kwargs)
    b32 = b13.float() if b13 is not None else None
    ref = grouped_gemm1_reference(a1.float(), w13.float(), disp["row_offsets"], disp["counts"], activation, b32)
    same = grouped_gemm1_reference(a1, w13, disp["row_offsets"], disp["counts"], activation, b13)
    return out, ref, same


def run_gemm2(disp, a2, w2, row_scale=None, b2=None, config=None):
    poison = torch.full((disp["max_rows"], w2.shape[1]), float("nan"), dtype=a2.dtype, device=a2.device)
    out = triton_grouped_gemm2(a2, w2, disp["row_offsets"], disp["counts"], disp["tile_offsets"],
                               row_scale=row_scale, b2=b2, out=poison, config=config)
    b32 = b2.float() if b2 is not None else None
    ref = grouped_gemm2_reference(a2.float(), w2.float(), disp["row_offsets"], disp["counts"], row_scale, b32)
    same = grouped_gemm2_reference(a2, w2, disp["row_offsets"], disp["counts"], row_scale, b2)
    return out, ref, same


# ---------------------------------------------------------------------------------------------- CPU tier
SMALL = TritonGemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)
TALL = TritonGemmConfig(block_m=64, block_n=32, block_k=64, num_warps=4, num_stages=2, group_m=1)


@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemm1_activations_cpu(interpret, activation, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((activation.value, str(dtype))).encode()))
    num_experts, top_k, hidden_dim, inter = 6, 2, 64, 48  # I=48: N tail in a 32-wide tile
    hidden = torch.randn(33, hidden_dim, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5).to(dtype)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen).to(dtype)
    for num_tokens, config in ((0, SMALL), (1, SMALL), (7, TALL), (33, SMALL)):
        disp = make_dispatch(random_topk(num_tokens, num_experts, top_k, generator=gen), num_experts, align=16)
        out, ref, same = run_gemm1(disp, hidden[:num_tokens], w13, top_k, activation, b13=b13, config=config)
        check_close(out, ref, same, valid_mask(disp), floor_for(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemm1_gather_no_bias_cpu(interpret, dtype):
    """a_rows: A rows read from the token matrix; align 128 with 256-row tiles that run past the experts."""
    gen = torch.Generator().manual_seed(7)
    num_experts, top_k, hidden_dim, inter = 8, 2, 96, 32  # K=96: K tail in 64-deep steps
    hidden = torch.randn(33, hidden_dim, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5).to(dtype)
    tall = TritonGemmConfig(block_m=256, block_n=32, block_k=64, num_warps=8, num_stages=2, group_m=4)
    for num_tokens, config in ((1, SMALL), (33, tall), (33, SMALL)):
        disp = make_dispatch(random_topk(num_tokens, num_experts, top_k, generator=gen), num_experts)
        out, ref, same = run_gemm1(disp, hidden[:num_tokens], w13, top_k, Activation.SWIGLU, use_a_rows=True,
                                   config=config)
        mask = valid_mask(disp)
        check_close(out, ref, same, mask, floor_for(dtype))
        assert torch.isnan(out[~mask]).all(), "padding rows were written"


def test_gemm1_gather_from_slots_cpu(interpret):
    """a_rows = the dispatch's sorted slots with a_rows_per_source = top_k: the same bits as token indices."""
    gen = torch.Generator().manual_seed(11)
    num_experts, top_k, hidden_dim, inter = 8, 3, 64, 32
    hidden = torch.randn(21, hidden_dim, generator=gen).to(torch.float16)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5).to(torch.float16)
    disp = make_dispatch(random_topk(21, num_experts, top_k, generator=gen), num_experts, align=16)
    slots = disp["sorted_slots"]
    tokens = torch.where(slots >= 0, slots // top_k, -1).to(torch.int32)
    args = (w13, disp["row_offsets"], disp["counts"], disp["tile_offsets"])
    by_token = triton_grouped_gemm1(hidden, *args, a_rows=tokens, config=SMALL)
    by_slot = triton_grouped_gemm1(hidden, *args, a_rows=slots, a_rows_per_source=top_k, config=SMALL)
    mask = valid_mask(disp)
    assert torch.equal(by_slot[mask], by_token[mask])
    with pytest.raises(ValueError, match="a_rows_per_source"):
        triton_grouped_gemm1(hidden, *args, a_rows=slots, a_rows_per_source=0, config=SMALL)


def test_gemm1_gather_minus_one_loads_zeros_cpu(interpret):
    """A valid row whose a_rows entry is -1 reads zeros: act(b13) with a bias."""
    gen = torch.Generator().manual_seed(3)
    num_experts, top_k, hidden_dim, inter = 4, 1, 32, 32
    hidden = torch.randn(5, hidden_dim, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen)
    disp = make_dispatch(random_topk(5, num_experts, top_k, generator=gen), num_experts, align=16)
    a_rows = torch.where(disp["sorted_slots"] >= 0, disp["sorted_slots"] // top_k, -1).to(torch.int32)
    first = int(disp["row_offsets"][int(torch.nonzero(disp["counts"])[0])])
    a_rows[first] = -1
    out = triton_grouped_gemm1(hidden, w13, disp["row_offsets"], disp["counts"], disp["tile_offsets"],
                               Activation.SWIGLU, b13=b13, a_rows=a_rows, config=SMALL)
    a1 = torch.zeros(disp["max_rows"], hidden_dim)
    a1[a_rows >= 0] = hidden[a_rows[a_rows >= 0].long()]
    ref = grouped_gemm1_reference(a1, w13, disp["row_offsets"], disp["counts"], Activation.SWIGLU, b13)
    mask = valid_mask(disp)
    assert rel_err(out[mask], ref[mask]) < 2e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemm2_scale_bias_cpu(interpret, dtype):
    gen = torch.Generator().manual_seed(11)
    num_experts, top_k, inter, hidden_dim = 5, 2, 96, 80  # K tail and N tail
    w2 = (torch.randn(num_experts, hidden_dim, inter, generator=gen) / inter**0.5).to(dtype)
    b2 = torch.randn(num_experts, hidden_dim, generator=gen).to(dtype)
    for num_tokens, with_scale, with_bias, config in ((0, True, True, SMALL), (1, True, False, SMALL),
                                                      (7, False, True, TALL), (33, True, True, SMALL)):
        disp = make_dispatch(random_topk(num_tokens, num_experts, top_k, generator=gen), num_experts, align=16)
        a2 = torch.randn(disp["max_rows"], inter, generator=gen).to(dtype)
        scale = torch.rand(disp["max_rows"], generator=gen) if with_scale else None
        out, ref, same = run_gemm2(disp, a2, w2, scale, b2 if with_bias else None, config)
        mask = valid_mask(disp)
        check_close(out, ref, same, mask, floor_for(dtype))
        assert torch.isnan(out[~mask]).all(), "padding rows were written"


@pytest.mark.parametrize("skew", ["one", "half"])
def test_skewed_routing_cpu(interpret, skew):
    """All rows on one expert (many tiles of one expert) and zero-token experts, both GEMMs, fp16."""
    gen = torch.Generator().manual_seed(5)
    num_experts, top_k, hidden_dim, inter = 8, 1, 32, 64
    dtype = torch.float16
    hidden = torch.randn(40, hidden_dim, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden_dim, inter, generator=gen) / inter**0.5).to(dtype)
    disp = make_dispatch(random_topk(40, num_experts, top_k, skew=skew, generator=gen), num_experts, align=16)
    assert (disp["counts"] == 0).any()
    out1, ref1, same1 = run_gemm1(disp, hidden, w13, top_k, Activation.SWIGLU, config=SMALL)
    mask = valid_mask(disp)
    check_close(out1, ref1, same1, mask, floor_for(dtype))
    a2 = torch.where(mask[:, None], out1, torch.zeros((), dtype=dtype))
    scale = torch.rand(disp["max_rows"], generator=gen)
    out2, ref2, same2 = run_gemm2(disp, a2, w2, scale, config=SMALL)
    check_close(out2, ref2, same2, mask, floor_for(dtype))


def test_dynamic_tile_scheduler_cpu(interpret):
    """DYNAMIC: programs take tiles from a counter (a fresh one per launch); results match the twin and repeat
    bit for bit, over routings with empty experts and one busy expert."""
    gen = torch.Generator().manual_seed(21)
    num_experts, top_k, hidden_dim, inter = 6, 2, 32, 48
    dtype = torch.float16
    dyn = dataclasses.replace(SMALL, scheduler=TileScheduler.DYNAMIC)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden_dim, inter, generator=gen) / inter**0.5).to(dtype)
    for skew in (None, "one"):
        hidden = torch.randn(37, hidden_dim, generator=gen).to(dtype)
        disp = make_dispatch(random_topk(37, num_experts, top_k, skew=skew, generator=gen), num_experts, align=16)
        mask = valid_mask(disp)
        first = None
        for _ in range(2):
            out1, ref1, same1 = run_gemm1(disp, hidden, w13, top_k, Activation.SWIGLU, config=dyn)
            check_close(out1, ref1, same1, mask, floor_for(dtype))
            first = out1 if first is None else first
            assert torch.equal(out1[mask], first[mask])
        a2 = torch.where(mask[:, None], out1, torch.zeros((), dtype=dtype))
        out2, ref2, same2 = run_gemm2(disp, a2, w2, torch.rand(disp["max_rows"], generator=gen), config=dyn)
        check_close(out2, ref2, same2, mask, floor_for(dtype))


def test_default_config_cpu(interpret):
    """The heuristic's config runs (tiny problem) and the buckets pick the documented tiles."""
    gen = torch.Generator().manual_seed(2)
    num_experts, top_k, hidden_dim, inter = 4, 2, 32, 32
    hidden = torch.randn(3, hidden_dim, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5
    disp = make_dispatch(random_topk(3, num_experts, top_k, generator=gen), num_experts)
    out, ref, same = run_gemm1(disp, hidden, w13, top_k, Activation.GELU_GATED)
    check_close(out, ref, same, valid_mask(disp), floor_for(torch.float32))

    def pick(rows, stage=GemmStage.GEMM1, n=768, k=2048, e=128):
        return default_config(GroupedGemmProblem(stage, e, n, k, rows))

    assert pick(8).block_m == 16
    assert pick(32 * 8).block_m == 16  # T=32, k=8: 2 rows per active expert
    assert pick(32 * 128).block_m == 64  # 32 rows per expert: small bucket
    assert pick(64 * 128).block_m == 128  # 64 rows per expert: 128-row tiles read the weights half as often
    assert pick(4096 * 8).block_m == 128
    # prefill tiles: DYNAMIC up to 64 rows per active expert or with few experts, else STATIC; decode STATIC
    assert pick(64 * 128).scheduler is TileScheduler.DYNAMIC
    assert pick(4096 * 8).scheduler is TileScheduler.STATIC  # 256 rows on each of 128 experts
    assert pick(4096 * 2, e=8, n=14336, k=4096).scheduler is TileScheduler.DYNAMIC  # mixtral-like
    assert pick(8).scheduler is TileScheduler.STATIC
    for rows in (0, 1, 8, 512, 4096, 32768, 10**6):
        for stage in GemmStage:
            problem = GroupedGemmProblem(stage, 128, 768, 2048, rows)
            ok, reason = can_implement(default_config(problem), problem)
            assert ok, reason


def test_default_config_estimates_routed_rows_from_align(interpret, monkeypatch):
    """The default config's bucket comes from max_rows - E * (align - 1): the routed rows of the batch for the
    dispatch's align (a layer of align 16 or 256 gets the tiles of its true batch size)."""
    seen = []
    real = tg.default_config
    monkeypatch.setattr(tg, "default_config", lambda problem: seen.append(problem.routed_rows) or real(problem))
    tg._memoized_default_config.cache_clear()  # (launches memoize the default per problem)
    gen = torch.Generator().manual_seed(5)
    num_experts, top_k, hidden_dim, inter, num_tokens = 4, 2, 32, 16, 5
    hidden = torch.randn(num_tokens, hidden_dim, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5
    for align in (1, 16, 128, 256):
        disp = make_dispatch(random_topk(num_tokens, num_experts, top_k, generator=gen), num_experts, align=align)
        a1 = gathered(hidden, disp["sorted_slots"], top_k)
        triton_grouped_gemm1(a1, w13, disp["row_offsets"], disp["counts"], disp["tile_offsets"], align=align)
        assert seen[-1] == num_tokens * top_k, (align, seen[-1])
    with pytest.raises(ValueError, match="^align"):
        triton_grouped_gemm1(a1, w13, disp["row_offsets"], disp["counts"], disp["tile_offsets"], align=0)


def test_can_implement_and_argument_errors():
    problem = GroupedGemmProblem(GemmStage.GEMM1, 8, 256, 256, 64)
    assert can_implement(TritonGemmConfig(), problem) == (True, "")
    bad = {
        "block_m": TritonGemmConfig(block_m=32),
        "power of two": TritonGemmConfig(block_n=96),
        ">= 16": TritonGemmConfig(block_k=8),
        "shared memory": TritonGemmConfig(block_m=256, block_n=256, block_k=128, num_stages=6, num_warps=16),
        "registers": TritonGemmConfig(block_m=256, block_n=256, num_warps=4, num_stages=2, block_k=16),
    }
    for word, config in bad.items():
        ok, reason = can_implement(config, problem)
        assert not ok and word in reason, (word, reason)
    assert not can_implement(TritonGemmConfig(), GroupedGemmProblem(GemmStage.GEMM2, 8, 64, 64, 8, torch.int8))[0]

    disp = make_dispatch(random_topk(4, 4, 2), 4)
    a = torch.randn(disp["max_rows"], 32)
    w13 = torch.randn(4, 64, 32)
    args = (disp["row_offsets"], disp["counts"], disp["tile_offsets"])
    with pytest.raises(ValueError, match="w13"):
        triton_grouped_gemm1(a, w13.half(), *args)
    with pytest.raises(ValueError, match="a:"):
        triton_grouped_gemm1(a[:, :16], w13, *args)
    with pytest.raises(ValueError, match="counts"):
        triton_grouped_gemm1(a, w13, disp["row_offsets"], disp["counts"].long(), disp["tile_offsets"])
    with pytest.raises(ValueError, match="tile_offsets"):
        triton_grouped_gemm1(a, w13, *args, tile_heights=(16, 64))
    with pytest.raises(ValueError, match="activation"):
        triton_grouped_gemm1(a, w13, *args, activation="relu")
    with pytest.raises(ValueError, match="config"):
        triton_grouped_gemm1(a, w13, *args, config=TritonGemmConfig(block_m=32))
    with pytest.raises(ValueError, match="row_scale"):
        triton_grouped_gemm2(a, torch.randn(4, 16, 32), *args, row_scale=torch.rand(3))
    with pytest.raises(TypeError, match="a:"):
        triton_grouped_gemm2(a.numpy(), torch.randn(4, 16, 32), *args)
    # a caller's out may share no memory with an operand the kernel reads (it reads them while it stores)
    w2 = torch.randn(4, 16, 32)
    with pytest.raises(ValueError, match="^out: expected memory of its own, got one that overlaps a "):
        triton_grouped_gemm2(a, w2, *args, out=a[:, :16])
    storage = torch.randn(1024 + a.shape[0] * 16)  # w2's last half and out's first rows
    with pytest.raises(ValueError, match="overlaps w2"):
        triton_grouped_gemm2(a, storage[:2048].view(4, 16, 32), *args, out=storage[1024:].view(a.shape[0], 16))
    scale = torch.rand(a.shape[0] * 17 - 1)
    with pytest.raises(ValueError, match="overlaps row_scale"):
        triton_grouped_gemm2(a, w2, *args, row_scale=scale[: a.shape[0]], out=scale[a.shape[0] - 1:].view(a.shape[0], 16))
    with pytest.raises(ValueError, match="^out: expected rows of their own memory"):  # rows sharing memory
        triton_grouped_gemm2(a, w2, *args, out=torch.zeros(1, 16).expand(a.shape[0], 16))
    w13_odd = torch.randn(4, 24, 32)  # I = 12: no chunked order; the error names the layout, not a config
    for config in (None, TritonGemmConfig(block_m=16)):
        with pytest.raises(ValueError, match="^w13_layout chunked needs the intermediate size \\(12\\)"):
            triton_grouped_gemm1(a, w13_odd, *args, config=config, w13_layout=W13Layout.CHUNKED)


def test_default_config_keeps_tma_where_fewer_stages_fit():
    """default_config shrinks a TMA config to the device's shared memory before it falls back to pointer loads (which
    need as much): fp32 prefill on an H200's 227 KB and fp16 on a 99 KB part keep TMA; K not 16-byte aligned does not."""
    for dtype, smem in ((torch.float32, 232448), (torch.float16, 101376)):
        problem = GroupedGemmProblem(GemmStage.GEMM1, 8, 1024, 2048, 8 * 512, dtype, smem_per_block=smem)
        config = default_config(problem)
        assert config.tile_load is TileLoad.TMA and can_implement(config, problem)[0], (dtype, config)
    odd_k = GroupedGemmProblem(GemmStage.GEMM1, 8, 1024, 2052, 8 * 512, torch.float16)
    assert default_config(odd_k).tile_load is TileLoad.POINTER


# ---------------------------------------------------------------------------------------------- GPU tier
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def test_pack_gate_up_rows_layout():
    """CHUNKED order: 8 gate rows, the matching 8 up rows, ...; unpack inverts it; bad shapes name w13."""
    e, inter, h = 2, 24, 3
    w13 = torch.arange(e * 2 * inter * h, dtype=torch.float32).reshape(e, 2 * inter, h)
    packed = pack_gate_up_rows(w13)
    for chunk in range(inter // 8):
        assert torch.equal(packed[:, 16 * chunk:16 * chunk + 8], w13[:, 8 * chunk:8 * chunk + 8])
        assert torch.equal(packed[:, 16 * chunk + 8:16 * chunk + 16], w13[:, inter + 8 * chunk:inter + 8 * chunk + 8])
    assert torch.equal(unpack_gate_up_rows(packed), w13)
    bias = torch.randn(e, 2 * inter)
    assert torch.equal(pack_gate_up_rows(bias.unsqueeze(-1)).squeeze(-1), pack_gate_up_rows(bias))
    with pytest.raises(ValueError, match="w13: expected 2I a multiple of 16"):
        pack_gate_up_rows(torch.zeros(1, 24, 4))
    with pytest.raises(TypeError, match="w13"):
        pack_gate_up_rows(torch.zeros(4))


@pytest.mark.parametrize("activation", list(Activation))
def test_gated_activation_keeps_the_dtype_and_apply_activation_is_its_fp32_form(activation):
    """gated_activation computes in its inputs' dtype (the grouped-mm peer's bf16 ops); apply_activation is the same
    function on fp32 copies. Values past the gpt-oss clamp limits are included."""
    gate, up = (6 * torch.randn(2, 64, 96)).to(torch.bfloat16).unbind(0)
    exact = apply_activation(gate, up, activation)
    assert exact.dtype == torch.float32
    assert torch.equal(exact, gated_activation(gate.float(), up.float(), activation))
    low = gated_activation(gate, up, activation)
    assert low.dtype == torch.bfloat16
    err = float((low.float() - exact).norm() / exact.norm())
    assert 0 < err < 1e-2, err  # a few bf16 roundings, not another function
    assert torch.equal(gated_activation(gate, up, activation.value), low)  # a name is parsed, as everywhere
    with pytest.raises(ValueError, match="^activation: expected one of"):
        gated_activation(gate, up, "relu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemm1_chunked_w13_cpu(interpret, dtype):
    """GEMM1 on W13Layout.CHUNKED (the CuTe kernels' packed w13) with every activation and bias, pointer and TMA
    loads, 16- and 64-row tiles, an N tail (I=48 in 32-wide tiles: the last tile's packed rows wrap or read
    the next expert) and the fused gather; the result must match the public-layout reference."""
    gen = torch.Generator().manual_seed(41 + len(str(dtype)))
    num_experts, top_k, hidden_dim, inter = 5, 2, 96, 48
    hidden = torch.randn(21, hidden_dim, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5).to(dtype)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen).to(dtype)
    disp = make_dispatch(random_topk(21, num_experts, top_k, generator=gen), num_experts, align=16)
    mask = valid_mask(disp)
    cases = [(SMALL, False, Activation.SWIGLU, None), (TALL, True, Activation.GELU_GATED, b13),
             (TMA, False, Activation.SWIGLU_OAI, b13), (TMA16, True, Activation.SWIGLU, b13)]
    for config, use_a_rows, activation, bias in cases:
        out, ref, same = run_gemm1(disp, hidden, w13, top_k, activation, b13=bias, use_a_rows=use_a_rows,
                                   config=config, w13_layout=W13Layout.CHUNKED)
        check_close(out, ref, same, mask, floor_for(dtype))
        assert torch.isnan(out[~mask]).all(), "padding rows were written"
    problem = GroupedGemmProblem(GemmStage.GEMM1, 4, 44, 64, 8, dtype, w13_layout=W13Layout.CHUNKED)
    ok, reason = can_implement(SMALL, problem)
    assert not ok and "multiple of 8" in reason
    problem = GroupedGemmProblem(GemmStage.GEMM1, 4, 256, 64, 8, dtype, w13_layout=W13Layout.CHUNKED)
    wide = dataclasses.replace(TMA16, block_n=256)
    ok, reason = can_implement(wide, problem)
    assert not ok and "box limit" in reason
    assert can_implement(dataclasses.replace(wide, tile_load=TileLoad.POINTER), problem)[0]
    with pytest.raises(TypeError, match="w13_layout"):
        triton_grouped_gemm1(hidden, w13, disp["row_offsets"], disp["counts"], disp["tile_offsets"],
                             w13_layout="chunked")


def _gpu_weights(num_experts, hidden_dim, inter, dtype, gen, bias=False):
    w13 = (torch.randn(num_experts, 2 * inter, hidden_dim, device="cuda", generator=gen) / hidden_dim**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden_dim, inter, device="cuda", generator=gen) / inter**0.5).to(dtype)
    b13 = torch.randn(num_experts, 2 * inter, device="cuda", generator=gen).to(dtype) if bias else None
    b2 = torch.randn(num_experts, hidden_dim, device="cuda", generator=gen).to(dtype) if bias else None
    return w13, w2, b13, b2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("skew", ["uniform", "one", "half"])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 128, 4096, 65536])
def test_moe_gemms_gpu(num_tokens, skew):
    """Both GEMMs with the default configs (every bucket), bf16, random and skewed routings."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens * 3 + len(skew))
    num_experts, top_k, hidden_dim, inter = 16, 4, 512, 256
    dtype = torch.bfloat16
    w13, w2, _, _ = _gpu_weights(num_experts, hidden_dim, inter, dtype, gen)
    hidden = torch.randn(num_tokens, hidden_dim, device="cuda", generator=gen).to(dtype)
    disp = make_dispatch(random_topk(num_tokens, num_experts, top_k, "cuda", skew, gen), num_experts)
    mask = valid_mask(disp)
    for layout in W13Layout:
        for use_a_rows in (False, True):
            out1, ref1, same1 = run_gemm1(disp, hidden, w13, top_k, Activation.SWIGLU, use_a_rows=use_a_rows,
                                          w13_layout=layout)
            check_close(out1, ref1, same1, mask, floor_for(dtype))
    a2 = torch.where(mask[:, None], out1, torch.zeros((), dtype=dtype, device="cuda"))
    scale = torch.rand(disp["max_rows"], device="cuda", generator=gen)
    out2, ref2, same2 = run_gemm2(disp, a2, w2, scale)
    check_close(out2, ref2, same2, mask, floor_for(dtype))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_default_configs_of_other_dtypes_gpu(dtype):
    """fp16 and fp32 on the default configs of every bucket: fp32 prefill keeps TMA loads on the H200 since stop 55
    (default_config shrinks a TMA config before it falls back to pointer loads)."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    num_experts, top_k, hidden_dim, inter = 16, 4, 512, 256
    w13, w2, _, _ = _gpu_weights(num_experts, hidden_dim, inter, dtype, gen)
    for num_tokens in (1, 24, 4096):
        hidden = torch.randn(num_tokens, hidden_dim, device="cuda", generator=gen).to(dtype)
        disp = make_dispatch(random_topk(num_tokens, num_experts, top_k, "cuda", generator=gen), num_experts)
        mask = valid_mask(disp)
        out1, ref1, same1 = run_gemm1(disp, hidden, w13, top_k, Activation.SWIGLU, use_a_rows=True)
        check_close(out1, ref1, same1, mask, floor_for(dtype))
        a2 = torch.where(mask[:, None], out1, torch.zeros((), dtype=dtype, device="cuda"))
        out2, ref2, same2 = run_gemm2(disp, a2, w2, torch.rand(disp["max_rows"], device="cuda", generator=gen))
        check_close(out2, ref2, same2, mask, floor_for(dtype))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("activation", list(Activation))
def test_activations_bias_gpu(activation):
    gen = torch.Generator(device="cuda").manual_seed(17)
    num_experts, top_k, hidden_dim, inter = 8, 2, 384, 320  # N tail for 128-wide tiles
    dtype = torch.bfloat16
    w13, w2, b13, b2 = _gpu_weights(num_experts, hidden_dim, inter, dtype, gen, bias=True)
    for num_tokens in (3, 2000):
        hidden = torch.randn(num_tokens, hidden_dim, device="cuda", generator=gen).to(dtype)
        disp = make_dispatch(random_topk(num_tokens, num_experts, top_k, "cuda", generator=gen), num_experts)
        mask = valid_mask(disp)
        for layout in W13Layout:
            out1, ref1, same1 = run_gemm1(disp, hidden, w13, top_k, activation, b13=b13, use_a_rows=True,
                                          w13_layout=layout)
            check_close(out1, ref1, same1, mask, floor_for(dtype))
        a2 = torch.where(mask[:, None], out1, torch.zeros((), dtype=dtype, device="cuda"))
        out2, ref2, same2 = run_gemm2(disp, a2, w2, None, b2)
        check_close(out2, ref2, same2, mask, floor_for(dtype))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("load", [None, TileLoad.POINTER, TileLoad.TMA])
def test_cuda_graph_replay_with_new_routing_gpu(load):
    """Capture GEMM1 (gather) + GEMM2 once; replay after rewriting the metadata buffers with a new routing.
    load None: the default configs; else a 64-row config with that tile load."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    num_experts, top_k, hidden_dim, inter, num_tokens = 16, 4, 512, 256, 24  # decode bucket: TMA default
    dtype = torch.bfloat16
    w13, w2, _, _ = _gpu_weights(num_experts, hidden_dim, inter, dtype, gen)
    hidden = torch.randn(num_tokens, hidden_dim, device="cuda", generator=gen).to(dtype)
    first = make_dispatch(random_topk(num_tokens, num_experts, top_k, "cuda", generator=gen), num_experts)
    static = {k: v.clone() for k, v in first.items() if isinstance(v, torch.Tensor)}
    a_rows = torch.where(static["sorted_slots"] >= 0, static["sorted_slots"] // top_k, -1).to(torch.int32)
    scale = torch.rand(first["max_rows"], device="cuda", generator=gen)
    out1 = torch.empty(first["max_rows"], inter, dtype=dtype, device="cuda")
    out2 = torch.empty(first["max_rows"], hidden_dim, dtype=dtype, device="cuda")

    config = None if load is None else TritonGemmConfig(64, 64, 64, 4, 3, 4, 2, load)

    def forward():
        triton_grouped_gemm1(hidden, w13, static["row_offsets"], static["counts"], static["tile_offsets"],
                             a_rows=a_rows, out=out1, config=config)
        triton_grouped_gemm2(out1, w2, static["row_offsets"], static["counts"], static["tile_offsets"],
                             row_scale=scale, out=out2, config=config)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    for skew in ("uniform", "one", "half"):
        disp = make_dispatch(random_topk(num_tokens, num_experts, top_k, "cuda", skew, gen), num_experts)
        for key in static:
            static[key].copy_(disp[key])
        a_rows.copy_(torch.where(disp["sorted_slots"] >= 0, disp["sorted_slots"] // top_k, -1))
        out1.fill_(float("nan"))
        out2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        mask = valid_mask(disp)
        a1 = gathered(hidden, disp["sorted_slots"], top_k)
        ref1 = grouped_gemm1_reference(a1.float(), w13.float(), disp["row_offsets"], disp["counts"])
        same1 = grouped_gemm1_reference(a1, w13, disp["row_offsets"], disp["counts"])
        check_close(out1, ref1, same1, mask, floor_for(dtype))
        a2 = torch.where(mask[:, None], out1, torch.zeros((), dtype=dtype, device="cuda"))
        ref2 = grouped_gemm2_reference(a2.float(), w2.float(), disp["row_offsets"], disp["counts"], scale)
        same2 = grouped_gemm2_reference(a2, w2, disp["row_offsets"], disp["counts"], scale)
        check_close(out2, ref2, same2, mask, floor_for(dtype))


# TMA tile loads (tensor descriptors): CPU interpreter and, below in the GPU tier, on the device.
TMA = TritonGemmConfig(block_m=64, block_n=32, block_k=64, num_warps=4, num_stages=2, group_m=2, tile_load=TileLoad.TMA)
TMA16 = TritonGemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=1, tile_load=TileLoad.TMA)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tma_tile_load_cpu(interpret, dtype):
    """Weights (and A without a_rows) through tensor descriptors: K tail (96 in 64-deep steps), N tail, 64-row
    tiles that run past an expert's rows and past the end of a."""
    gen = torch.Generator().manual_seed(13)
    num_experts, top_k, hidden_dim, inter = 5, 2, 96, 48
    hidden = torch.randn(20, hidden_dim, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden_dim, inter, generator=gen) / inter**0.5).to(dtype)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen).to(dtype)
    disp = make_dispatch(random_topk(20, num_experts, top_k, generator=gen), num_experts, align=16)
    mask = valid_mask(disp)
    for config, use_a_rows in ((TMA, False), (TMA, True), (TMA16, False)):
        out1, ref1, same1 = run_gemm1(disp, hidden, w13, top_k, Activation.SWIGLU_OAI, b13=b13,
                                      use_a_rows=use_a_rows, config=config)
        check_close(out1, ref1, same1, mask, floor_for(dtype))
        assert torch.isnan(out1[~mask]).all(), "padding rows were written"
    a2 = torch.randn(disp["max_rows"], inter, generator=gen).to(dtype)
    out2, ref2, same2 = run_gemm2(disp, a2, w2, torch.rand(disp["max_rows"], generator=gen), config=TMA)
    check_close(out2, ref2, same2, mask, floor_for(dtype))
    with pytest.raises(ValueError, match="w13"):
        triton_grouped_gemm1(hidden, w13.transpose(1, 2).contiguous().transpose(1, 2), disp["row_offsets"],
                             disp["counts"], disp["tile_offsets"], config=TMA,
                             a_rows=torch.zeros(disp["max_rows"], dtype=torch.int32))
    problem = GroupedGemmProblem(GemmStage.GEMM1, 4, 64, 100, 8, torch.float16)
    ok, reason = can_implement(TMA, problem)
    assert not ok and "TMA" in reason


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [0, 1, 300, 5000])
def test_tma_tile_load_gpu(num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(29 + num_tokens)
    num_experts, top_k, hidden_dim, inter = 16, 4, 512, 320
    dtype = torch.bfloat16
    w13, w2, b13, b2 = _gpu_weights(num_experts, hidden_dim, inter, dtype, gen, bias=True)
    hidden = torch.randn(num_tokens, hidden_dim, device="cuda", generator=gen).to(dtype)
    disp = make_dispatch(random_topk(num_tokens, num_experts, top_k, "cuda", "half", gen), num_experts)
    mask = valid_mask(disp)
    for config in (TritonGemmConfig(128, 128, 64, 8, 3, 8, 1, TileLoad.TMA),
                   TritonGemmConfig(16, 64, 128, 4, 3, 1, 2, TileLoad.TMA)):
        for layout in W13Layout:
            for use_a_rows in (False, True):
                out1, ref1, same1 = run_gemm1(disp, hidden, w13, top_k, Activation.SWIGLU, b13=b13,
                                              use_a_rows=use_a_rows, config=config, w13_layout=layout)
                check_close(out1, ref1, same1, mask, floor_for(dtype))
        a2 = torch.where(mask[:, None], out1, torch.zeros((), dtype=dtype, device="cuda"))
        out2, ref2, same2 = run_gemm2(disp, a2, w2, torch.rand(disp["max_rows"], device="cuda", generator=gen), b2,
                                      config=config)
        check_close(out2, ref2, same2, mask, floor_for(dtype))


# ------------------------------------------------------------------------------------- compile-only (sm_90)
_COMPILE_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe2cta.grouped_gemm import triton_grouped_gemm as tg

consts, num_warps, num_stages = json.loads(sys.argv[1])
fn = tg._kernel()
names = fn.arg_names
int_ptrs = {"a_rows_ptr", "row_offsets_ptr", "counts_ptr", "tile_offsets_ptr", "counter_ptr"}
ptrs = int_ptrs | {"a_ptr", "w_ptr", "bias_ptr", "row_scale_ptr", "out_ptr"}
sig = {}
for n in names:
    if n in consts:
        sig[n] = "constexpr"
    elif n == "a_desc" and consts["A_TMA"]:
        sig[n] = f"tensordesc<bf16[{consts['BLOCK_M']}, {consts['BLOCK_K']}]>"
    elif n == "a_desc":
        sig[n], consts[n] = "constexpr", None
    elif n == "w_desc":
        box_rows = consts["BLOCK_N"] * (2 if consts["GATED"] and consts["W13_CHUNK"] else 1)
        sig[n] = f"tensordesc<bf16[{box_rows}, {consts['BLOCK_K']}]>"
    elif n in ptrs:
        sig[n] = "*i32" if n in int_ptrs else "*bf16"
    else:
        sig[n] = "i32"
# as a launch on real tensors specializes: unit strides are constants, other ints and pointers 16-divisible
for n in ("stride_ak", "stride_wk", "stride_on", "stride_bn"):
    sig[n], consts[n] = "constexpr", 1
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
         if t != "constexpr" and not t.startswith("tensordesc") and n != "num_programs"}
src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
options = {"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": True}
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
ptx = k.asm["ptx"]
import os, re, subprocess, tempfile
from triton.backends.nvidia.compiler import get_ptxas
with tempfile.TemporaryDirectory() as tmp:  # ptxas -v: registers and spill bytes of the kernel
    path = os.path.join(tmp, "k.ptx")
    open(path, "w").write(ptx)
    info = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".o"],
                          capture_output=True, text=True).stderr
spills = sum(int(x) for x in re.findall(r"(\\d+) bytes spill", info))
print(json.dumps({"shared": k.metadata.shared, "spills": spills, "wgmma": ptx.count("wgmma.mma_async"),
                  "atomics": "atom.global" in ptx,
                  "tma": "cp.async.bulk.tensor" in ptx, "gdc_wait": "griddepcontrol.wait" in ptx,
                  "gdc_launch": "griddepcontrol.launch_dependents" in ptx}))
"""


def _compile_sm90(config_consts: dict, num_warps: int, num_stages: int) -> dict:
    """Facts of the grouped GEMM kernel compiled for sm_90a here (no GPU: Triton's bundled ptxas), in a fresh
    process with the interpreter off (this one may have triton's language patched for the interpreter)."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    arg = json.dumps([config_consts, num_warps, num_stages])
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, arg], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block_m,dynamic,w13_chunk", [(16, False, 0), (128, False, 0), (128, True, 0),
                                                       (16, False, 8), (128, True, 8)])
def test_compiles_for_sm90_with_dependent_launch(block_m, dynamic, w13_chunk):
    """Compiled (not interpreted) for sm_90: griddepcontrol for the dependent launch; wgmma for 128-row tiles;
    global atomics only with the DYNAMIC tile scheduler; no spills with either w13 layout (chunked: one
    [128, 256] accumulator split into gate and up in registers)."""
    consts = dict(GATED=True, ACTIVATION=0, GATHER=True, ROWS_PER_SOURCE=8, HAS_BIAS=False, HAS_ROW_SCALE=False,
                  EVEN_K=True, DOT_PRECISION="tf32", BLOCK_E=128, A_TMA=False, W_TMA=True, BLOCK_M=block_m,
                  BLOCK_N=64 if block_m == 16 else 128, BLOCK_K=256 if block_m == 16 else 64, GROUP_M=1,
                  DEPENDENT_LAUNCH=2, DYNAMIC=dynamic, W13_CHUNK=w13_chunk)
    facts = _compile_sm90(consts, num_warps=4 if block_m == 16 else 8, num_stages=3)
    assert facts["atomics"] == dynamic
    assert facts["gdc_wait"] and facts["gdc_launch"]
    assert facts["tma"]  # TMA weight tiles
    assert facts["spills"] == 0
    if block_m == 128:
        assert facts["wgmma"] > 0


@pytest.mark.parametrize("layout", list(W13Layout))
def test_swiglu_oai_clamp_and_nan_cpu(interpret, layout):
    """gpt-oss's clamp (gate <= 7, |up| <= 7) where most gate / up values are past it (biases of scale 12), and a NaN
    in one token row giving NaN in exactly that token's rows for every activation (as the twin and torch.clamp do;
    Triton's default minimum / maximum would return the other operand)."""
    gen = torch.Generator().manual_seed(41)
    num_experts, top_k, hidden_dim, inter = 4, 2, 32, 32
    hidden = torch.randn(9, hidden_dim, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen) / hidden_dim**0.5
    b13 = torch.randn(num_experts, 2 * inter, generator=gen) * 12.0
    disp = make_dispatch(random_topk(9, num_experts, top_k, generator=gen), num_experts, align=16)
    mask = valid_mask(disp)
    assert (b13.abs() > 7).double().mean() > 0.5  # the clamp is exercised
    out, ref, same = run_gemm1(disp, hidden, w13, top_k, Activation.SWIGLU_OAI, b13=b13, config=SMALL,
                               w13_layout=layout)
    check_close(out, ref, same, mask, floor_for(torch.float32))
    hidden[4, 3] = float("nan")
    slots = disp["sorted_slots"].long()
    of_token4 = mask & (slots // top_k == 4)
    for activation in Activation:
        out, _, _ = run_gemm1(disp, hidden, w13, top_k, activation, b13=b13, config=SMALL, use_a_rows=True,
                              w13_layout=layout)
        assert torch.isnan(out[of_token4]).all() and torch.isfinite(out[mask & ~of_token4]).all(), activation


def test_argument_types_and_strides_are_checked_cpu(interpret):
    """Optional tensors of another type, a strided row_scale (read with stride 1), zero-sized weights and config
    fields that are not ints are refused with the argument's name."""
    gen = torch.Generator().manual_seed(43)
    num_experts, top_k, hidden_dim, inter = 4, 2, 32, 32
    hidden = torch.randn(5, hidden_dim, generator=gen).to(torch.float16)
    w13 = torch.randn(num_experts, 2 * inter, hidden_dim, generator=gen).to(torch.float16)
    w2 = torch.randn(num_experts, hidden_dim, inter, generator=gen).to(torch.float16)
    disp = make_dispatch(random_topk(5, num_experts, top_k, generator=gen), num_experts, align=16)
    a1 = gathered(hidden, disp["sorted_slots"], top_k)
    meta = (disp["row_offsets"], disp["counts"], disp["tile_offsets"])
    with pytest.raises(TypeError, match="^b13: expected a torch.Tensor or None, got list"):
        triton_grouped_gemm1(a1, w13, *meta, b13=[[0.0] * 64] * 4, config=SMALL)
    with pytest.raises(TypeError, match="^config: expected a TritonGemmConfig or None, got tuple"):
        triton_grouped_gemm1(a1, w13, *meta, config=(16, 32))
    with pytest.raises(ValueError, match="^w13: expected \\[E, N, K\\] with every size >= 1"):
        triton_grouped_gemm1(a1, w13[:, :0], *meta, config=SMALL)
    with pytest.raises(ValueError, match="^config: block_n: expected an int"):
        triton_grouped_gemm1(a1, w13, *meta, config=dataclasses.replace(SMALL, block_n=32.0))
    a2 = torch.randn(disp["max_rows"], inter, generator=gen).to(torch.float16)
    strided = torch.rand(2 * disp["max_rows"], generator=gen)[::2]
    with pytest.raises(ValueError, match="^row_scale: expected a contiguous tensor"):
        triton_grouped_gemm2(a2, w2, *meta, row_scale=strided, config=SMALL)


def test_default_config_takes_the_tile_heights_a_dispatch_accepts():
    """default_config tiles by a height that is a power of two >= 16, and fits a tall one (256 rows) by narrower N
    tiles or more warps; heights no tile can use are named (they gave a config: ... error before)."""
    for heights, rows in (((128, 256), 80 * 2), ((256,), 800 * 2), ((8, 64), 2), ((16, 256), 4096)):
        for stage, n, k in ((GemmStage.GEMM1, 512, 256), (GemmStage.GEMM2, 256, 256)):
            problem = GroupedGemmProblem(stage, 8, n, k, rows, torch.float16, heights)
            config = tg.default_config(problem)
            assert config.block_m in heights and can_implement(config, problem) == (True, ""), (heights, config)
    with pytest.raises(ValueError, match=r"^tile_heights: the Triton GEMMs tile by one of them, a power of two >= 16"):
        tg.default_config(GroupedGemmProblem(GemmStage.GEMM1, 8, 512, 256, 2, torch.float16, (24, 48)))
