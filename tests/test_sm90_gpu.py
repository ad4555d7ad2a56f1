"""GPU tier of the sm90 CuTe grouped GEMM: every check variant against the fp64 torch twin.

Runs on an sm_90 GPU with either the CuTe DSL (JIT) or a prebuilt bundle in $MOE2CTA_KERNEL_DIR, built with
`python serving_bench/hopper_gemm_bench.py build --out DIR` (it holds the kernels of these variants).
Routings: random, skewed, zero-token experts, all rows on one expert, and (for the kernels that take expert subsets)
half the experts' counts zeroed under the full layout. Output poisoned with NaN first.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
import tempfile
import zlib

import pytest
import torch

try:
    from moe2cta.grouped_gemm.cute_runtime import dsl_available, kernel_dir, tvm_ffi_available
    from moe2cta.serving_bench import hopper_gemm_bench as bench
except ImportError:  # bare checkout on the GPU host
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serving_bench"))
    import hopper_gemm_bench as bench  # type: ignore[no-redef]
    from grouped_gemm.cute_runtime import dsl_available, kernel_dir, tvm_ffi_available  # type: ignore[no-redef]


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs an sm_90 GPU, found {torch.cuda.get_device_name()}"
    directory = kernel_dir()
    has_bundle = directory is not None and directory.is_dir() and tvm_ffi_available()
    if not (dsl_available() or has_bundle):
        return "neither the CuTe DSL nor a kernel bundle ($MOE2CTA_KERNEL_DIR) is available"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

VARIANTS = bench.check_variants()


class _NoWatchdog:
    seconds = 0

    def arm(self, label, seconds=None):
        pass


@pytest.mark.parametrize("routing", ["random", "skewed", "zero_experts", "one_expert"])
@pytest.mark.parametrize("name,config,problem", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_matches_twin(name, config, problem, routing):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, routing)).encode()))
    result = bench.check_one(name, config, problem, routing, None, gen, _NoWatchdog())
    assert result["unwritten_rows"] == 0, result
    assert result["repeat_identical"], result
    assert result["err"] <= 2 * result["err_torch_bf16"] + 1e-3, result


# Every variant on an H20's 78 SMs; every eighth also on 7 (an odd count: PAIR clusters get 6 CTAs).
GRID_CASES = [(78,) + v for v in VARIANTS] + [(7,) + v for v in VARIANTS[::8]]


@pytest.mark.parametrize("sm_count,name,config,problem", GRID_CASES, ids=[f"{c[1]}-{c[0]}sms" for c in GRID_CASES])
def test_grid_follows_the_device_sm_count(sm_count, name, config, problem, monkeypatch):
    """The persistent grid is a launch argument (sm90_grouped_gemm.persistent_ctas): the kernels of one bundle on a
    Hopper part of fewer SMs (78: H20) spread the same units over fewer CTAs, every scheduler and unit kind, and give
    the twin's result."""
    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setitem(bench.s90._SM_COUNTS, (device.type, device.index), sm_count)
    assert bench.s90.persistent_ctas(device, config.cluster_m) == sm_count // config.cluster_m * config.cluster_m
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, sm_count)).encode()))
    result = bench.check_one(name, config, problem, "random", None, gen, _NoWatchdog())
    assert result["unwritten_rows"] == 0, result
    assert result["repeat_identical"], result
    assert result["err"] <= 2 * result["err_torch_bf16"] + 1e-3, result


SUBSET_VARIANTS = [v for v in VARIANTS if v[1].takes_expert_subsets]


