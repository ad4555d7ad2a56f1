"""sm_100 GPU tier of the Blackwell grouped GEMM (same checks as the Hopper GPU tier).

Runs only on an sm_100 GPU (B200 / GB200) with nvidia-cutlass-dsl; anywhere else every test skips with the
reason. Checks against fp32 references (grouped_gemm/reference.py) on fresh random data, with the tolerance
set to 2x the error of the same computation done by torch in the activation dtype, plus a floor of 1e-3 of the
largest exact value. Outputs start as NaN, so a row the kernel does not write fails. Routings: uniform, skewed (one
hot expert) and with empty experts, made on purpose; small problems (every CTA one tile) and problems of ~6 tiles
per SM (the CLC loop, both TMEM accumulator slots and the pipelines' phases carried across tiles).
"""
import pytest
import torch

from moe2cta.grouped_gemm import Activation, grouped_gemm1_reference, grouped_gemm2_reference
from moe2cta.grouped_gemm.budget import WorkUnit
from moe2cta.grouped_gemm.cute_runtime import dsl_available


def _sm100_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        return f"needs an sm_100 GPU (B200/GB200); this GPU is sm_{major}{minor}"
    if not dsl_available():
        return "needs nvidia-cutlass-dsl"
    return None


REASON = _sm100_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.sm100, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

ALIGN = 128


def _layout(counts, align=ALIGN):
    """row_offsets (padded layout of docs/design.md) and max_rows for the given per-expert counts."""
    padded = [(c + align - 1) // align * align for c in counts]
    offsets = [0]
    for p in padded:
        offsets.append(offsets[-1] + p)
    num_experts = len(counts)
    max_rows = sum(counts) + num_experts * (align - 1)
    return (torch.tensor(offsets, dtype=torch.int32, device="cuda"),
            torch.tensor(counts, dtype=torch.int32, device="cuda"), max(max_rows, offsets[-1]))


def _routing(kind, num_experts, total, gen):
    if kind == "uniform":
        ids = torch.randint(0, num_experts, (total,), generator=gen)
        return torch.bincount(ids, minlength=num_experts).tolist()
    if kind == "skewed":  # one expert takes most rows, some experts are empty
        counts = [0] * num_experts
        counts[1] = total * 3 // 4
        for i in range(total - counts[1]):
            counts[(3 + 2 * i) % num_experts] += 1
        return counts
    raise ValueError(kind)


def _valid_rows(row_offsets, counts):
    rows = []
    for s, c in zip(row_offsets[:-1].tolist(), counts.tolist()):
        rows.extend(range(s, s + c))
    return torch.tensor(rows, dtype=torch.long, device="cuda")


def _tolerance(exact, same_dtype):
    return 2.0 * (same_dtype.float() - exact).abs().max().item() + 1e-3 * exact.abs().max().item()


def _nan_out(rows, cols):
    return torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device="cuda")


def _check(out, exact, same, row_offsets, counts):
    rows = _valid_rows(row_offsets, counts)
    got = out[rows].float()
    assert torch.isfinite(got).all(), "a valid row was not written (or is not finite)"
    err = (got - exact[rows]).abs().max().item()
    assert err <= _tolerance(exact[rows], same[rows]), err


