"""Planner, tuning cache and `moe2cta plan` (CPU only; the compile-only test needs the CuTe DSL, no GPU).

The seed's numbers (shared/seed/000_d18911865dd1df39.txt): M,N,K = 384,4096,4096, a 2-CTA tile of
256x256x64 with 3 stages -> 32 tiles, 75.0% coverage, 96 KiB per CTA, 64 K segments; per stage 48 KiB
(1-CTA 128x256) vs 32 KiB (pair) per CTA, 96 vs 64 KiB for two CTAs, 8,388,608 FLOP, 85.3 -> 128 FLOP/B;
double-buffered 256-column accumulators use all 512 TMEM columns.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys

import pytest

from moe2cta import plan_cli, planner, tuning
from moe2cta.grouped_gemm.budget import ARCH_LIMITS, Arch, WorkUnit, input_bytes_per_stage
from moe2cta.presets import PRESETS, get_preset

KiB = 1024
SEED = planner.dense_problem(384, 4096, 4096)


def seed_candidate(block_k: int = 64, stages: int = 3) -> planner.Candidate:
    return planner.make_candidate("sm_100a", "pair", 256, 256, block_k, stages)


def _family(arch: Arch):
    name = {Arch.SM90: "sm90_grouped_gemm", Arch.SM100: "sm100_grouped_gemm"}[arch]
    try:
        return importlib.import_module(f"moe2cta.grouped_gemm.{name}")
    except ImportError:
        return None


# ------------------------------------------------------------------------------------------ the seed
def test_seed_calculator():
    b = planner.compute_budget(seed_candidate(), SEED)
    assert b.work_units == 32
    assert b.coverage == 0.75 and f"{b.coverage:.1%}" == "75.0%"
    assert b.input_buffer_bytes == 96 * KiB
    assert b.k_segments == 64


def test_seed_byte_table_and_intensity():
    assert input_bytes_per_stage(128, 256, 64, 2, WorkUnit.SINGLE, Arch.SM100) == 48 * KiB
    assert input_bytes_per_stage(256, 256, 64, 2, WorkUnit.PAIR, Arch.SM100) == 32 * KiB
    b = planner.compute_budget(seed_candidate(), SEED)
    assert (b.a_stage_bytes, b.b_stage_bytes, b.input_stage_bytes) == (16 * KiB, 16 * KiB, 32 * KiB)
    assert b.single_equivalent_stage_bytes == 48 * KiB
    assert 2 * b.single_equivalent_stage_bytes == 96 * KiB  # two independent 1-CTA tiles
    assert b.unit_smem_stage_bytes == 64 * KiB  # one pair
    assert b.flop_per_stage == 2 * 256 * 256 * 64 == 8_388_608
    assert f"{b.single_equivalent_intensity:.1f}" == "85.3"
    assert b.intensity_smem == 128.0 and b.intensity_l2 == 128.0


def test_seed_k_tile_and_tmem():
    b128 = planner.compute_budget(seed_candidate(block_k=128), SEED)
    assert b128.input_stage_bytes == 64 * KiB and b128.input_buffer_bytes == 192 * KiB
    b = planner.compute_budget(seed_candidate(), SEED)
    assert b.tmem_columns_per_slot == 256 and b.tmem_columns == 512 == b.tmem_limit
    assert 128 * b.tmem_columns_per_slot * 4 == 128 * KiB  # one slot: 128 lanes x 256 fp32


def test_cli_prints_seed_budget(capsys):
    rc = plan_cli.main(["--gemm", "384,4096,4096", "--tile", "256x256x64", "--stages", "3", "--pair",
                        "--arch", "sm_100a"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("output tiles     32 ", "75.0%", "3 stages x 32 KiB = 96 KiB per CTA", "K segments       64",
                 "8,388,608 FLOP", "85.3 FLOP/B", "128.0 FLOP/B", "96 KiB per stage", "512 of 512"):
        assert text in out, text


# ------------------------------------------------------------------------------------------ limits
def test_over_budget_smem_rejected_with_reason(capsys):
    ev = planner.evaluate(seed_candidate(block_k=128, stages=4), SEED)
    assert not ev.ok and ev.prediction is None
    assert ev.reason.startswith("SMEM") and "> 227 KiB" in ev.reason
    plan_cli.main(["--gemm", "384,4096,4096", "--tile", "256x256x128", "--stages", "4", "--pair", "--arch", "sm_100a"])
    assert "REJECTED         SMEM" in capsys.readouterr().out


def test_over_budget_tmem_and_stages_rejected():
    three_slots = planner.make_candidate("sm_100a", "single", 128, 256, 64, 2, accumulator_slots=3)
    ev = planner.evaluate(three_slots, SEED)
    assert not ev.ok and ev.reason.startswith("TMEM") and "> 512" in ev.reason
    one_stage = planner.make_candidate("sm_90a", "single", 128, 128, 64, 1)
    ev = planner.evaluate(one_stage, SEED)
    assert not ev.ok and ev.reason.startswith("stages")


def test_search_prunes_coverage_and_keeps_only_fitting():
    result = planner.search(SEED, "sm_100a")
    kinds = result.rejected_by_reason()
    assert "SMEM" in kinds and "coverage" in kinds
    # the seed's warning: the 256-row pair tile covers only 75% of M=384; a 128-row tile covers all of it
    assert any(ev.candidate.block_m == 256 and "coverage 75.0%" in ev.reason for ev in kinds["coverage"])
    assert result.chosen.budget.coverage == 1.0
    for ev in result.ranked:
        assert ev.ok and ev.prediction is not None
        assert ev.budget.smem_bytes <= ARCH_LIMITS[Arch.SM100].smem_per_cta
        assert ev.budget.tmem_alloc_columns <= 512
    for ev in result.rejected:
        assert not ev.ok and ev.reason
    times = [ev.prediction.seconds for ev in result.ranked]
    assert times == sorted(times)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("tokens", [1, 4096])
def test_plan_every_preset(arch, tokens):
    for name, preset in PRESETS.items():
        plan = planner.plan_moe(preset, tokens, arch)
        for result in (plan.gemm1, plan.gemm2):
            chosen = result.chosen
            assert chosen.ok and chosen.budget.smem_bytes <= chosen.budget.smem_limit, name
            assert result.problem.total_rows == tokens * preset.top_k
        json.dumps(plan.to_dict())  # machine output is plain JSON


def test_decode_and_prefill_choices():
    """sm_90a follows the H200's measurements (results/tuning-h200-2026-12-02, power-h200-2026-12-01): 128-row tiles
    at decode too (the one-warpgroup 64-row tile streams at 0.74-0.80 of their rate), SINGLE units at prefill (the
    card is at its power cap, PAIR units measured 0.95-1.20x the time). sm_100a keeps the seed's 2CTA pairs."""
    decode = planner.plan_moe(get_preset("qwen3-30b-a3b"), 1, "sm_90a")
    prefill = planner.plan_moe(get_preset("qwen3-30b-a3b"), 4096, "sm_90a")
    for result in (decode.gemm1, decode.gemm2):
        assert result.chosen.candidate.rows_per_cta == 128 and result.chosen.candidate.unit is WorkUnit.SINGLE
        assert result.chosen.prediction.bound == "hbm"  # weight streaming
    for result in (prefill.gemm1, prefill.gemm2):
        assert result.chosen.candidate.unit is WorkUnit.SINGLE and result.chosen.candidate.rows_per_cta == 128
        assert result.chosen.prediction.bound == "power"  # 256 rows per expert: the MMAs' energy at the 700 W cap
        assert result.chosen.budget.coverage == 1.0
    b200 = planner.plan_moe(get_preset("qwen3-30b-a3b"), 4096, "sm_100a")
    for result in (b200.gemm1, b200.gemm2):
        assert result.chosen.candidate.unit is WorkUnit.PAIR  # 256 rows per expert: pairs share B
        assert result.chosen.prediction.power_seconds == 0.0  # no power model without a B200 to measure