@pytest.mark.parametrize("name,config,problem", SUBSET_VARIANTS, ids=[v[0] for v in SUBSET_VARIANTS])
def test_a_launch_on_a_subset_of_the_experts(name, config, problem):
    """One expert class's launch (sm90_grouped_gemm.expert_classes): half the experts given 0 rows by the counts while
    row_offsets keeps their rows. The other half's rows match the twin, and no row of the zeroed experts is written
    (a later class's launch writes them into the same output)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, "class_masked")).encode()))
    result = bench.check_one(name, config, problem, "class_masked", None, gen, _NoWatchdog())
    assert result["unwritten_rows"] == 0 and result["foreign_rows_written"] == 0, result
    assert result["repeat_identical"], result
    assert result["err"] <= 2 * result["err_torch_bf16"] + 1e-3, result


@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
def test_default_config_qwen3_shape(gemm):
    """config=None on a qwen3-30b-a3b layer (kernels from `python -m moe2cta.aot build --model qwen3-30b-a3b`)."""
    s90, G1 = bench.s90, bench.G1
    hidden, inter, experts, top_k, tokens = 2048, 768, 128, 8, 64
    gen = torch.Generator().manual_seed(5)
    counts = bench.make_counts("skewed", tokens, top_k, experts, gen)
    max_rows = tokens * top_k + experts * (bench.ALIGN - 1)
    ro = bench.padded_layout(counts, max_rows)
    mask = bench.valid_row_mask(ro, counts, max_rows)
    dev = torch.device("cuda")
    if gemm == "gemm1":
        a = torch.randn(max_rows, hidden, generator=gen).to(torch.bfloat16).to(dev)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16).to(dev)
        out = s90.sm90_grouped_gemm1(a, s90.prepack_w13(w13), ro.to(dev), counts.to(dev), bench.Activation.SWIGLU,
                                     out=torch.full((max_rows, inter), float("nan"), dtype=torch.bfloat16, device=dev))
        ref = bench.grouped_gemm1_reference(a.double(), w13.double(), ro, counts, bench.Activation.SWIGLU)
        same = bench.grouped_gemm1_reference(a.to(dev), w13.to(dev), ro, counts, bench.Activation.SWIGLU).cpu()
    else:
        a = torch.randn(max_rows, inter, generator=gen).to(torch.bfloat16).to(dev)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16).to(dev)
        scale = torch.rand(max_rows, generator=gen).to(dev)
        out = s90.sm90_grouped_gemm2(a, w2, ro.to(dev), counts.to(dev), row_scale=scale,
                                     out=torch.full((max_rows, hidden), float("nan"), dtype=torch.bfloat16, device=dev))
        ref = bench.grouped_gemm2_reference(a.double(), w2.double(), ro, counts, scale.double())
        same = bench.grouped_gemm2_reference(a.to(dev), w2.to(dev), ro, counts, scale.to(torch.bfloat16)).cpu()
    got, want, base = out.cpu()[mask].double(), ref.cpu()[mask].double(), same[mask].double()
    assert torch.isfinite(got).all()
    err = ((got - want).norm() / want.norm()).item()
    err_same = ((base - want).norm() / want.norm()).item()
    assert err <= 2 * err_same + 1e-3, (err, err_same)  # as check_one: 2x a bf16 torch run's error


def test_dynamic_launches_on_concurrent_streams():
    """The default (DYNAMIC) kernels on two streams at once: each stream has its own work counter, so
    both results match the twin (one shared counter would hand units of one launch to the other)."""
    s90 = bench.s90
    hidden, inter, experts, top_k, tokens = 2048, 768, 128, 8, 2048
    gen = torch.Generator().manual_seed(9)
    dev = torch.device("cuda")
    counts = bench.make_counts("random", tokens, top_k, experts, gen)
    max_rows = tokens * top_k + experts * (bench.ALIGN - 1)
    ro = bench.padded_layout(counts, max_rows)
    mask = bench.valid_row_mask(ro, counts, max_rows)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16).to(dev)
    inputs = [torch.randn(max_rows, inter, generator=gen).to(torch.bfloat16).to(dev) for _ in range(2)]
    outs = [torch.full((max_rows, hidden), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(2)]
    scale = torch.rand(max_rows, generator=gen).to(dev)
    ro_d, cn_d = ro.to(dev), counts.to(dev)
    assert s90.default_config(s90.Sm90Problem(bench.G2, hidden, inter, experts, torch.bfloat16, None, False, True)
                              ).scheduler is s90.Scheduler.DYNAMIC
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    for _ in range(5):  # several rounds, so that the two streams' launches overlap
        for a, out, stream in zip(inputs, outs, streams):
            with torch.cuda.stream(stream):
                s90.sm90_grouped_gemm2(a, w2, ro_d, cn_d, row_scale=scale, out=out)
    torch.cuda.synchronize()
    for a, out in zip(inputs, outs):
        ref = bench.grouped_gemm2_reference(a.double(), w2.double(), ro, counts, scale.double())
        same = bench.grouped_gemm2_reference(a, w2, ro_d, cn_d, scale.to(torch.bfloat16)).cpu()
        got, want, base = out.cpu()[mask].double(), ref.cpu()[mask].double(), same[mask].double()
        assert torch.isfinite(got).all()
        err, err_same = ((got - want).norm() / want.norm()).item(), ((base - want).norm() / want.norm()).item()
        assert err <= 2 * err_same + 1e-3, (err, err_same)


SIDES_VARIANTS = [v for v in VARIANTS if v[1].scheduler is bench.s90.Scheduler.DYNAMIC_SIDES]


@pytest.mark.parametrize("side_map", ["parity", "random", "ones", "measured"])
@pytest.mark.parametrize("routing", ["random", "one_expert", "zero_experts"])
@pytest.mark.parametrize("name,config,problem", SIDES_VARIANTS, ids=[v[0] for v in SIDES_VARIANTS])
def test_dynamic_sides_under_any_side_map(name, config, problem, routing, side_map):
    """DYNAMIC_SIDES writes every row once whatever side each SM is given (test_matches_twin runs the zero map):
    half the SMs on each side (parity, random), every SM on the second half first so that every unit of the first
    half is taken by stealing (ones), and this GPU's measured map ($MOE2CTA_SIDE_MAP, else l2_sides_probe run here)."""
    from moe2cta.grouped_gemm import l2_sides
    from moe2cta.serving_bench import l2_sides_probe

    if side_map == "measured":
        path = os.environ.get("MOE2CTA_SIDE_MAP")
        sides = l2_sides_probe.load_side_map(path) if path else _probed_side_map()
    else:
        sides = [1] * l2_sides_probe.MAP_IDS if side_map == "ones" else l2_sides_probe.builtin_side_map(side_map)
    l2_sides.set_side_map("cuda", sides)
    try:
        gen = torch.Generator().manual_seed(zlib.crc32(repr((name, routing, side_map)).encode()))
        result = bench.check_one(name, config, problem, routing, None, gen, _NoWatchdog())
    finally:
        l2_sides.set_side_map("cuda", [0])
    assert result["unwritten_rows"] == 0, result
    assert result["repeat_identical"], result
    assert result["err"] <= 2 * result["err_torch_bf16"] + 1e-3, result


