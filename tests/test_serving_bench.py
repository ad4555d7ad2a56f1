"""CPU tests of the serving benchmark harness (moe2cta.serving_bench); the GPU timing path is marked gpu."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time

import numpy as np
import pytest
import torch

from moe2cta.grouped_gemm import Activation
from moe2cta.presets import PRESETS, custom_preset, get_preset
from moe2cta.router import RoutingConfig, Scoring
from moe2cta.serving_bench import backends as backends_mod
from moe2cta.serving_bench import runner
from moe2cta.serving_bench.backends import BACKENDS, BackendFamily, BackendSpec, make_expert_weights
from moe2cta.serving_bench.correctness import CheckStatus, check_output, make_reference, moe_rows
from moe2cta.serving_bench.distributions import (
    BenchRouter,
    DistributionKind,
    RoutingDistribution,
    make_correction_bias,
    make_router_logits,
    summarize_load,
)
from moe2cta.serving_bench.floors import DEFAULT_CEILINGS, TARGETS, Ceilings, CeilingSource, Phase, moe_floor, phase_of
from moe2cta.serving_bench.routing_twin import route_twin
from moe2cta.serving_bench.timing import GraphCapture, TimingConfig, TimingMode, rotation_count, time_callable
from moe2cta.serving_bench.trace import (
    BUCKETS,
    TraceConfig,
    bucket_tokens,
    generate_requests,
    schedule_steps,
    step_latencies,
    trace_stats,
)

TINY = "64,32,8,2"
FAST_TIMING = TimingConfig(warmup_calls=1, min_samples=3, max_samples=5, target_seconds=0.005, max_rotation=2)


# --- floors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, tokens, hit, floor_us",
    [  # rows of shared/bench/peers-h200-2026-11-29.md
        ("mixtral-8x7b", 1, 2, 166.2),
        ("mixtral-8x7b", 32768, 8, 29153.7),
        ("qwen3-30b-a3b", 2048, 128, 288.9),
        ("qwen3-30b-a3b", 8192, 128, 780.9),
        ("deepseek-v3", 128, 253, 5256.6),
        ("gpt-oss-120b", 1, 4, 47.0),
        ("gpt-oss-120b", 512, 128, 1503.8),
    ],
)
def test_floor_matches_peers_file(model, tokens, hit, floor_us):
    preset = get_preset(model)
    floor = moe_floor(preset, tokens, hit, DEFAULT_CEILINGS)
    if preset.has_bias:  # the peers file leaves the (small) bias bytes out; we count them
        floor_us += hit * (2 * preset.intermediate + preset.hidden) * 2 / DEFAULT_CEILINGS.bandwidth * 1e6
    assert floor.us == pytest.approx(floor_us, abs=0.06)


def test_custom_preset_spec():
    """'H,I,E,k' is a SwiGLU layer; a fifth field names the activation and a sixth, 'bias', adds biases."""
    plain = custom_preset("256,128,16,4")
    assert (plain.name, plain.activation, plain.has_bias, plain.top_k) == ("custom-256-128-16-4", Activation.SWIGLU,
                                                                          False, 4)
    oai = custom_preset("256,128,16,4,swiglu_oai,bias")
    assert (oai.name, oai.activation, oai.has_bias) == ("custom-256-128-16-4-swiglu_oai-bias", Activation.SWIGLU_OAI, True)
    assert custom_preset("256,128,16,4,gelu_gated").activation is Activation.GELU_GATED
    for bad, fragment in (("256,128,16", "four integers"), ("256,128,16,4,relu", "activation 'relu'"),
                          ("256,128,16,4,swiglu,biases", "ACTIVATION"), ("256,128,4,8", "1 <= k <= E")):
        with pytest.raises(ValueError, match=fragment):
            custom_preset(bad)


def test_floor_arithmetic_and_bound():
    p = custom_preset("1024,512,16,4")
    c = Ceilings(1e12, 100e12, CeilingSource.USER)
    f = moe_floor(p, 10, 3, c)
    assert f.weight_bytes == 3 * 3 * 1024 * 512 * 2
    assert f.activation_bytes == 2 * 10 * 1024 * 2
    assert f.flops == 2 * 10 * 4 * 3 * 1024 * 512
    assert f.memory_s == pytest.approx((f.weight_bytes + f.activation_bytes) / 1e12)
    assert f.bound == "memory" and f.seconds == f.memory_s
    big = moe_floor(p, 1 << 20, 16, c)
    assert big.bound == "compute" and big.seconds == pytest.approx(big.flops / 100e12)
    with pytest.raises(ValueError, match="experts_hit"):
        moe_floor(p, 1, 17, c)
    with pytest.raises(ValueError, match="ceilings"):
        Ceilings(0, 1, CeilingSource.USER)


def test_targets_by_phase():
    assert phase_of(512) is Phase.DECODE and phase_of(513) is Phase.MIDDLE and phase_of(2048) is Phase.PREFILL
    assert TARGETS.for_tokens(1) == 1.10 and TARGETS.for_tokens(32768) == 1.25 and TARGETS.for_tokens(1024) == 1.35


# --- routing twin and distributions ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_route_twin_matches_project_router(name):
    from moe2cta.router.reference import route_reference

    preset = PRESETS[name]
    logits = torch.randn(64, preset.num_experts, generator=torch.Generator().manual_seed(3))
    bias = make_correction_bias(preset.num_experts, seed=1, device="cpu") if preset.routing.scoring is Scoring.SIGMOID_GROUPED else None
    ours = route_twin(logits, preset.routing, bias)
    weights, ids = route_reference(logits, preset.routing, bias)
    assert torch.equal(ours.topk_ids, ids.to(torch.int32))
    torch.testing.assert_close(ours.topk_weights, weights.float(), rtol=1e-5, atol=1e-6)
    assert bool((ours.margin >= 0).all())


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b"])
@pytest.mark.parametrize("spec", ["balanced", "zipf:1.5", "dirichlet:0.2", "hot"])
def test_constructed_distributions_route_as_intended(name, spec):
    preset = PRESETS[name]
    dist = RoutingDistribution.parse(spec)
    e, k = preset.num_experts, preset.top_k
    bias = make_correction_bias(e, seed=2, device="cpu") if preset.routing.scoring is Scoring.SIGMOID_GROUPED else None
    logits = make_router_logits(dist, 256, e, preset.routing, seed=5, device="cpu")
    routed = route_twin(logits, preset.routing, bias)
    chosen = logits.topk(k, dim=1).indices.sort(dim=1).values  # the logits the generator raised
    assert torch.equal(routed.topk_ids.long().sort(dim=1).values, chosen)
    assert float(routed.margin.min()) > 1e-3  # no ambiguous rows in constructed distributions
    counts = torch.bincount(routed.topk_ids.reshape(-1).long(), minlength=e)
    if dist.kind is DistributionKind.BALANCED:
        assert int(counts.max() - counts.min()) <= 1
    if dist.kind is DistributionKind.HOT:
        assert int(counts.max()) == 256  # one expert in every token
    if dist.kind in (DistributionKind.ZIPF, DistributionKind.DIRICHLET):
        uniform = make_router_logits(RoutingDistribution.parse("uniform"), 256, e, preset.routing, seed=5, device="cpu")
        flat = torch.bincount(route_twin(uniform, preset.routing, bias).topk_ids.reshape(-1).long(), minlength=e)
        assert int(counts.max()) > int(flat.max())
    if preset.routing.num_expert_group is not None:
        groups = (routed.topk_ids.long() // (e // preset.routing.num_expert_group)).tolist()
        assert max(len(set(g)) for g in groups) <= preset.routing.topk_group


def test_distribution_parse_labels_and_errors():
    assert RoutingDistribution.parse("zipf").param == 1.2
    assert RoutingDistribution.parse("dirichlet:0.1").label == "dirichlet(alpha=0.1)"
    assert RoutingDistribution.parse("HOT").label == "hot"
    for d in DistributionKind:
        assert RoutingDistribution(d).describe()
    with pytest.raises(ValueError, match="routing"):
        RoutingDistribution.parse("lognormal")
    with pytest.raises(ValueError, match="param"):
        RoutingDistribution.parse("zipf:-1")
    with pytest.raises(ValueError, match="param"):
        RoutingDistribution(DistributionKind.UNIFORM, 2.0)
    a = make_router_logits(RoutingDistribution.parse("zipf"), 8, 16, RoutingConfig(top_k=2), seed=1, device="cpu")
    b = make_router_logits(RoutingDistribution.parse("zipf"), 8, 16, RoutingConfig(top_k=2), seed=1, device="cpu")
    assert torch.equal(a, b)
    load = summarize_load(torch.tensor([[0, 1], [0, 2]]), 4)
    assert (load.experts_hit, load.max_load, load.imbalance) == (3, 2, 1.5)


# --- correctness -----------------------------------------------------------------------------------


def _tiny_case(spec=TINY, tokens=24, dtype=torch.float32, dist="uniform"):
    preset = custom_preset(spec)
    weights = make_expert_weights(preset, "cpu", seed=0, dtype=dtype)
    hidden = torch.randn(tokens, preset.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits = make_router_logits(RoutingDistribution.parse(dist), tokens, preset.num_experts, preset.routing, seed=2, device="cpu")
    return preset, weights, hidden, logits


def test_reference_rows_match_moe2cta_reference():
    from moe2cta import moe_reference

    preset, weights, hidden, logits = _tiny_case()
    routed = route_twin(logits, preset.routing)
    ours = moe_rows(hidden, weights.w13, weights.w2, routed.topk_weights, routed.topk_ids, preset.activation)
    theirs = moe_reference(hidden, weights.w13, weights.w2, routed.topk_weights, routed.topk_ids, preset.activation)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["torch-loop", "grouped-mm", "moe2cta-torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backends_pass_the_check(name, dtype):
    preset, weights, hidden, logits = _tiny_case(dtype=dtype)
    reference = make_reference(hidden, weights, route_twin(logits, preset.routing), preset.activation)
    out = BACKENDS[name].build(preset, weights)(hidden, logits)
    verdict = check_output(out, reference, hidden.shape[0], preset.hidden)
    assert verdict.status is CheckStatus.PASS, verdict


def test_gpt_oss_like_bias_and_activation_pass():
    base = get_preset("gpt-oss-120b")
    preset = dataclasses.replace(base, hidden=64, intermediate=32, num_experts=8)
    weights = make_expert_weights(preset, "cpu", seed=0, dtype=torch.float32)
    assert weights.b13 is not None and weights.b2 is not None
    hidden = torch.randn(16, 64)
    logits = torch.randn(16, 8)
    reference = make_reference(hidden, weights, route_twin(logits, preset.routing), preset.activation)
    for name in ("torch-loop", "grouped-mm", "moe2cta-torch"):
        out = BACKENDS[name].build(preset, weights)(hidden, logits)
        assert check_output(out, reference, 16, 64).status is CheckStatus.PASS, name


def test_check_catches_wrong_outputs():
    preset, weights, hidden, logits = _tiny_case(dtype=torch.bfloat16)
    reference = make_reference(hidden, weights, route_twin(logits, preset.routing), preset.activation)
    good = BACKENDS["torch-loop"].build(preset, weights)(hidden, logits)
    assert reference.tolerance >= 2 * reference.twin_err > 0
    bad = good.clone()
    bad[3] = bad[3] * 1.5  # one token wrong
    assert check_output(bad, reference, 24, preset.hidden).status is CheckStatus.FAIL
    nan = good.clone()
    nan[0, 0] = float("nan")
    assert "NaN" in check_output(nan, reference, 24, preset.hidden).reason
    assert "shape" in check_output(good[:5], reference, 24, preset.hidden).reason


def test_check_catches_a_fault_confined_to_one_row_of_many():
    """One output row 20% off in 2048 moves the Frobenius error by ~0.2 / 45 of its norm: within the whole-output
    tolerance, caught by the row bound (3x the same-dtype run's worst row), while a correct bf16 layer passes both."""
    preset, weights, hidden, logits = _tiny_case(tokens=2048, dtype=torch.bfloat16)
    reference = make_reference(hidden, weights, route_twin(logits, preset.routing), preset.activation)
    good = BACKENDS["moe2cta-torch"].build(preset, weights)(hidden, logits)
    assert check_output(good, reference, 2048, preset.hidden).status is CheckStatus.PASS
    assert reference.row_tolerance >= 3 * reference.twin_row_err > 0
    row = int(reference.rows[100])
    bad = good.clone()
    bad[row] *= 0.8
    verdict = check_output(bad, reference, 2048, preset.hidden)
    assert verdict.rel_err <= reference.tolerance  # the whole-output error alone would pass it
    assert verdict.status is CheckStatus.FAIL and f"token row {row}:" in verdict.reason
    # the verdict carries the figures that failed it (a report of rel_err < tolerance alone would read as a pass)
    assert verdict.row_err > verdict.row_tolerance == reference.row_tolerance and verdict.margin_used > 1
    passed = check_output(good, reference, 2048, preset.hidden)
    assert passed.row_err <= passed.row_tolerance and passed.margin_used <= 1
    # the rotation closest to failing, by either bound: here by the row bound, where the whole-output error is lower
    from moe2cta.serving_bench.correctness import Verdict

    by_total = Verdict(CheckStatus.PASS, 0.9, 1.0, 8, 0, "", 0.1, 1.0)
    by_row = Verdict(CheckStatus.PASS, 0.3, 1.0, 8, 0, "", 0.95, 1.0)
    assert runner._worst([by_total, by_row]) is by_row and runner._worst([by_row, by_total]) is by_row


def _rotation_wrong_build(preset, weights):
    """A layer that is right on the first input it is called with and wrong (zeros) on every other one."""
    inner = BACKENDS["torch-loop"].build(preset, weights)
    first = []

    def forward(hidden, logits):
        first.append(first[0] if first else hidden)
        out = inner(hidden, logits)
        return out if hidden is first[0] else torch.zeros_like(out)

    return forward


def test_every_rotated_input_is_checked(monkeypatch):
    from moe2cta.serving_bench.runner import CaseStatus, RunConfig, run_benchmark

    spec = BackendSpec("rot-wrong", BackendFamily.OURS, "wrong past rotation 0", GraphCapture.TRY,
                       lambda device: (True, ""), _rotation_wrong_build)
    monkeypatch.setitem(BACKENDS, "rot-wrong", spec)
    run = RunConfig(models=(custom_preset(TINY),), sweep_tokens=(4,),
                    distributions=(RoutingDistribution.parse("uniform"),), backends=("torch-loop", "rot-wrong"), device=torch.device("cpu"), ceilings=DEFAULT_CEILINGS,
                    timing=FAST_TIMING, dtype=torch.float32)
    bench = run_benchmark(run)
    by = {r.backend: r for r in bench.results}
    assert by["torch-loop"].status is CaseStatus.OK
    assert by["rot-wrong"].status is CaseStatus.WRONG and "rotated input 1" in by["rot-wrong"].reason


def test_a_rotated_input_with_no_checkable_row_is_drawn_again(monkeypatch):
    """At T=1 one near-tie leaves no row to check: that rotated input is drawn again from another seed (the first draw
    keeps the seed every run used) instead of the model's every cell reporting an error."""
    from moe2cta.serving_bench.correctness import AmbiguousRows
    from moe2cta.serving_bench.runner import RunConfig

    calls = []
    real = runner.make_reference

    def first_draw_of_rotation_1_ambiguous(hidden, *args, **kwargs):
        calls.append(hidden)
        if len(calls) == 2:
            raise AmbiguousRows("hidden: every sampled row has an ambiguous top-k; use another seed")
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(runner, "make_reference", first_draw_of_rotation_1_ambiguous)
    preset = custom_preset(TINY)
    run = RunConfig(models=(preset,), sweep_tokens=(1,), distributions=(RoutingDistribution.parse("uniform"),),
                    backends=("torch-loop",), device=torch.device("cpu"), ceilings=DEFAULT_CEILINGS,
                    timing=dataclasses.replace(FAST_TIMING, rotation_bytes=1 << 30, max_rotation=3), dtype=torch.float32)
    weights = make_expert_weights(preset, "cpu", seed=0)
    case = runner._make_case(preset, weights, 1, run.distributions[0], run)
    assert len(calls) == 4 and len(case.inputs) == 3 and len(case.references) == 3  # rotation 1 drawn twice
    assert not torch.equal(calls[1], calls[2]) and torch.equal(case.inputs[1][0], calls[2])
    for rotation in (0, 2):  # the other rotations keep the seed every earlier run drew them from
        seed = runner._seed(run.seed, preset.name, 1, run.distributions[0].label, rotation)
        assert torch.equal(case.inputs[rotation][0],
                           torch.randn(1, preset.hidden, generator=torch.Generator().manual_seed(seed)))
    monkeypatch.setattr(runner, "make_reference", lambda *a, **k: (_ for _ in ()).throw(AmbiguousRows("none")))
    with pytest.raises(AmbiguousRows):  # (every draw ambiguous: the model's preparation reports it)
        runner._make_case(preset, weights, 1, run.distributions[0], run)


def test_ambiguous_rows_are_left_out():
    preset, weights, hidden, logits = _tiny_case()
    logits[5] = 0.0  # all experts tie: ambiguous top-k
    reference = make_reference(hidden, weights, route_twin(logits, preset.routing), preset.activation)
    assert reference.rows_ambiguous == 1 and 5 not in reference.rows.tolist()


# --- timing ----------------------------------------------------------------------------------------


def test_cpu_timing_and_rotation():
    calls = []
    result = time_callable(lambda x: calls.append(x), [(1,), (2,)], torch.device("cpu"), FAST_TIMING)
    assert result.mode is TimingMode.CPU_CLOCK
    assert FAST_TIMING.min_samples <= len(result.samples_us) <= FAST_TIMING.max_samples
    assert set(calls) == {1, 2} and result.median_us >= 0 and result.percentile(99) >= result.percentile(50)
    config = TimingConfig(rotation_bytes=100, max_rotation=4)
    assert rotation_count(1, config) == 4 and rotation_count(60, config) == 2 and rotation_count(1000, config) == 1
    with pytest.raises(ValueError, match="samples"):
        TimingConfig(min_samples=5, max_samples=2)


def test_settle_replays_untimed_before_the_samples():
    """settle_seconds: the calls run round-robin for that long before the samples (so that a power-capped GPU's
    samples see its sustained clock); the sample count does not change."""
    calls = []
    plain = time_callable(lambda x: calls.append(x), [(1,), (2,)], torch.device("cpu"), FAST_TIMING)
    plain_calls = len(calls)
    calls.clear()
    config = dataclasses.replace(FAST_TIMING, settle_seconds=0.05)
    settled = time_callable(lambda x: (calls.append(x), time.sleep(0.001)), [(1,), (2,)], torch.device("cpu"), config)
    assert FAST_TIMING.min_samples <= len(settled.samples_us) <= FAST_TIMING.max_samples
    assert len(calls) >= plain_calls + 20 and min(calls.count(1), calls.count(2)) >= 10  # ~50 calls, both inputs
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="settle_seconds"):
            TimingConfig(settle_seconds=bad)