def test_power_model_names_bad_values():
    model = planner.HARDWARE[Arch.SM90].power
    assert model.seconds(1e12, 0) == pytest.approx(1e12 * model.joules_per_flop / (model.limit_watts - model.idle_watts))
    with pytest.raises(ValueError, match="idle_watts"):
        planner.PowerModel(limit_watts=100.0, idle_watts=150.0, joules_per_flop=1e-12, joules_per_hbm_byte=1e-11)
    with pytest.raises(ValueError, match="joules_per_flop"):
        planner.PowerModel(limit_watts=700.0, idle_watts=100.0, joules_per_flop=0.0, joules_per_hbm_byte=1e-11)


def test_sm90_first_picks_match_the_h200_tuning_runs():
    """On every bucket the H200 tuning runs measured (five presets, both GEMMs, routed rows), the planner's first pick
    for sm_90a is the family default the layer runs, which measured within 6% of the fastest candidate timed there
    (except mixtral-8x7b's bucket-128 GEMM2, where the layer runs the wide swapped-operand kernel instead)."""
    import pathlib

    runs = pathlib.Path(__file__).resolve().parents[1] / "serving_bench" / "results" / "tuning-h200-2026-12-02"
    files = sorted(runs.glob("run*/tune-*.json"))
    if not files:
        pytest.skip("the tuning results are not in this tree")
    checked = 0
    for path in files:
        data = json.loads(path.read_text())
        preset = get_preset(data["model"])
        for row in data["rows"]:
            kind = planner.GemmKind(row["gemm"])
            n, k = (2 * preset.intermediate, preset.hidden) if kind is planner.GemmKind.GEMM1 else (
                preset.hidden, preset.intermediate)
            problem = tuning.bucket_problem(kind, preset.num_experts, n, k, row["bucket"])
            first = planner.search(problem, "sm_90a").chosen.candidate
            assert first == tuning.family_default_candidate(problem, "sm_90a"), (data["model"], row["gemm"], row["bucket"])
            assert first.label() == row["default"]["label"]
            if (data["model"], row["gemm"], row["bucket"]) != ("mixtral-8x7b", "gemm2", 128):
                # within the tuner's run-to-run spread: at most 1.056x (deepseek-v3 GEMM2 bucket 1024 in run2, where
                # run1 timed the default fastest)
                assert row["default"]["us"] <= 1.06 * row["best"]["us"], (data["model"], row["gemm"], row["bucket"])
            checked += 1
    assert checked >= 30