@functools.cache
def _probed_side_map() -> list[int]:
    """This GPU's side map from l2_sides_probe (built with nvcc, run once per session) where $MOE2CTA_SIDE_MAP names
    none."""
    from moe2cta.serving_bench import l2_sides_probe

    if shutil.which("nvcc") is None:
        pytest.skip("no measured side map: $MOE2CTA_SIDE_MAP is unset and there is no nvcc to build l2_sides_probe")
    with tempfile.TemporaryDirectory() as tmp:
        probe = l2_sides_probe.run_probe(l2_sides_probe.build_probe(os.path.join(tmp, "l2_sides_probe")))
    return [int(v) for v in l2_sides_probe.sides_from_probe(probe)["side_of_sm"]]


def _max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("tokens", [8, 2048])
def test_programmatic_launch_chain_is_bit_equal(tokens):
    """The layer's chain on a qwen3-30b-a3b shape: gather -> GEMM1 -> GEMM2 -> combine (the Triton launches release
    their dependents at decode sizes, so GEMM1's CTAs can start under the gather), in a CUDA graph replayed 10 times,
    with both CuTe GEMMs as plain, programmatic, and programmatic-with-weight-prefetch launches: the same bits every
    replay (the waits order every read after the previous kernel's writes; the prefetch only warms L2), and those bits
    within twice a bf16 torch run's error of the fp64 reference."""
    from moe2cta.router import api as router

    s90 = bench.s90
    hidden_size, inter, experts, top_k = 2048, 768, 128, 8
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(tokens)
    hidden = torch.randn(tokens, hidden_size, generator=gen, device=dev).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=gen, device=dev).argsort(dim=1)[:, :top_k].to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen, device=dev)
    w13 = (torch.randn(experts, 2 * inter, hidden_size, generator=gen, device=dev) / hidden_size**0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden_size, inter, generator=gen, device=dev) / inter**0.5).to(torch.bfloat16)
    packed = s90.prepack_w13(w13)
    disp = router.dispatch(ids, experts)
    rows = tokens * top_k / experts
    p1 = s90.Sm90Problem(bench.G1, 2 * inter, hidden_size, experts, torch.bfloat16, bench.Activation.SWIGLU)
    p2 = s90.Sm90Problem(bench.G2, hidden_size, inter, experts, torch.bfloat16, None, False, True)
    row_scale = torch.empty(disp.sorted_slots.shape[0], dtype=torch.float32, device=dev)

    def chain(launch):
        cfg1 = dataclasses.replace(s90.default_config(p1, rows_per_expert=rows), dependent_launch=launch)
        cfg2 = dataclasses.replace(s90.default_config(p2, rows_per_expert=rows), dependent_launch=launch)
        a1 = router.gather(hidden, disp, top_k, slot_weights=weights, row_weights_out=row_scale)
        a2 = s90.sm90_grouped_gemm1(a1, packed, disp.row_offsets, disp.counts, bench.Activation.SWIGLU, config=cfg1)
        y = s90.sm90_grouped_gemm2(a2, w2, disp.row_offsets, disp.counts, row_scale=row_scale, config=cfg2)
        return router.combine(y, disp, None, tokens, top_k, out_dtype=torch.bfloat16)

    want = chain(s90.DependentLaunch.STREAM_ORDER).clone()
    from moe2cta.reference import moe_reference

    exact = moe_reference(hidden, w13, w2, weights, ids, dtype=torch.float64)
    same_dtype = moe_reference(hidden, w13, w2, weights, ids, dtype=torch.bfloat16)
    assert _max_rel_err(want, exact) <= 2 * _max_rel_err(same_dtype, exact) + 1e-3
    for launch in s90.DependentLaunch:
        assert torch.equal(chain(launch), want), launch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(launch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(launch)
        for _ in range(10):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), launch