def test_clock_window_takes_the_readings_of_the_samples_window():
    """clock_window: medians of the NVML readings inside the window; a window shorter than a reading period gets the
    reading nearest its middle if one is within a period, else none. The CPU path reads no clock."""
    from moe2cta.serving_bench.power import PowerSample
    from moe2cta.serving_bench.timing import CLOCK_PERIOD_S, ClockReading, clock_window

    readings = [PowerSample(t, power_w=500.0 + t, sm_mhz=1000.0 + 10 * t, reasons=0, temperature_c=50.0)
                for t in (0.0, 1.0, 2.0, 3.0, 4.0)]
    w = clock_window(readings, 0.5, 3.5)
    assert (w.sm_mhz, w.power_w, w.readings) == (1020.0, 502.0, 3)
    near = clock_window(readings, 2.0 + CLOCK_PERIOD_S / 4, 2.0 + CLOCK_PERIOD_S / 2)
    assert near.readings == 1 and near.sm_mhz == 1020.0
    assert clock_window(readings, 2.3, 2.31) is None and clock_window([], 0.0, 1.0) is None
    result = time_callable(lambda x: x, [(1,)], torch.device("cpu"), FAST_TIMING)
    assert result.clock is None and FAST_TIMING.clock_reading is ClockReading.NVML
    with pytest.raises(TypeError, match="clock_reading: expected a ClockReading"):
        TimingConfig(clock_reading="nvml")