def test_given_counts_and_bad_input():
    preset = get_preset("mixtral-8x7b")
    counts = [100, 0, 0, 0, 0, 0, 0, 28]
    g1, g2 = planner.moe_problems(preset, 64, counts)
    assert g1.counts == tuple(counts) and g1.experts_hit == 2 and "given counts" in g1.routing
    b = planner.compute_budget(planner.make_candidate("sm_90a", "single", 128, 256, 64, 3), g1)
    assert b.computed_rows == 256 and b.useful_rows == 128
    with pytest.raises(ValueError, match="counts"):
        planner.moe_problems(preset, 64, [1, 2])
    for wrong in ([100, 0, 0, 0, 0, 0, 0, 27], [129, 0, 0, 0, 0, 0, 0, -1]):  # 127 rows; a negative count
        with pytest.raises(ValueError, match="counts: expected rows >= 0 per expert summing to T x k = 64 x 2 = 128"):
            planner.moe_problems(preset, 64, wrong)
    with pytest.raises(ValueError, match="tokens"):
        planner.moe_problems(preset, -1)
    with pytest.raises(TypeError, match="unit"):
        planner.Candidate(Arch.SM90, "pair", 256, 128, 64, 3)
    with pytest.raises(ValueError, match="arch"):
        planner.make_candidate("sm_80", "pair", 256, 128, 64, 3)
    with pytest.raises(ValueError, match="m"):
        planner.dense_problem(0, 128, 128)
    with pytest.raises(ValueError, match="pair_threshold"):
        planner.make_candidate("sm_90a", "single", 128, 128, 64, 3, pair_threshold=64)
    assert planner.balanced_counts(10, 4) == (3, 3, 2, 2)


def test_routing_assumptions():
    assert planner.expected_experts_hit(1, 8, 128) == 8
    assert planner.expected_experts_hit(32, 8, 256) == 163  # 256 * (1 - (1 - 8/256)^32)
    assert planner.expected_experts_hit(4096, 8, 128) == 128 and planner.expected_experts_hit(0, 8, 128) == 0
    preset = get_preset("deepseek-v3")
    g1, _ = planner.moe_problems(preset, 32)
    assert g1.experts_hit == 163 and g1.total_rows == 256 and max(g1.counts) - min(c for c in g1.counts if c) <= 1
    assert "uniform random" in g1.routing
    b1, _ = planner.moe_problems(preset, 32, routing_assumption=planner.RoutingAssumption.BALANCED)
    assert b1.experts_hit == 256 and b1.total_rows == 256 and "balanced" in b1.routing
    with pytest.raises(TypeError, match="routing_assumption"):
        planner.moe_problems(preset, 32, routing_assumption="uniform")


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("arch", [Arch.SM90, Arch.SM100])
def test_planner_builds_kernel_configs(arch):
    module = _family(arch)
    if module is None:
        pytest.skip(f"the {arch.value} kernel family is not in this tree")
    plan = planner.plan_moe(get_preset("qwen3-30b-a3b"), 512, arch)
    for result in (plan.gemm1, plan.gemm2):
        config = result.chosen.kernel_config
        assert config is not None and type(config).__name__ in ("Sm90GemmConfig", "Sm100GemmConfig")