def test_wrapper_arguments_are_checked_before_any_launch():
    """The public wrappers name a wrong `out`, an operand on another device, a bias or row scale of the wrong kind, a
    zero-sized weight and an a_rows / config mismatch, before a kernel is fetched or launched (the bundle's entry check
    named the kernel's own argument, after the load); a 0-row launch returns at once."""
    s90 = bench.s90
    dev = torch.device("cuda")
    experts, hidden, inter = 4, 256, 128
    a = torch.randn(512, hidden, device=dev).to(torch.bfloat16)
    w13 = s90.prepack_w13(torch.randn(experts, 2 * inter, hidden, device=dev).to(torch.bfloat16))
    w2 = torch.randn(experts, hidden, inter, device=dev).to(torch.bfloat16)
    ro = torch.arange(0, 640, 128, dtype=torch.int32, device=dev)
    counts = torch.full((experts,), 100, dtype=torch.int32, device=dev)
    bad_outs = (torch.empty(512, 7, dtype=torch.bfloat16, device=dev), torch.empty(512, inter, device=dev),
                torch.empty(512, inter, dtype=torch.bfloat16), torch.empty(inter, 512, dtype=torch.bfloat16, device=dev).t())
    for out in bad_outs:
        with pytest.raises(TypeError, match="^out: expected a contiguous"):
            s90.sm90_grouped_gemm1(a, w13, ro, counts, out=out)
    for name, kwargs in (("packed_w13", dict(packed_w13=w13.cpu())), ("row_offsets", dict(row_offsets=ro.cpu())),
                         ("counts", dict(counts=counts.cpu()))):
        args = dict(a=a, packed_w13=w13, row_offsets=ro, counts=counts) | kwargs
        with pytest.raises(ValueError, match=f"^{name}: expected device"):
            s90.sm90_grouped_gemm1(**args)
    with pytest.raises(ValueError, match="^b13: expected device"):
        s90.sm90_grouped_gemm1(a, w13, ro, counts, b13=torch.zeros(experts, 2 * inter))
    with pytest.raises(TypeError, match="^row_scale: expected a floating-point tensor"):
        s90.sm90_grouped_gemm2(a[:, :inter].contiguous(), w2, ro, counts, row_scale=torch.ones(512, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="^packed_w13: expected \\[E, N, K\\] with every size >= 1"):
        s90.sm90_grouped_gemm1(a, w13[:, :0], ro, counts)
    token_rows = s90.token_rows_config(s90.Sm90Problem(bench.G1, 2 * inter, hidden, experts, torch.bfloat16,
                                                       bench.Activation.SWIGLU))
    with pytest.raises(ValueError, match="^a_rows: a_source TOKEN_ROWS takes a_rows"):
        s90.sm90_grouped_gemm1(a, w13, ro, counts, config=token_rows, kernel_directory="/nonexistent-bundle")
    with pytest.raises(ValueError, match="^rows_per_expert"):
        s90.sm90_grouped_gemm1(a[:3], w13, ro, counts, a_rows=torch.zeros(512, dtype=torch.int32, device=dev),
                               rows_per_expert=float("nan"))
    regular = s90.Sm90GemmConfig()  # 128-row m-blocks: a dispatch padded to 64 rows would be multiplied wrongly
    for align in (64, 96, True, 0):
        with pytest.raises(ValueError, match="^align: expected the dispatch's align, a multiple of the 128 rows"):
            s90.sm90_grouped_gemm1(a, w13, ro, counts, config=regular, align=align)
    empty = s90.sm90_grouped_gemm2(torch.empty(0, inter, dtype=torch.bfloat16, device=dev), w2, ro, counts)
    assert empty.shape == (0, hidden)