def test_dense_ceiling_times_compute_bound_cells_only(monkeypatch):
    """dense-ceiling: the two dense matmuls of the layer's total GEMM shape on one expert's weights, not a layer (no
    correctness check, which it could not pass); timed only where the cell's floor is compute-bound, the rest
    unsupported with the reason."""
    from moe2cta.serving_bench.runner import CaseStatus, RunConfig, run_benchmark

    preset = custom_preset(TINY)  # H 64, I 32, E 8, k 2
    weights = make_expert_weights(preset, "cpu", seed=0, dtype=torch.float32)
    spec = BACKENDS["dense-ceiling"]
    assert spec.family is BackendFamily.CEILING
    fn = spec.build(preset, weights)
    hidden = torch.randn(5, 64)
    y = fn(hidden, torch.randn(5, 8))
    assert y.shape == (10, 64) and torch.isfinite(y).all() and y.abs().sum() > 0
    assert fn(hidden, torch.randn(5, 8)) is y  # kept for the calls with this input
    other = fn(torch.randn(5, 64), torch.randn(5, 8))  # another rotated input: operands of its own
    assert other is not y and not torch.equal(other, y) and fn(hidden, torch.randn(5, 8)) is y
    assert fn(torch.randn(3, 64), torch.randn(3, 8)).shape == (6, 64)
    # a matmul rate at which T=64 is compute-bound and T=1 memory-bound
    ceilings = Ceilings(DEFAULT_CEILINGS.bandwidth, 1e13, CeilingSource.DEFAULT)
    run = RunConfig(models=(preset,), sweep_tokens=(1, 64), distributions=(RoutingDistribution.parse("uniform"),),
                    backends=("grouped-mm", "dense-ceiling"), device=torch.device("cpu"), ceilings=ceilings,
                    timing=FAST_TIMING, dtype=torch.float32)
    bench = run_benchmark(run)
    by = {(r.backend, r.tokens): r for r in bench.results}
    assert by[("grouped-mm", 1)].floor_bound == "memory" and by[("grouped-mm", 64)].floor_bound == "compute"
    assert by[("dense-ceiling", 1)].status is CaseStatus.UNSUPPORTED and "memory-bound" in by[("dense-ceiling", 1)].reason
    ceiling = by[("dense-ceiling", 64)]
    assert ceiling.status is CaseStatus.OK and ceiling.median_us > 0 and ceiling.rel_err is None
    assert ceiling.family == "ceiling" and ceiling.sm_mhz is None  # no clock on the CPU
    assert by[("grouped-mm", 64)].status is CaseStatus.OK and by[("grouped-mm", 64)].rel_err is not None