def _accepted(arch: Arch):
    problems = planner.moe_problems(get_preset("qwen3-30b-a3b"), 4096)
    for problem in problems:
        for ev in planner.search(problem, arch, min_coverage_ratio=0.0).ranked:
            yield ev, problem


def test_model_agrees_with_family_resource_models():
    sm100 = _family(Arch.SM100)
    sm90 = _family(Arch.SM90)
    if sm100 is None and sm90 is None:
        pytest.skip("no CuTe kernel family in this tree")
    checked = 0
    if sm100 is not None:
        for ev, problem in _accepted(Arch.SM100):
            _, fam_problem = planner._family_objects(sm100, ev.candidate, problem)
            use = sm100.resource_use(ev.kernel_config, fam_problem)
            assert use.smem_bytes == ev.budget.smem_bytes, ev.candidate.label()
            assert use.tmem_alloc_columns == ev.budget.tmem_alloc_columns
            checked += 1
    if sm90 is not None:
        for ev, _ in _accepted(Arch.SM90):
            family = sm90.smem_bytes(ev.kernel_config, ev.candidate.stages)
            # the family's model is a bound (alignment padding, metadata for up to 256 experts); the compile
            # matches the planner exactly (test_compiled_resource_use_matches_model)
            assert ev.budget.smem_bytes <= family <= ev.budget.smem_bytes + 6 * KiB, ev.candidate.label()
            checked += 1
    assert checked > 20


def _dsl_available() -> bool:
    try:
        from moe2cta.grouped_gemm.cute_runtime import dsl_available
    except ImportError:
        return False
    return dsl_available()


COMPILE_CASES = [  # (arch, unit, block_m, kind): both work units, both GEMMs, one compile each
    (Arch.SM100, "pair", 256, planner.GemmKind.GEMM2),
    (Arch.SM100, "single", 128, planner.GemmKind.GEMM1),
    (Arch.SM90, "pair", 256, planner.GemmKind.GEMM1),
    (Arch.SM90, "single", 64, planner.GemmKind.GEMM2),
]


@pytest.mark.skipif(not _dsl_available(), reason="nvidia-cutlass-dsl not installed (compile-only test)")
@pytest.mark.parametrize("arch,unit,block_m,kind", COMPILE_CASES, ids=lambda x: getattr(x, "value", str(x)))
def test_compiled_resource_use_matches_model(arch, unit, block_m, kind):
    """Compile for the arch on the CPU (no GPU): the launch's dynamic SMEM (and sm_100 TMEM) = the planner's."""
    module = _family(arch)
    if module is None:
        pytest.skip(f"the {arch.value} kernel family is not in this tree")
    n = 256
    counts = (256, 0, 0, 100) + (0,) * 196  # 200 experts: sm_90's SMEM copy of the offsets passes 1 KiB
    problem = planner.GemmProblem(kind.value, kind, n, 128, counts, "compile test",
                                  has_row_scale=kind is planner.GemmKind.GEMM2)
    cand = planner.make_candidate(arch, unit, block_m, 128, 64, 3)
    ev = planner.evaluate(cand, problem)
    assert ev.ok, ev.reason
    _, fam_problem = planner._family_objects(module, cand, problem)
    from moe2cta.grouped_gemm.sm100_grouped_gemm import _ir_launch_smem_bytes

    if arch is Arch.SM100:
        _, report = module.compile_kernel(ev.kernel_config, fam_problem, keep_ptx=True)
        assert report.smem_bytes == ev.budget.smem_bytes
        assert report.tmem_alloc_columns == ev.budget.tmem_alloc_columns
    else:
        compiled = module.compile_kernel(ev.kernel_config, fam_problem)
        assert _ir_launch_smem_bytes(str(compiled.ir_module)) == ev.budget.smem_bytes