def _same_dtype_gemm1(a, w13, row_offsets, counts, activation, b13):
    """torch in the activation dtype (bf16 matmul), the error yardstick."""
    from moe2cta.grouped_gemm.epilogue import apply_activation

    out = torch.zeros(a.shape[0], w13.shape[1] // 2, dtype=a.dtype, device=a.device)
    inter = w13.shape[1] // 2
    for e, (s, c) in enumerate(zip(row_offsets[:-1].tolist(), counts.tolist())):
        if c:
            h = a[s:s + c] @ w13[e].t()
            if b13 is not None:
                h = h + b13[e]
            out[s:s + c] = apply_activation(h[:, :inter].to(a.dtype), h[:, inter:].to(a.dtype), activation).to(a.dtype)
    return out


def _same_dtype_gemm2(a, w2, row_offsets, counts, row_scale, b2):
    out = torch.zeros(a.shape[0], w2.shape[1], dtype=a.dtype, device=a.device)
    for e, (s, c) in enumerate(zip(row_offsets[:-1].tolist(), counts.tolist())):
        if c:
            y = a[s:s + c] @ w2[e].t()
            if b2 is not None:
                y = y + b2[e]
            if row_scale is not None:
                y = y * row_scale[s:s + c].to(a.dtype).unsqueeze(1)
            out[s:s + c] = y
    return out


@pytest.mark.parametrize("unit, threshold", [(WorkUnit.PAIR, 0), (WorkUnit.SINGLE, 0), (WorkUnit.PAIR, 129)])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("activation", list(Activation))
def test_gemm1_matches_reference(unit, threshold, routing, activation):
    from moe2cta.grouped_gemm.sm100_grouped_gemm import Sm100GemmConfig, sm100_grouped_gemm1
    from moe2cta.grouped_gemm.sm90_grouped_gemm import prepack_w13

    gen = torch.Generator().manual_seed(7)
    num_experts, hidden, inter = 8, 512, 384
    counts_list = _routing(routing, num_experts, 1500, gen)
    row_offsets, counts, max_rows = _layout(counts_list)
    a = torch.randn(max_rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to("cuda", torch.bfloat16)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen).to("cuda", torch.bfloat16)
    config = Sm100GemmConfig(unit=unit, tile_n=256, pair_threshold=threshold)
    out = sm100_grouped_gemm1(a, prepack_w13(w13), row_offsets, counts, activation, b13=b13,
                              out=_nan_out(max_rows, inter), config=config)
    torch.cuda.synchronize()
    exact = grouped_gemm1_reference(a.float(), w13.float(), row_offsets, counts, activation, b13.float())
    _check(out, exact, _same_dtype_gemm1(a, w13, row_offsets, counts, activation, b13), row_offsets, counts)


@pytest.mark.parametrize("unit", [WorkUnit.PAIR, WorkUnit.SINGLE])
@pytest.mark.parametrize("bias, row_scale", [(False, False), (True, True), (False, True)])
def test_gemm2_matches_reference(unit, bias, row_scale):
    from moe2cta.grouped_gemm.sm100_grouped_gemm import Sm100GemmConfig, sm100_grouped_gemm2

    gen = torch.Generator().manual_seed(11)
    num_experts, hidden, inter = 6, 768, 512
    row_offsets, counts, max_rows = _layout(_routing("skewed", num_experts, 900, gen))
    a = torch.randn(max_rows, inter, generator=gen).to("cuda", torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to("cuda", torch.bfloat16)
    b2 = torch.randn(num_experts, hidden, generator=gen).to("cuda", torch.bfloat16) if bias else None
    scale = torch.rand(max_rows, generator=gen).to("cuda") if row_scale else None
    config = Sm100GemmConfig(unit=unit, tile_n=256)
    out = sm100_grouped_gemm2(a, w2, row_offsets, counts, row_scale=scale, b2=b2, out=_nan_out(max_rows, hidden),
                              config=config)
    torch.cuda.synchronize()
    exact = grouped_gemm2_reference(a.float(), w2.float(), row_offsets, counts, scale,
                                    b2.float() if bias else None)
    _check(out, exact, _same_dtype_gemm2(a, w2, row_offsets, counts, scale, b2), row_offsets, counts)


@pytest.mark.parametrize("unit", [WorkUnit.PAIR, WorkUnit.SINGLE])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("stage", ["gemm1", "gemm2"])
def test_many_tiles_per_cta_match_reference(unit, routing, stage):
    """60000 rows over 8 experts: 3-10 work units per SM, so each CTA takes further units by CLC,
    alternates its two TMEM accumulator slots and carries its pipelines' phases across tiles (the small tests
    give every CTA one tile)."""
    from moe2cta.grouped_gemm.sm100_grouped_gemm import Sm100GemmConfig, sm100_grouped_gemm1, sm100_grouped_gemm2
    from moe2cta.grouped_gemm.sm90_grouped_gemm import prepack_w13

    gen = torch.Generator().manual_seed(17)
    num_experts, hidden, inter = 8, 512, 384
    row_offsets, counts, max_rows = _layout(_routing(routing, num_experts, 60000, gen))
    config = Sm100GemmConfig(unit=unit, tile_n=256, accumulator_slots=2)
    n_tiles = -(-(2 * inter if stage == "gemm1" else hidden) // 256)
    units = (max_rows // (256 if unit is WorkUnit.PAIR else 128)) * n_tiles
    assert units >= 3 * torch.cuda.get_device_properties(0).multi_processor_count // (2 if unit is WorkUnit.PAIR else 1)
    if stage == "gemm1":
        a = torch.randn(max_rows, hidden, generator=gen).to("cuda", torch.bfloat16)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to("cuda", torch.bfloat16)
        out = sm100_grouped_gemm1(a, prepack_w13(w13), row_offsets, counts, Activation.SWIGLU,
                                  out=_nan_out(max_rows, inter), config=config)
        torch.cuda.synchronize()
        exact = grouped_gemm1_reference(a.float(), w13.float(), row_offsets, counts, Activation.SWIGLU)
        same = _same_dtype_gemm1(a, w13, row_offsets, counts, Activation.SWIGLU, None)
    else:
        a = torch.randn(max_rows, inter, generator=gen).to("cuda", torch.bfloat16)
        w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to("cuda", torch.bfloat16)
        scale = torch.rand(max_rows, generator=gen).to("cuda")
        out = sm100_grouped_gemm2(a, w2, row_offsets, counts, row_scale=scale, out=_nan_out(max_rows, hidden),
                                  config=config)
        torch.cuda.synchronize()
        exact = grouped_gemm2_reference(a.float(), w2.float(), row_offsets, counts, scale)
        same = _same_dtype_gemm2(a, w2, row_offsets, counts, scale, None)
    _check(out, exact, same, row_offsets, counts)
    again = (sm100_grouped_gemm1(a, prepack_w13(w13), row_offsets, counts, Activation.SWIGLU,
                                 out=_nan_out(max_rows, inter), config=config) if stage == "gemm1" else
             sm100_grouped_gemm2(a, w2, row_offsets, counts, row_scale=scale, out=_nan_out(max_rows, hidden),
                                 config=config))
    rows = _valid_rows(row_offsets, counts)
    assert torch.equal(again[rows], out[rows]), "a second launch gave other bits (a race)"


def test_padding_rows_of_other_experts_untouched():
    """A PAIR tile that runs past its expert's padded rows must not write the next expert's rows."""
    from moe2cta.grouped_gemm.sm100_grouped_gemm import Sm100GemmConfig, sm100_grouped_gemm2

    gen = torch.Generator().manual_seed(3)
    counts_list = [100, 0, 300, 5]  # padded 128, 0, 384, 128: pair tiles straddle expert boundaries
    row_offsets, counts, max_rows = _layout(counts_list)
    a = torch.randn(max_rows, 256, generator=gen).to("cuda", torch.bfloat16)
    w2 = torch.randn(4, 256, 256, generator=gen).to("cuda", torch.bfloat16)
    sentinel = torch.full((max_rows, 256), 7.0, dtype=torch.bfloat16, device="cuda")
    out = sm100_grouped_gemm2(a, w2, row_offsets, counts, out=sentinel.clone(),
                              config=Sm100GemmConfig(unit=WorkUnit.PAIR, tile_n=256))
    torch.cuda.synchronize()
    beyond = row_offsets[-1].item()
    assert torch.equal(out[beyond:], sentinel[beyond:])
    exact = grouped_gemm2_reference(a.float(), w2.float(), row_offsets, counts)
    rows = _valid_rows(row_offsets, counts)
    assert (out[rows].float() - exact[rows]).abs().max().item() < 0.5


def test_bad_arguments_raise():
    from moe2cta.grouped_gemm.sm100_grouped_gemm import sm100_grouped_gemm2

    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor([0, 128, 256], dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="counts"):
        sm100_grouped_gemm2(a, w2, offsets, torch.tensor([1, 2], device="cuda"))
    with pytest.raises(TypeError, match="w2"):
        sm100_grouped_gemm2(a, w2.float(), offsets, torch.tensor([1, 2], dtype=torch.int32, device="cuda"))