def test_expert_bmm_ceiling_is_the_balanced_routings_gemms():
    """expert-bmm-ceiling: bmm over every expert at ceil(T*k / E) rows on the layer's weights (its second product is
    a2[e] @ w2[e].T for every expert); timed only where the cell hits every expert."""
    from moe2cta.serving_bench.backends import CellFacts

    preset = custom_preset(TINY)  # H 64, I 32, E 8, k 2
    weights = make_expert_weights(preset, "cpu", seed=0, dtype=torch.float32)
    spec = BACKENDS["expert-bmm-ceiling"]
    assert spec.family is BackendFamily.CEILING
    y = spec.build(preset, weights)(torch.randn(5, 64), torch.randn(5, 8))
    assert y.shape == (8, 2, 64)  # ceil(5 * 2 / 8) rows per expert
    gen = torch.Generator().manual_seed(2)
    torch.randn(8, 2, 64, generator=gen)
    a2 = torch.randn(8, 2, 32, generator=gen)
    torch.testing.assert_close(y, torch.einsum("emi,ehi->emh", a2, weights.w2))
    assert spec.applies(preset, CellFacts(64, 8.0, "memory")) == (True, "")
    ok, why = spec.applies(preset, CellFacts(1, 2.0, "memory"))
    assert not ok and "every expert" in why
    dense = BACKENDS["dense-ceiling"]
    assert dense.applies(preset, CellFacts(64, 8.0, "compute"))[0] and not dense.applies(preset, CellFacts(64, 8.0, "memory"))[0]


# --- trace -----------------------------------------------------------------------------------------


def test_trace_generator_and_scheduler_conserve_tokens():
    config = TraceConfig(num_requests=300, arrival_rate=50.0, mean_prompt_tokens=200, mean_output_tokens=20,
                         max_prompt_tokens=3000, max_output_tokens=200, token_budget=1024, max_running=64, seed=7)
    requests = generate_requests(config)
    assert requests == generate_requests(config)  # deterministic
    gaps = np.diff([0.0] + [r.arrival_s for r in requests])
    assert np.mean(gaps) == pytest.approx(1 / 50.0, rel=0.2)  # Poisson rate
    assert np.mean([r.prompt_tokens for r in requests]) == pytest.approx(200, rel=0.3)
    steps = schedule_steps(requests, config)
    assert all(1 <= s.num_tokens <= 1024 for s in steps)
    assert sum(s.prefill_tokens for s in steps) == sum(r.prompt_tokens for r in requests)
    assert sum(s.decode_tokens for s in steps) == sum(r.output_tokens - 1 for r in requests)
    assert any(s.decode_tokens and s.prefill_tokens for s in steps)  # mixed steps happen
    assert all(s.decode_tokens <= 64 for s in steps)
    stats = trace_stats(steps)
    assert stats.total_tokens == sum(s.num_tokens for s in steps) and stats.max_step_tokens <= 1024
    assert set(stats.buckets) <= set(BUCKETS) and max(stats.buckets) <= 1024


def test_buckets_and_step_latencies():
    assert [bucket_tokens(t) for t in (1, 2, 3, 5, 7, 9, 100, 1025)] == [1, 2, 3, 6, 8, 12, 128, 1536]
    with pytest.raises(ValueError):
        bucket_tokens(0)
    from moe2cta.serving_bench.trace import Step

    steps = [Step(0.0, 4, 0, 0)] * 90 + [Step(0.0, 4, 100, 1)] * 10
    lat = step_latencies(steps, {4: [10.0], 128: [100.0]}, {4: 5.0, 128: 50.0})
    assert lat.p50_us == 10.0 and lat.p99_us == pytest.approx(100.0) and lat.mean_us == pytest.approx(19.0)
    assert lat.tokens_per_s == pytest.approx((90 * 4 + 10 * 104) / (1900e-6))
    assert lat.time_over_floor == pytest.approx(2.0)


# --- runner, reports, plots, CLI --------------------------------------------------------------------


def _wrong_build(preset, weights):
    def forward(hidden, logits):
        return torch.zeros_like(hidden) + 1.0

    return forward


def _raising_build(preset, weights):
    def forward(hidden, logits):
        raise RuntimeError("kernel exploded")

    return forward


@pytest.fixture
def extra_backends(monkeypatch):
    ok = lambda device: (True, "")  # noqa: E731
    wrong = BackendSpec("wrong", BackendFamily.OURS, "always 1.0", GraphCapture.TRY, ok, _wrong_build)
    boom = BackendSpec("boom", BackendFamily.PEER, "raises", GraphCapture.TRY, ok, _raising_build)
    monkeypatch.setitem(BACKENDS, "wrong", wrong)
    monkeypatch.setitem(BACKENDS, "boom", boom)