# ------------------------------------------------------------------------------------------ CLI
def test_cli_model_plan_and_json(capsys):
    assert plan_cli.main(["plan", "--model", "qwen3-30b-a3b", "--tokens", "4096", "--arch", "sm_100a"]) == 0
    out = capsys.readouterr().out
    assert "gemm1" in out and "gemm2" in out and "chosen:" in out and "rejected:" in out and "runners-up" in out
    assert plan_cli.main(["--model", "qwen3-30b-a3b", "--tokens", "4096", "--arch", "sm_90a", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "qwen3-30b-a3b" and [g["gemm"] for g in data["gemms"]] == ["gemm1", "gemm2"]
    g1 = data["gemms"][0]
    assert g1["chosen"]["ok"] and g1["rejected"] and all(r["reason"] for r in g1["rejected"])
    assert g1["chosen"]["budget"]["smem_bytes"] <= 227 * KiB


def test_cli_bucket_table(capsys):
    assert plan_cli.main(["--model", "mixtral-8x7b", "--buckets", "256", "--arch", "sm_90a", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["buckets"]
    assert [r["bucket"] for r in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert all(r["gemm1"]["label"] and r["gemm2"]["predicted_us"] > 0 for r in rows)
    assert rows[0]["gemm1"]["candidate"]["block_m"] <= rows[-1]["gemm1"]["candidate"]["block_m"]
    assert plan_cli.main(["--model", "mixtral-8x7b", "--buckets", "64", "--arch", "sm_100a"]) == 0
    assert "distinct kernels" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(["--model", "mixtral-8x7b", "--buckets", "--tokens", "4"])
    assert exit_info.value.code == 2 and "--buckets goes with --model only" in capsys.readouterr().err


def test_cli_errors(capsys):
    for argv, named in ((["--model", "qwen3-30b-a3b"], "--model needs --tokens"),
                        (["--gemm", "384,4096,4096", "--stages", "3"], "give --tile too"),
                        (["--gemm", "384,4096"], "--gemm M,N,K: expected 3 integers"),
                        (["--model", "no-such-model", "--tokens", "1"], "no-such-model"),
                        (["--gemm", "10,4096,4096", "--pair-threshold", "5"], "give --tile too"),
                        (["--model", "qwen3-30b-a3b", "--buckets", "4", "--min-coverage", "2"],
                         "--min-coverage: expected a share in 0..1"),
                        (["--gemm", "384,4096,4096", "--min-coverage", "-0.5"], "--min-coverage")):
        with pytest.raises(SystemExit) as exit_info:
            plan_cli.main(argv)
        assert exit_info.value.code == 2 and named in capsys.readouterr().err, argv


def test_python_m_plan_cli():
    cmd = [sys.executable, "-m", "moe2cta.plan_cli", "--gemm", "384,4096,4096", "--tile", "256x256x64",
           "--stages", "3", "--pair", "--arch", "sm_100a", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    gemm = json.loads(run.stdout)["gemms"][0]
    assert gemm["budget"]["work_units"] == 32 and gemm["budget"]["input_buffer_bytes"] == 96 * KiB


def test_import_reads_no_environment_and_no_dsl():
    code = ("import sys, moe2cta.planner, moe2cta.tuning, moe2cta.plan_cli; "
            "assert 'cutlass' not in sys.modules and 'tvm_ffi' not in sys.modules")
    env = dict(os.environ, MOE2CTA_TUNING_CACHE="/nonexistent/dir/tuning.json")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr


# ------------------------------------------------------------------------------------------ tuning
def test_token_bucket():
    assert [tuning.token_bucket(x) for x in (0, 0.06, 1, 2, 3, 64, 65, 10**9)] == [1, 1, 1, 2, 4, 64, 128, 65536]
    with pytest.raises(ValueError):
        tuning.token_bucket(-1)
    with pytest.raises(TypeError):
        tuning.token_bucket(True)
    with pytest.raises(ValueError, match="bucket"):
        tuning.TuningKey("H200", "bfloat16", 128, 1536, 2048, "swiglu", 3)


KEY = tuning.TuningKey("NVIDIA H200", "bfloat16", 16, 512, 256, "swiglu", 1)


def test_cache_roundtrip_and_env_at_call_time(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    monkeypatch.setenv("MOE2CTA_TUNING_CACHE", str(path))
    cache = tuning.TuningCache()
    assert cache.path == path and len(cache) == 0
    cand = planner.make_candidate("sm_90a", "pair", 256, 128, 64, 4, pair_threshold=256)
    cache.put(tuning.TuningEntry(KEY.with_bucket(64), cand, 12e-6, 8, 15e-6, "2026-11-29T12:00:00Z"))
    cache.save()
    data = json.loads(path.read_text())
    assert data["format"] == "moe2cta-tuning" and list(data["entries"]) == [KEY.with_bucket(64).to_str()]
    again = tuning.TuningCache(path)
    entry = again.get(KEY.with_bucket(64))
    assert entry.candidate == cand and entry.seconds == 12e-6 and again.get(KEY) is None
    path.write_text("{not json")
    with pytest.raises(ValueError, match="t.json"):
        tuning.TuningCache(path)


def test_autotune_with_fake_timer(tmp_path):
    cache = tuning.TuningCache(tmp_path / "tune.json")
    problem = tuning.bucket_problem(planner.GemmKind.GEMM1, KEY.num_experts, KEY.n, KEY.k, 64)
    shapes = planner.best_per_shape(planner.search(problem, "sm_90a").ranked)[:4]
    assert len(shapes) >= 3
    target = shapes[2].candidate  # the model's third choice is the fastest on this "GPU"
    calls, log = [], []

    def runner(candidate, prob):
        assert prob.total_rows == 64 * KEY.num_experts  # the bucket's representative problem
        if candidate == shapes[1].candidate:
            raise RuntimeError("does not compile")  # skipped, not fatal
        return lambda: calls.append(candidate)

    def timer(fn):
        fn()
        return 5e-6 if calls[-1] == target else 9e-6

    results = tuning.autotune(KEY, planner.GemmKind.GEMM1, "sm_90a", runner, buckets=[64], top=4, timer=timer,
                              cache=cache, log=log.append)
    entry = results[64]
    assert entry.candidate == target and entry.seconds == 5e-6 and entry.heuristic_seconds == 9e-6
    assert any("does not compile" in line for line in log)
    reloaded = tuning.TuningCache(tmp_path / "tune.json")
    assert tuning.select_config(KEY.with_bucket(64), planner.GemmKind.GEMM1, "sm_90a", cache=reloaded) == (target, "tuned")
    cand, source = tuning.select_config(KEY.with_bucket(2), planner.GemmKind.GEMM1, "sm_90a", cache=reloaded)
    assert source == "heuristic" and cand.rows_per_cta == 128  # sm_90: 64-row tiles measured slower, even at decode


def test_autotune_refuses_during_graph_capture(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="captur"):
        tuning.autotune(KEY, planner.GemmKind.GEMM1, "sm_90a", lambda c, p: (lambda: None), buckets=[1],
                        timer=lambda fn: 1.0, cache=tuning.TuningCache(tmp_path / "x.json"))


def test_layer_configs_from_cache_or_heuristic(tmp_path):
    cache = tuning.TuningCache(tmp_path / "layer.json")
    dims = dict(hidden=2048, intermediate=768, num_experts=128)
    out = tuning.layer_configs("sm_90a", tokens_per_expert=300, cache=cache, **dims)
    ev1, source1 = out["gemm1"]
    assert source1 == "heuristic" and ev1.ok and ev1.candidate.unit is WorkUnit.SINGLE  # sm_90: pairs do not pay
    if _family(Arch.SM90) is not None:
        assert ev1.kernel_config == planner.to_kernel_config(ev1.candidate, tuning.bucket_problem(
            planner.GemmKind.GEMM1, 128, 1536, 2048, 512))
    # a tuned entry is used for its bucket (512 rows per expert) ...
    tuned = planner.make_candidate("sm_90a", "single", 128, 128, 64, 6)
    key2 = tuning.TuningKey("NVIDIA H200", "bfloat16", 128, 2048, 768, "plain_rowscale", 512)
    assert tuning.epilogue_name(planner.GemmKind.GEMM2, has_row_scale=True) == "plain_rowscale"
    cache.put(tuning.TuningEntry(key2, tuned, 1e-4))
    ev2, source2 = tuning.layer_configs("sm_90a", tokens_per_expert=400, cache=cache, **dims)["gemm2"]
    assert source2 == "tuned" and ev2.candidate == tuned
    # ... unless the current kernels reject it (a stale file): then the heuristic, with the reason
    stale = dataclasses.replace(tuned, block_n=80)  # an 80-wide output tile: no whole 32-column sub-tiles
    cache.put(tuning.TuningEntry(key2, stale, 1e-4))
    ev3, source3 = tuning.layer_configs("sm_90a", tokens_per_expert=400, cache=cache, **dims)["gemm2"]
    assert ev3.ok and source3.startswith("heuristic (cached") and ev3.candidate != stale


def test_cute_runner_builds_padded_inputs(monkeypatch):
    """The GPU runner's inputs, checked on the CPU with stand-in kernels (the real ones need a GPU)."""
    if _family(Arch.SM90) is None:
        pytest.skip("no sm_90a kernel family in this tree")
    torch = pytest.importorskip("torch")
    seen = {}

    def fake_gemm1(a, w, offsets, counts, activation, out=None, config=None):
        seen.update(a=a, w=w, offsets=offsets, counts=counts, out=out, config=config, activation=activation)

    def fake_gemm2(a, w, offsets, counts, row_scale=None, out=None, config=None):
        seen.update(a=a, w=w, row_scale=row_scale, out=out, config=config)

    monkeypatch.setattr(tuning, "_family_entry_points", lambda arch: (fake_gemm1, fake_gemm2, lambda w: w.flip(1)))
    runner = tuning.cute_runner(device="cpu")
    problem = planner.GemmProblem("g1", planner.GemmKind.GEMM1, 64, 32, (300, 0, 5), "test")
    cand = planner.make_candidate("sm_90a", "pair", 256, 64, 64, 3, pair_threshold=129)
    runner(cand, problem)()
    assert seen["offsets"].tolist() == [0, 512, 512, 768]  # padded to the 256-row pair tile
    assert seen["counts"].tolist() == [300, 0, 5] and seen["a"].shape == (768, 32)
    assert seen["out"].shape == (768, 32) and seen["w"].shape == (3, 64, 32)
    assert type(seen["config"]).__name__ == "Sm90GemmConfig" and seen["config"].pair_threshold == 129
    assert seen["a"].dtype == torch.bfloat16 and seen["a"].float().abs().sum() > 0
    problem2 = planner.GemmProblem("g2", planner.GemmKind.GEMM2, 64, 32, (3, 0, 5), "test", has_row_scale=True)
    runner(planner.make_candidate("sm_90a", "single", 64, 64, 64, 3), problem2)()
    assert seen["row_scale"].shape == (256,) and seen["out"].shape == (256, 64)


# ------------------------------------------------------------------------------------------ launches
SKEWED = (300,) * 8 + (20,) * 120  # 8 experts fill pairs, 120 do not (qwen3-30b-a3b: 128 experts)


def _mixed(arch: str, **fields) -> planner.Candidate:
    return dataclasses.replace(planner.make_candidate(arch, "pair", 256, 256, 64, 4, pair_threshold=129), **fields)


def test_sm100_mixed_pair_runs_as_two_launches():
    g1, _ = planner.moe_problems(get_preset("qwen3-30b-a3b"), 600, SKEWED)
    ev = planner.evaluate(_mixed("sm_100a"), g1)
    assert ev.ok and ev.num_launches == 2
    pair, single = ev.launches
    assert (pair.evaluation.candidate.unit, single.evaluation.candidate.unit) == (WorkUnit.PAIR, WorkUnit.SINGLE)
    assert (pair.rows_lo, pair.rows_hi, single.rows_lo, single.rows_hi) == (129, None, 0, 129)
    assert pair.problem.counts == (300,) * 8 + (0,) * 120 and single.problem.counts == (0,) * 8 + (20,) * 120
    pb, sb = pair.evaluation.budget, single.evaluation.budget
    assert sb.b_stage_bytes == 2 * pb.b_stage_bytes  # the SINGLE launch keeps all of B: its own layout
    assert pb.smem_bytes == ev.budget.smem_bytes < sb.smem_bytes <= sb.smem_limit
    for launch in ev.launches:  # waves per launch, summed for the candidate
        b = launch.evaluation.budget
        assert b.waves == -(-b.cta_tiles // b.num_sms)
    assert ev.budget.waves == pb.waves + sb.waves and pb.cta_tiles + sb.cta_tiles == ev.budget.cta_tiles
    # time: both launches, each with its own fill latency and launch overhead (one more than one kernel)
    hw = planner.HARDWARE[Arch.SM100]
    launch_seconds = [launch.evaluation.prediction.seconds for launch in ev.launches]
    assert ev.prediction.seconds == pytest.approx(sum(launch_seconds))
    assert ev.prediction.seconds == pytest.approx(planner.predict(ev.candidate, g1, ev.budget).seconds)
    bodies = sum(max(pr.sm_seconds, pr.hbm_seconds, pr.l2_seconds)
                 for pr in (x.evaluation.prediction for x in ev.launches))
    assert ev.prediction.seconds - bodies == pytest.approx(2 * (hw.load_latency_s + hw.launch_overhead_s))
    summary = ev.launch_summary()
    assert summary.startswith("2 launches: pair kernel pair 256x256x64 s4")
    assert ", single kernel single 128x256x64" in summary
    sm100 = _family(Arch.SM100)
    if sm100 is not None:  # each launch's SMEM/TMEM = the family's resource model of the config it launches
        _, fam_problem = planner._family_objects(sm100, ev.candidate, g1)
        assert pair.evaluation.kernel_config == ev.kernel_config
        assert single.evaluation.kernel_config == ev.kernel_config.single_fallback()
        for launch in ev.launches:
            use = sm100.resource_use(launch.evaluation.kernel_config, fam_problem)
            b = launch.evaluation.budget
            assert (use.smem_bytes, use.tmem_alloc_columns, use.tmem_columns) == (
                b.smem_bytes, b.tmem_alloc_columns, b.tmem_columns)
            assert use.stages == launch.evaluation.candidate.stages


def test_sm90_mixed_pair_is_one_launch():
    g1, _ = planner.moe_problems(get_preset("qwen3-30b-a3b"), 600, SKEWED)
    ev = planner.evaluate(_mixed("sm_90a", accumulator_slots=1), g1)
    assert ev.ok and ev.launches == () and ev.num_launches == 1 and ev.launch_summary() == "1 launch"
    assert ev.budget.pair_units == 8 * 2 * 6 and ev.budget.single_units == 120 * 6  # pair and single units, one kernel
    hw = planner.HARDWARE[Arch.SM90]
    pr = ev.prediction
    body = max(pr.sm_seconds, pr.hbm_seconds, pr.l2_seconds, pr.power_seconds)
    assert pr.power_seconds > 0 and pr.rate_factor == hw.pair_rate  # the H200's power cap; a PAIR candidate
    assert pr.seconds == pytest.approx(body / hw.pair_rate + hw.load_latency_s + hw.launch_overhead_s)
    assert ev.to_dict()["num_launches"] == 1 and "launches" not in ev.to_dict()


def test_sm100_single_launch_checked_against_its_own_limits():
    g1, _ = planner.moe_problems(get_preset("qwen3-30b-a3b"), 600, SKEWED)
    # 8 epilogue buffers (64 KiB): the PAIR layout (64 KiB stages) fits 2 stages, the SINGLE one (96 KiB) does not
    cand = _mixed("sm_100a", block_k=128, stages=2, epi_buffers=8)
    ev = planner.evaluate(cand, g1, use_kernels=False)
    pair, single = ev.launches
    assert pair.evaluation.ok and not single.evaluation.ok and not ev.ok
    assert ev.reason.startswith("stages") and ev.reason.endswith("(single launch)")
    stages = planner.fitting_stages(single.evaluation.candidate, single.problem)
    assert single.evaluation.candidate.stages == stages == 1
    assert planner.evaluate(dataclasses.replace(cand, pair_threshold=0), g1, use_kernels=False).ok  # pairs only: fits


def test_sm100_search_charges_the_second_launch():
    g1, _ = planner.moe_problems(get_preset("qwen3-30b-a3b"), 4096)  # 256 rows everywhere: the SINGLE launch is empty
    result = planner.search(g1, "sm_100a", min_coverage_ratio=0.0)
    hw = planner.HARDWARE[Arch.SM100]
    by_candidate = {ev.candidate: ev for ev in result.ranked}
    pairs = [(ev, by_candidate.get(dataclasses.replace(ev.candidate, pair_threshold=0))) for ev in result.ranked
             if ev.candidate.mixed]
    assert pairs and all(twin is not None for _, twin in pairs)
    for ev, twin in pairs:
        assert ev.launches[1].problem.experts_hit == 0
        second_launch = hw.load_latency_s + hw.launch_overhead_s
        assert ev.prediction.seconds == pytest.approx(twin.prediction.seconds + second_launch)
    assert not result.chosen.candidate.mixed


def test_cli_shows_both_launches(capsys):
    counts = ",".join(str(c) for c in SKEWED)
    args = ["--model", "qwen3-30b-a3b", "--tokens", "600", "--counts", counts, "--tile", "256x256x64", "--stages", "4",
            "--pair", "--pair-threshold", "129", "--arch", "sm_100a"]
    assert plan_cli.main(args + ["--json"]) == 0
    gemm = json.loads(capsys.readouterr().out)["gemms"][0]
    assert gemm["num_launches"] == 2 and gemm["launch_summary"].startswith("2 launches: pair kernel")
    assert [launch["candidate"]["unit"] for launch in gemm["launches"]] == ["pair", "single"]
    assert [launch["experts"] for launch in gemm["launches"]] == [8, 120]
    assert all(launch["budget"]["smem_bytes"] <= 227 * KiB for launch in gemm["launches"])
    from moe2cta import planner_report

    g1, _ = planner.moe_problems(get_preset("qwen3-30b-a3b"), 600, SKEWED)
    ev = planner.evaluate(_mixed("sm_100a"), g1)
    text = planner_report.format_launches(ev, plan_cli.format_budget)
    assert "launches         2 launches: pair kernel" in text and text.count("SMEM per CTA") == 2
    assert "launch 2 of 2: single kernel, experts with < 129 rows" in text
    assert planner_report.format_launches(planner.evaluate(_mixed("sm_90a", accumulator_slots=1), g1),
                                          plan_cli.format_budget) == ""