def test_run_reports_and_plots(tmp_path, extra_backends):
    from moe2cta.serving_bench.plots import write_plots
    from moe2cta.serving_bench.report import terminal_report, write_reports
    from moe2cta.serving_bench.runner import CaseStatus, RunConfig, run_benchmark

    trace = TraceConfig(num_requests=6, arrival_rate=100.0, mean_prompt_tokens=12, mean_output_tokens=3,
                        max_prompt_tokens=40, max_output_tokens=8, token_budget=32, max_running=8)
    run = RunConfig(
        models=(custom_preset(TINY),),
        sweep_tokens=(1, 8),
        distributions=(RoutingDistribution.parse("uniform"), RoutingDistribution.parse("hot")),
        backends=("torch-loop", "grouped-mm", "wrong", "boom", "triton"),
        device=torch.device("cpu"),
        ceilings=DEFAULT_CEILINGS,
        timing=FAST_TIMING,
        trace=trace,
        dtype=torch.float32,
    )
    labels = []
    bench = run_benchmark(run, labels.append)
    n_tokens = len(set(run.sweep_tokens) | set(bench.trace_stats.buckets))
    assert len(bench.results) == len(labels) == 2 * 5 * n_tokens
    by = {}
    for r in bench.results:
        by.setdefault(r.backend, set()).add(r.status)
    assert by["torch-loop"] == {CaseStatus.OK} and by["grouped-mm"] == {CaseStatus.OK}
    assert by["wrong"] == {CaseStatus.WRONG} and by["boom"] == {CaseStatus.ERROR}
    assert by["triton"] == {CaseStatus.UNAVAILABLE}
    ok = [r for r in bench.results if r.status is CaseStatus.OK]
    assert all(r.median_us > 0 and r.floor_us > 0 and r.ratio > 0 and r.samples_us for r in ok)
    assert all(r.median_us is None for r in bench.results if r.status is not CaseStatus.OK)  # wrong: not timed
    traced = {(t.backend, t.distribution): t for t in bench.trace_results}
    assert traced[("torch-loop", "hot")].latency.p99_us >= traced[("torch-loop", "hot")].latency.p50_us > 0
    assert traced[("wrong", "uniform")].latency is None

    text = terminal_report(bench)
    assert "WRONG" in text and "ERROR" in text and "kernel exploded" in text and "n/a" in text
    assert "1.10x" in text and "hot" in text and "p99 us" in text
    plots, message = write_plots(bench, tmp_path)
    assert message == "" and set(plots) == {"latency", "heatmap"}
    paths = write_reports(bench, tmp_path, plots)
    data = json.loads(paths["json"].read_text())
    assert len(data["results"]) == len(bench.results) and data["trace"]["stats"]["num_steps"] > 0
    assert data["backends"]["triton"]["available"] is False and data["summary"]["torch-loop"]["cells_ok"] == 4
    md = paths["markdown"].read_text()
    assert "| T |" in md and "![latency](latency.png)" in md and "Serving trace" in md
    import matplotlib.image

    for name in ("latency.png", "heatmap.png"):
        image = matplotlib.image.imread(tmp_path / name)
        assert image.shape[0] > 100 and image.shape[1] > 100 and float(np.std(image)) > 0.01


def test_lost_cuda_context_stops_the_run_but_keeps_results(monkeypatch, extra_backends):
    from moe2cta.serving_bench import runner
    from moe2cta.serving_bench.runner import BackendOrder, CaseStatus, RunConfig, run_benchmark

    monkeypatch.setattr(runner, "_cuda_alive", lambda device: False)  # as after a sticky kernel fault
    run = RunConfig(models=(custom_preset(TINY), custom_preset("32,16,4,2")), sweep_tokens=(1, 2),
                    distributions=(RoutingDistribution.parse("uniform"),), backends=("torch-loop", "boom", "grouped-mm"),
                    device=torch.device("cpu"), ceilings=DEFAULT_CEILINGS, timing=FAST_TIMING, dtype=torch.float32,
                    order=BackendOrder.SEQUENTIAL)
    labels = []
    bench = run_benchmark(run, labels.append)
    status = [(r.model, r.backend, r.tokens, r.status) for r in bench.results]
    assert len(status) == len(labels) == 2 * 3 * 2
    assert status[:3] == [("custom-64-32-8-2", "torch-loop", 1, CaseStatus.OK), ("custom-64-32-8-2", "torch-loop", 2, CaseStatus.OK),
                          ("custom-64-32-8-2", "boom", 1, CaseStatus.ERROR)]
    assert "CUDA context lost" in bench.results[2].reason
    assert all(r.status is CaseStatus.NOT_RUN for r in bench.results[3:])

    # interleaved: the cell that loses the context still reports its other backends; everything after it is not run
    labels = []
    bench = run_benchmark(dataclasses.replace(run, order=BackendOrder.INTERLEAVED), labels.append)
    status = [(r.model, r.tokens, r.backend, r.status) for r in bench.results]
    assert len(status) == len(labels) == 2 * 3 * 2
    assert status[:3] == [("custom-64-32-8-2", 1, "torch-loop", CaseStatus.NOT_RUN),
                          ("custom-64-32-8-2", 1, "boom", CaseStatus.ERROR),
                          ("custom-64-32-8-2", 1, "grouped-mm", CaseStatus.NOT_RUN)]
    assert "CUDA context lost" in bench.results[1].reason
    assert all(r.status is CaseStatus.NOT_RUN for r in bench.results[3:])


def _logging_backend(name, log, *, oom_builds=0, held=None):
    """A correct backend (the grouped-mm peer) that logs its calls; its first `oom_builds` builds raise
    torch.cuda.OutOfMemoryError while `held` (a list of live backend names) is not empty."""
    grouped = BACKENDS["grouped-mm"]
    builds = []

    def build(preset, weights):
        builds.append(name)
        if len(builds) <= oom_builds and held:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        inner = grouped.build(preset, weights)

        class Forward:  # held in `held` while the runner keeps it
            def __init__(self):
                if held is not None:
                    held.append(name)

            def __call__(self, hidden, logits):
                log.append(name)
                return inner(hidden, logits)

            def __del__(self):
                if held is not None and name in held:
                    held.remove(name)

        return Forward()

    spec = BackendSpec(name, BackendFamily.PEER, "logs its calls", GraphCapture.TRY, lambda device: (True, ""), build)
    return spec, builds


def test_interleaved_order_times_a_cells_backends_in_the_same_rounds(monkeypatch, extra_backends):
    from moe2cta.serving_bench.report import results_json, terminal_report
    from moe2cta.serving_bench.runner import BackendOrder, CaseStatus, RunConfig, run_benchmark

    log = []
    for name in ("log-a", "log-b"):
        monkeypatch.setitem(BACKENDS, name, _logging_backend(name, log)[0])
    run = RunConfig(models=(custom_preset(TINY),), sweep_tokens=(1, 4), distributions=(RoutingDistribution.parse("uniform"),),
                    backends=("log-a", "wrong", "log-b"), device=torch.device("cpu"), ceilings=DEFAULT_CEILINGS,
                    timing=FAST_TIMING, dtype=torch.float32, order=BackendOrder.INTERLEAVED)
    assert RunConfig.__dataclass_fields__["order"].default is BackendOrder.SEQUENTIAL  # the default
    bench = run_benchmark(run)
    assert [(r.tokens, r.backend) for r in bench.results] == [(t, b) for t in (1, 4) for b in ("log-a", "wrong", "log-b")]
    ok = [r for r in bench.results if r.status is CaseStatus.OK]
    assert [r.backend for r in ok] == ["log-a", "log-b"] * 2
    assert all(r.timed_with == ("log-a", "log-b") for r in ok)  # the wrong backend is checked, not timed
    for t in (1, 4):
        a, b = (r for r in ok if r.tokens == t)
        assert len(a.samples_us) == len(b.samples_us) >= FAST_TIMING.min_samples
    # the timed rounds alternate: each round runs both backends, starting with another one each time
    rounds = "".join(name[-1] for name in log)
    assert "abba" in rounds and "baab" in rounds
    # and no two backends of a round run the same rotated input: log-b starts one rotation later
    assert {r.backend: r.first_rotation for r in ok} == {"log-a": 0, "log-b": 1}
    assert "interleaved" in terminal_report(bench) and results_json(bench)["backend_order"] == "interleaved"
    assert "router: each model's own router" in terminal_report(bench) and results_json(bench)["router"] == "model"
    with pytest.raises(TypeError, match="order"):
        dataclasses.replace(run, order="interleaved")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_are_williams_designs(n):
    from moe2cta.serving_bench.timing import balanced_orders

    rows = balanced_orders(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n) and all(sorted(row) == list(range(n)) for row in rows)
    firsts = [row[0] for row in rows]
    assert all(firsts.count(i) == len(rows) // n for i in range(n))  # each first equally often
    pairs = [(row[j], row[j + 1]) for row in rows for j in range(n - 1)]
    if n > 1:  # each ordered pair (a right before b) equally often
        assert len(set(pairs)) == n * (n - 1) and all(pairs.count(p) == pairs.count(pairs[0]) for p in set(pairs))
    with pytest.raises(ValueError, match="n"):
        balanced_orders(0)


def test_interleaved_order_splits_the_backends_where_memory_runs_out(monkeypatch):
    from moe2cta.serving_bench.runner import BackendOrder, CaseStatus, RunConfig, run_benchmark

    log, held = [], []
    spec_a, _ = _logging_backend("log-a", log, held=held)
    spec_b, builds_b = _logging_backend("log-b", log, oom_builds=1, held=held)
    spec_c, _ = _logging_backend("log-c", log, held=held)
    for spec in (spec_a, spec_b, spec_c):
        monkeypatch.setitem(BACKENDS, spec.name, spec)
    run = RunConfig(models=(custom_preset(TINY),), sweep_tokens=(1, 2), distributions=(RoutingDistribution.parse("uniform"),),
                    backends=("log-a", "log-b", "log-c"), device=torch.device("cpu"), ceilings=DEFAULT_CEILINGS,
                    timing=FAST_TIMING, dtype=torch.float32, order=BackendOrder.INTERLEAVED)
    bench = run_benchmark(run)
    assert all(r.status is CaseStatus.OK for r in bench.results) and len(bench.results) == 6
    # log-b ran out of memory beside log-a: log-a ran alone, then log-b (built again) and log-c together
    assert builds_b == ["log-b", "log-b"]
    assert {r.backend: r.timed_with for r in bench.results} == {
        "log-a": ("log-a",), "log-b": ("log-b", "log-c"), "log-c": ("log-b", "log-c")}
    assert [(r.backend, r.tokens) for r in bench.results] == [("log-a", 1), ("log-a", 2), ("log-b", 1), ("log-c", 1),
                                                              ("log-b", 2), ("log-c", 2)]


def test_cli_runs_on_cpu(tmp_path, capsys):
    from moe2cta.serving_bench.cli import main

    out = tmp_path / "run"
    rc = main(["--device", "cpu", "--custom", TINY, "--tokens", "1,4", "--backends", "torch-loop,grouped-mm",
               "--routing", "balanced", "--time-per-case", "0.002", "--max-samples", "4", "--out", str(out),
               "--settle-seconds", "0.002", "--progress", "off", "--no-plots"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "No CUDA GPU" in printed and "balanced" in printed and "grouped-mm" in printed
    assert (out / "results.json").is_file() and (out / "report.md").is_file()
    assert "settle: each case replays untimed for 0.002 s" in (out / "report.md").read_text()
    results = json.loads((out / "results.json").read_text())
    assert results["timing"]["settle_seconds"] == 0.002
    # floors at the targets' ceilings; nothing measured on the CPU; each rotation's experts hit, to restate floors
    assert results["ceilings"]["matmul_flops_per_s"] == 792e12 and results["ceilings"]["bandwidth_bytes_per_s"] == 4.24e12
    assert results["measured_ceilings"] is None
    cell = results["results"][0]
    assert len(cell["rotation_experts_hit"]) == len(cell["rotation_floors_us"]) >= 1
    assert main(["--list", "--device", "cpu"]) == 0
    assert "deepseek-v3" in capsys.readouterr().out


def test_cli_default_plan_on_cpu():
    from moe2cta.serving_bench.cli import build_parser, plan_from_args

    run, notes = plan_from_args(build_parser().parse_args(["--device", "cpu"]))
    assert [m.name for m in run.models] == ["custom-256-128-16-4"] and run.dtype == torch.float32
    assert run.backends == backends_mod.DEFAULT_CPU_BACKENDS and run.sweep_tokens[0] == 1
    assert any("No CUDA GPU" in n for n in notes)
    full, _ = plan_from_args(build_parser().parse_args(["--device", "cpu", "--models", "all", "--full", "--scenario", "trace"]))
    assert len(full.models) == 5 and full.trace is not None and full.sweep_tokens == ()
    with pytest.raises(ValueError, match="model"):
        plan_from_args(build_parser().parse_args(["--device", "cpu", "--models", "llama"]))
    with pytest.raises(ValueError, match="backends"):
        plan_from_args(build_parser().parse_args(["--device", "cpu", "--backends", "vllm"]))
    assert run.timing.settle_seconds == 0
    settled, _ = plan_from_args(build_parser().parse_args(["--device", "cpu", "--settle-seconds", "0.5"]))
    assert settled.timing.settle_seconds == 0.5
    with pytest.raises(ValueError, match="--settle-seconds"):
        plan_from_args(build_parser().parse_args(["--device", "cpu", "--settle-seconds", "-1"]))
    assert run.ceilings == DEFAULT_CEILINGS and run.measured_ceilings is None  # the targets' ceilings by default
    with pytest.raises(ValueError, match="--floors measured: needs the ceilings measured on a CUDA device"):
        plan_from_args(build_parser().parse_args(["--device", "cpu", "--floors", "measured"]))
    with pytest.raises(ValueError, match="--floors measured: expected no --bandwidth-tbps"):
        plan_from_args(build_parser().parse_args(["--device", "cpu", "--floors", "measured", "--peak-tflops", "800"]))
    given, _ = plan_from_args(build_parser().parse_args(["--device", "cpu", "--peak-tflops", "800"]))
    assert given.ceilings.matmul_flops == 800e12 and given.ceilings.source is CeilingSource.USER


def test_bench_router_peer_is_the_peer_figures_routing(capsys):
    """BenchRouter.PEER: softmax -> top-k -> renormalize for every preset. It selects what each preset's own router
    selects except for deepseek-v3, whose own router (random correction bias) skews the loads on i.i.d. logits."""
    from moe2cta.serving_bench.cli import build_parser, plan_from_args

    deepseek = get_preset("deepseek-v3")
    assert BenchRouter.MODEL.apply(deepseek) is deepseek
    peer = BenchRouter.PEER.apply(deepseek)
    assert (peer.routing.scoring, peer.routing.renormalize, peer.routing.top_k) == (Scoring.SOFTMAX, True, 8)
    assert peer.routing.num_expert_group is None and peer.routing.routed_scaling_factor == 1.0
    assert (peer.name, peer.hidden, peer.intermediate, peer.num_experts) == ("deepseek-v3", 7168, 2048, 256)
    uniform = RoutingDistribution(DistributionKind.UNIFORM)
    for name in ("qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b", "deepseek-v3"):
        preset = get_preset(name)
        logits = make_router_logits(uniform, 2048, preset.num_experts, preset.routing, seed=3, device="cpu")
        bias = make_correction_bias(preset.num_experts, seed=1, device="cpu") if preset.routing.num_expert_group else None
        own = route_twin(logits, preset.routing, bias).topk_ids
        ids = route_twin(logits, BenchRouter.PEER.apply(preset).routing, None).topk_ids
        if name != "deepseek-v3":
            assert torch.equal(own.sort(1).values, ids.sort(1).values), name
        else:
            assert summarize_load(own, 256).imbalance > 1.8 > 1.5 > summarize_load(ids, 256).imbalance
    with pytest.raises(TypeError, match="preset"):
        BenchRouter.PEER.apply("deepseek-v3")
    run, _ = plan_from_args(build_parser().parse_args(["--device", "cpu", "--models", "deepseek-v3,qwen3-30b-a3b",
                                                       "--router", "peer"]))
    assert [m.routing.scoring for m in run.models] == [Scoring.SOFTMAX, Scoring.SOFTMAX]
    assert run.router is BenchRouter.PEER and run.models[1] == get_preset("qwen3-30b-a3b")
    with pytest.raises(TypeError, match="router"):
        dataclasses.replace(run, router="peer")
    run, _ = plan_from_args(build_parser().parse_args(["--device", "cpu", "--models", "deepseek-v3"]))
    assert run.models[0].routing.scoring is Scoring.SIGMOID_GROUPED
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--router", "softmax"])
    assert exit_info.value.code == 2 and "--router" in capsys.readouterr().err


def test_progress_lines():
    import io

    from moe2cta.serving_bench.progress import Progress, ProgressStyle

    stream = io.StringIO()
    progress = Progress(3, stream=stream, style=ProgressStyle.LINES, line_interval_s=0.0)
    for label in ("a", "b", "c"):
        progress(label)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("[" + "#" * 30 + "] 3/3") and lines[-1].endswith("c")


# --- GPU path ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ceilings_and_graph_timing():
    from moe2cta.serving_bench.floors import measure_ceilings

    c = measure_ceilings(torch.device("cuda"), copy_bytes=1 << 28, matmul_size=4096)
    assert c.source is CeilingSource.MEASURED and 1e11 < c.bandwidth < 2e13 and 1e13 < c.matmul_flops < 1e16
    preset = custom_preset("512,256,16,4")
    weights = make_expert_weights(preset, "cuda", seed=0)
    ok, why = BACKENDS["grouped-mm"].availability(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    fn = BACKENDS["grouped-mm"].build(preset, weights)
    inputs = [(torch.randn(64, 512, device="cuda", dtype=torch.bfloat16), torch.randn(64, 16, device="cuda")) for _ in range(2)]
    result = time_callable(fn, inputs, torch.device("cuda"), FAST_TIMING, GraphCapture.TRY)
    assert result.mode is TimingMode.CUDA_GRAPH, result.note
    assert all(math.isfinite(s) and s > 0 for s in result.samples_us)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_settle_replays_the_graphs_for_its_time_first():
    """settle_seconds on the GPU: the graphs replay untimed for that long (host clock, device synchronized), then the
    samples are taken as without it. The same timing without settling runs first (it also pays cuBLAS's start-up), so
    the difference of the two wall times is the settling alone."""
    x = [(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16),) for _ in range(2)]
    plain = TimingConfig(warmup_calls=1, min_samples=10, max_samples=20, target_seconds=0.02, max_rotation=2)
    settled = dataclasses.replace(plain, settle_seconds=0.3)
    walls, results = [], []
    for config in (plain, plain, settled):
        start = time.perf_counter()
        results.append(time_callable(lambda a: a @ a, x, torch.device("cuda"), config))
        walls.append(time.perf_counter() - start)
    assert walls[2] - walls[1] >= 0.27, walls
    for result in results[1:]:
        assert result.mode is TimingMode.CUDA_GRAPH and 10 <= len(result.samples_us) <= 20
        assert all(math.isfinite(s) and s > 0 for s in result.samples_us)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_interleaved_timing_keeps_each_callables_own_time():
    """Two matmuls, one 8x the FLOPs of the other, timed in the same rounds: both replay from graphs, get the same
    number of samples, and their medians stand about 8x apart (each sample is its own callable's, not a neighbour's);
    a callable that syncs with the host is timed eagerly beside them."""
    from moe2cta.serving_bench.timing import time_interleaved

    small = [(torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16),) for _ in range(2)]
    large = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def syncing(x):
        y = x @ x
        torch.cuda.synchronize()
        return y

    timing = TimingConfig(warmup_calls=1, min_samples=20, max_samples=40, target_seconds=0.05, max_rotation=2)
    out = time_interleaved({"small": lambda x: x @ x, "large": lambda x: large @ large, "syncing": syncing}, small,
                           torch.device("cuda"), timing)
    assert out["small"].mode is TimingMode.CUDA_GRAPH and out["large"].mode is TimingMode.CUDA_GRAPH
    assert out["syncing"].mode is TimingMode.CUDA_EVENTS and "timed eagerly" in out["syncing"].note
    assert len({len(r.samples_us) for r in out.values()}) == 1 and len(out["small"].samples_us) >= 20
    assert 4.0 < out["large"].median_us / out["small"].median_us < 12.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_timing_reads_the_clock_of_the_samples_window():
    """ClockReading.NVML: a timed case carries the median SM clock and board power over its samples' window, within
    the card's range, and the same reading for every callable timed in its rounds; NONE reads nothing."""
    from moe2cta.serving_bench.timing import ClockReading, time_interleaved

    x = [(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16),) for _ in range(2)]
    timing = TimingConfig(warmup_calls=1, min_samples=20, max_samples=200, target_seconds=0.1, max_rotation=2)
    out = time_interleaved({"a": lambda a: a @ a, "b": lambda a: a + a}, x, torch.device("cuda"), timing)
    clock = out["a"].clock
    if clock is None:
        from moe2cta.serving_bench.power import PowerSampler

        assert PowerSampler().backend() != "nvml", "NVML loads, yet the case read no clock"
        pytest.skip("no NVML library on this machine")
    assert out["b"].clock == clock and clock.readings >= 5
    assert 300 <= clock.sm_mhz <= 3000 and 50 <= clock.power_w <= 1500
    quiet = time_callable(lambda a: a @ a, x, torch.device("cuda"),
                          dataclasses.replace(timing, clock_reading=ClockReading.NONE))
    assert quiet.clock is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ceilings_are_the_dense_matmuls():
    """dense-ceiling on the GPU: its output is the second matmul of its fixed activations (bf16, checked against an
    fp32 matmul of the same operands); it and expert-bmm-ceiling replay from a graph, and at a compute-bound cell of a
    real preset's shape run near the card's matmul rate (between 0.3x and 1.3x of 792 TFLOP/s)."""
    preset = get_preset("qwen3-30b-a3b")
    weights = make_expert_weights(preset, "cuda", seed=0)
    fn = BACKENDS["dense-ceiling"].build(preset, weights)
    tokens = 4096
    inputs = [(torch.randn(tokens, preset.hidden, device="cuda", dtype=torch.bfloat16),
               torch.randn(tokens, preset.num_experts, device="cuda")) for _ in range(2)]
    y = fn(*inputs[0]).clone()
    gen = torch.Generator(device="cuda").manual_seed(tokens * preset.top_k)  # the ceiling's activations: a1, then a2
    torch.randn(tokens * preset.top_k, preset.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    a2 = torch.randn(tokens * preset.top_k, preset.intermediate, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = a2.float() @ weights.w2[0].float().t()
    assert (y.float() - want).abs().max().item() <= 0.02 * want.abs().max().item()
    flops = 2 * tokens * preset.top_k * 3 * preset.hidden * preset.intermediate
    for name in ("dense-ceiling", "expert-bmm-ceiling"):  # the bmm's rows per expert: 4096 * 8 / 128 = 256
        result = time_callable(BACKENDS[name].build(preset, weights), inputs, torch.device("cuda"), FAST_TIMING)
        assert result.mode is TimingMode.CUDA_GRAPH, name
        assert 0.3 * 792e12 <= flops / (result.median_us * 1e-6) <= 1.3 * 792e12, (name, result.median_us)


def test_time_over_floor_is_per_sample_over_its_rotations_floor():
    """At small T the rotated inputs hit different experts: each sample is set against the floor of the input it ran
    (sample i ran rotation i % n), not the median against the mean floor."""
    from moe2cta.serving_bench.runner import CaseResult, CaseStatus

    def case(**fields):
        base = dict(model="m", distribution="uniform", tokens=8, backend="auto", family="moe2cta",
                    status=CaseStatus.OK, reason="", experts_hit=7.5, floor_us=15.0, floor_bound="memory",
                    median_us=25.0)
        return CaseResult(**(base | fields))

    mixed = case(samples_us=(10.0, 40.0, 10.0, 40.0), rotation_floors_us=(10.0, 20.0))
    assert mixed.ratio == pytest.approx(1.5)  # per sample 1, 2, 1, 2; median / mean floor would say 25 / 15
    assert case(samples_us=(10.0, 40.0)).ratio == pytest.approx(25.0 / 15.0)  # no floors recorded: as before
    assert case(median_us=None).ratio is None


def test_check_rows_all_by_default_and_checked():
    from moe2cta.serving_bench.cli import _check_rows
    from moe2cta.serving_bench.correctness import sample_rows
    from moe2cta.serving_bench.runner import RunConfig

    assert _check_rows("all") is None and _check_rows("ALL") is None and _check_rows("64") == 64
    for bad in ("0", "-3", "some"):
        with pytest.raises(ValueError, match="--check-rows: expected 'all' or an int >= 1"):
            _check_rows(bad)
    assert RunConfig.__dataclass_fields__["check_rows"].default is None
    assert torch.equal(sample_rows(1000, None, "cpu"), torch.arange(1000))
    assert sample_rows(1000, 10, "cpu").tolist()[::9] == [0, 999]
    with pytest.raises(ValueError, match="check_rows: expected an int >= 1 or None"):
        RunConfig(models=(custom_preset(TINY),), sweep_tokens=(1,), distributions=(RoutingDistribution.parse("uniform"),),
                  backends=("torch-loop",), device=torch.device("cpu"), ceilings=DEFAULT_CEILINGS, check_rows=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_timing_returns_what_the_graph_replays_wrote():
    """Each rotation's graph output, after the rounds: NaN-filled, replayed once alone, it holds what that graph
    computes, and rows it never writes are NaN (the other rotation's replays, sharing the pool, cannot leave values in
    them); the check sees each right after its replay."""
    from moe2cta.serving_bench.timing import time_interleaved

    inputs = [(torch.randn(64, 32, device="cuda"),) for _ in range(2)]

    def half(x):  # writes only the first half of its output rows
        out = torch.empty_like(x)
        out[:32] = 2 * x[:32]
        return out

    out = time_interleaved({"double": lambda x: 2 * x, "half": half}, inputs, torch.device("cuda"), FAST_TIMING,
                           check=lambda name, rotation, output: (rotation, output.clone()))
    for name in ("double", "half"):
        assert out[name].mode is TimingMode.CUDA_GRAPH and out[name].rotations == 2
    assert (out["double"].first_rotation, out["half"].first_rotation) == (0, 1)
    x = inputs[0][0]
    assert torch.equal(out["double"].output, 2 * x)
    assert torch.equal(out["half"].output[:32], 2 * x[:32])
    assert out["half"].output[32:].isnan().all()
    # every rotation's graph, replayed alone after the rounds, checked right then
    for name in ("double", "half"):
        assert [rotation for rotation, _ in out[name].checks] == [0, 1]
        for rotation, seen in out[name].checks:
            assert torch.equal(seen[:32], 2 * inputs[rotation][0][:32])
    assert all(seen[32:].isnan().all() for _, seen in out["half"].checks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bench_reports_a_backend_whose_graph_replays_are_wrong(monkeypatch):
    """A backend right when called eagerly (the check before timing) but wrong inside its CUDA graph is reported
    WRONG from the output of its timed replays; the honest one beside it is OK, every row checked."""
    from moe2cta.serving_bench.runner import CaseStatus, RunConfig, run_benchmark

    base = BACKENDS["grouped-mm"]
    ok, why = base.availability(torch.device("cuda"))
    if not ok:
        pytest.skip(why)

    def build(preset, weights):
        real = base.build(preset, weights)

        def forward(hidden, logits):
            out = real(hidden, logits)
            return out * 1.5 if torch.cuda.is_current_stream_capturing() else out
        return forward

    monkeypatch.setitem(BACKENDS, "graph-wrong", dataclasses.replace(base, name="graph-wrong", build=build))
    run = RunConfig(models=(custom_preset("512,256,16,4"),), sweep_tokens=(8, 600),
                    distributions=(RoutingDistribution.parse("uniform"),), backends=("grouped-mm", "graph-wrong"),
                    device=torch.device("cuda"), ceilings=DEFAULT_CEILINGS, timing=FAST_TIMING)
    bench = run_benchmark(run)
    by = {(r.backend, r.tokens): r for r in bench.results}
    for tokens in (8, 600):
        assert by[("grouped-mm", tokens)].status is CaseStatus.OK, by[("grouped-mm", tokens)].reason
        wrong = by[("graph-wrong", tokens)]
        assert wrong.status is CaseStatus.WRONG
        assert re.match(r"timed graph replays( of rotated input \d+)?: relative error", wrong.reason), wrong.reason
    assert len(by[("grouped-mm", 8)].rotation_floors_us) >= 1
