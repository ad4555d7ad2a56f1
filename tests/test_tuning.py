"""`moe2cta tune` and the layer's tuned-config lookup (CPU; one compile-only test needs the DSL, one the GPU)."""
from __future__ import annotations

import json
import os
import pathlib

import pytest

from moe2cta import cli, planner, tune_cli, tuning
from moe2cta.grouped_gemm.budget import WorkUnit
from moe2cta.presets import custom_preset, get_preset

TINY = "custom:256,128,4,2"  # H, I, E, k: the smallest layer every candidate shape divides


def _family():
    try:
        from moe2cta.grouped_gemm import sm90_grouped_gemm
    except ImportError:
        return None
    return sm90_grouped_gemm


needs_family = pytest.mark.skipif(_family() is None, reason="grouped_gemm.sm90_grouped_gemm not importable")


# ------------------------------------------------------------------------------------------ build step
@needs_family
def test_plan_kernels_dedupes_m_free_keys():
    s90 = _family()
    preset = get_preset("qwen3-30b-a3b")
    one = tune_cli.plan_kernels(preset, "sm_90a", (1,), 6)
    many = tune_cli.plan_kernels(preset, "sm_90a", (1, 8, 64, 512, 4096), 6)
    uses = sum(len(k.uses) for k in many.values())
    assert len(many) < uses  # buckets share kernels: each is listed (and built) once
    assert set(one) <= set(many)
    # the decode buckets pick the same shapes, so bucket 8 adds no kernel to bucket 1
    assert set(tune_cli.plan_kernels(preset, "sm_90a", (1, 8), 6)) == set(one)
    for stem, pk in many.items():
        assert stem == pk.key.file_stem() and "n" in pk.key.to_json() and "m" not in pk.key.to_json()
        assert len({u[0] for u in pk.uses}) == 1  # a kernel belongs to one GEMM (its N, K, epilogue)
    # every bucket times the family default, which is the kernel the untuned layer runs
    for kind, n, k, fields in tune_cli.gemm_shapes(preset):
        problem = tuning.bucket_problem(kind, preset.num_experts, n, k, 64, **fields)
        family_problem = tuning.sm90_problem(problem)
        # (bucket 64: 64 rows on every expert, so the regular kernel with the family's schedule for 64 rows)
        default_stem = s90.kernel_key(s90.default_config(family_problem, rows_per_expert=64), family_problem).file_stem()
        assert any(u == (kind.value, 64, u[2]) and u[2].startswith("default") for u in many[default_stem].uses)


@needs_family
def test_candidates_to_time_roles_and_dedupe():
    problem = tuning.bucket_problem(planner.GemmKind.GEMM1, 128, 1536, 2048, 512)
    chosen = tuning.candidates_to_time(problem, "sm_90a", 6)
    roles = [r for r, _ in chosen]
    assert roles[0].startswith("default") and len(chosen) == len({c for _, c in chosen})
    assert sum("planner" in r for r in roles) == 6  # merged roles still count: "default = planner 5"
    assert tuning.family_default_candidate(problem, "sm_100a") is None
    with pytest.raises(ValueError, match="top"):
        tuning.candidates_to_time(problem, "sm_90a", 0)


# ------------------------------------------------------------------------------------------ run step
class StandInRunner:
    """Kernels are labels; one candidate computes the wrong thing and is also the 'fastest'."""

    def __init__(self, wrong_rank: int):
        self.wrong_rank = wrong_rank
        self.calls = []

    def _rank(self, candidate, problem):
        shapes = [c for _, c in tuning.candidates_to_time(problem, "sm_90a", 3)]
        return shapes.index(candidate)

    def __call__(self, candidate, problem):
        rank = self._rank(candidate, problem)
        return lambda: self.calls.append((problem.name, rank))

    def check(self, candidate, problem, fn):
        fn()
        if self._rank(candidate, problem) == self.wrong_rank:
            return False, "max error 3.1 > tolerance 0.01"
        return True, "max error 0.001"


@needs_family
def test_run_rejects_wrong_kernel_and_caches_the_fastest_right_one(tmp_path):
    runner = StandInRunner(wrong_rank=1)
    seconds = {0: 9e-6, 1: 1e-6, 2: 4e-6, 3: 6e-6}  # the wrong one would win on time

    def timer(fn):
        fn()
        return seconds[runner.calls[-1][1]]

    log = []
    rows, cache = tune_cli.run(TINY, "sm_90a", cache_path=tmp_path / "tune.json", buckets=(1, 64), top=3,
                               runner=runner, timer=timer, gpu="NVIDIA H200", log=log.append)
    assert len(rows) == 4 and {r["gemm"] for r in rows} == {"gemm1", "gemm2"}
    for r in rows:
        assert [w["detail"] for w in r["wrong"]] == ["max error 3.1 > tolerance 0.01"]
        assert r["best"]["us"] == pytest.approx(4.0) and r["default"]["us"] == pytest.approx(9.0)
        assert r["speedup_vs_default"] == pytest.approx(9 / 4)
    assert any("WRONG" in line for line in log)
    json.dumps(rows)  # --json writes these rows
    table = tune_cli.format_table(rows)
    assert "gemm1:" in table and "2.25x" in table
    # the cache holds the right fastest candidate per bucket and GEMM, never the wrong one
    reloaded = tuning.TuningCache(tmp_path / "tune.json")
    assert len(reloaded) == 4
    for entry in reloaded.entries.values():
        gated = entry.key.epilogue == "swiglu"
        kind = planner.GemmKind.GEMM1 if gated else planner.GemmKind.GEMM2
        fields = {} if gated else {"has_row_scale": True}
        problem = tuning.bucket_problem(kind, 4, entry.key.n, entry.key.k, entry.key.bucket, **fields)
        assert runner._rank(entry.candidate, problem) == 2 and entry.seconds == 4e-6


def test_bucket_problem_routed_rows():
    """BucketRows.ROUTED: the EQUAL problem's bucket * hit rows, spread by a seeded uniform draw (the same problem every
    run, another seed another spread); experts not hit stay empty; bad arguments are named."""
    pytest.importorskip("torch")
    g1 = planner.GemmKind.GEMM1
    equal = tuning.bucket_problem(g1, 128, 1536, 2048, 256)
    routed = tuning.bucket_problem(g1, 128, 1536, 2048, 256, rows="routed", seed=4)
    assert set(equal.counts) == {256} and sum(routed.counts) == sum(equal.counts)
    assert min(routed.counts) < 256 < max(routed.counts)  # the spread a random batch has (std ~16 rows here)
    assert max(abs(c - 256) for c in routed.counts) < 128
    assert routed == tuning.bucket_problem(g1, 128, 1536, 2048, 256, rows=tuning.BucketRows.ROUTED, seed=4)
    assert routed.counts != tuning.bucket_problem(g1, 128, 1536, 2048, 256, rows="routed", seed=5).counts
    assert routed.name.endswith("-routed") and "seed 4" in routed.routing
    few = tuning.bucket_problem(g1, 16, 256, 256, 8, experts_hit=3, rows="routed")
    assert sum(few.counts) == 24 and few.counts[3:] == (0,) * 13
    with pytest.raises(ValueError, match="^rows: expected one of"):
        tuning.bucket_problem(g1, 16, 256, 256, 8, rows="skewed")
    with pytest.raises(ValueError, match="^seed"):
        tuning.bucket_problem(g1, 16, 256, 256, 8, rows="routed", seed=1.5)


@needs_family
def test_autotune_times_routed_rows_on_the_equal_problems_candidates(tmp_path):
    """rows=ROUTED: the candidates (and so the bundle) are those of the EQUAL problem, each timed on the routed one;
    the cache entry says which rows it was timed on, and entries without that field read as EQUAL."""
    pytest.importorskip("torch")
    seen = []

    def runner(candidate, problem):
        seen.append((candidate, problem))
        return lambda: None

    key = tuning.TuningKey("NVIDIA H200", "bfloat16", 128, 1536, 2048, "swiglu", 1)
    cache = tuning.TuningCache(tmp_path / "routed.json")
    results = tuning.autotune(key, planner.GemmKind.GEMM1, "sm_90a", runner, buckets=(256,), top=3,
                              timer=lambda fn: 1e-5, cache=cache, rows="routed")
    equal = tuning.bucket_problem(planner.GemmKind.GEMM1, 128, 1536, 2048, 256)
    planned = [c for _, c in tuning.candidates_to_time(equal, "sm_90a", 3)]
    assert [c for c, _ in seen] == planned
    assert all(p.name.endswith("-routed") and sum(p.counts) == sum(equal.counts) and len(set(p.counts)) > 1
               for _, p in seen)
    assert results[256].rows == "routed"
    reloaded = tuning.TuningCache(tmp_path / "routed.json")
    assert next(iter(reloaded.entries.values())).rows == "routed"
    legacy = results[256].to_json()
    del legacy["rows"]
    assert tuning.TuningEntry.from_json(legacy).rows == "equal"
    with pytest.raises(ValueError, match="^rows"):
        tuning.autotune(key, planner.GemmKind.GEMM1, "sm_90a", runner, buckets=(256,), top=3,
                        timer=lambda fn: 1e-5, cache=cache, rows="zipf")


@needs_family
def test_tune_run_passes_routed_rows(tmp_path, capsys):
    pytest.importorskip("torch")
    problems = []

    def runner(candidate, problem):
        problems.append(problem)
        return lambda: None

    rows, _ = tune_cli.run(TINY, "sm_90a", cache_path=tmp_path / "t.json", buckets=(64,), top=1, runner=runner,
                           timer=lambda fn: 1e-5, gpu="X", rows="routed")
    assert len(rows) == 2 and problems and all(p.name.endswith("-routed") for p in problems)
    with pytest.raises(SystemExit) as exit_info:
        tune_cli.main(["run", "--model", TINY, "--arch", "sm_90a", "--rows", "zipf"])
    assert exit_info.value.code == 2 and "--rows" in capsys.readouterr().err


@needs_family
@pytest.mark.parametrize("kind", [planner.GemmKind.GEMM1, planner.GemmKind.GEMM2])
def test_cute_runner_check_against_the_twin_on_cpu(monkeypatch, kind):
    """The real CuteRunner (inputs, twin, tolerance) with stand-in kernels on the CPU: right passes, wrong fails."""
    torch = pytest.importorskip("torch")
    from moe2cta.grouped_gemm import reference as twin

    runner = tuning.cute_runner(device="cpu", seed=3, align=128)
    state = {"corrupt": False}

    def gemm1(a, packed, ro, cn, activation, b13=None, out=None, config=None, kernel_directory=None):
        t = runner.inputs(problem, None)
        twin.grouped_gemm1_reference(a, t["w"], ro, cn, activation, b13=b13, out=out)
        if state["corrupt"]:
            out[int(ro[1]) + 1, 3] += 1.0  # one element of one valid row
        return out

    def gemm2(a, w2, ro, cn, row_scale=None, b2=None, out=None, config=None, kernel_directory=None):
        twin.grouped_gemm2_reference(a, w2, ro, cn, row_scale=row_scale, b2=b2, out=out)
        if state["corrupt"]:
            out[int(ro[1]) + 1, 3] += 1.0
        return out

    monkeypatch.setattr(tuning, "_family_entry_points", lambda arch: (gemm1, gemm2, _family().prepack_w13))
    n, k = (256, 256) if kind is planner.GemmKind.GEMM1 else (256, 128)
    fields = {"has_row_scale": True} if kind is planner.GemmKind.GEMM2 else {}
    problem = tuning.bucket_problem(kind, 4, n, k, 8, experts_hit=3, dtype="float16", **fields)
    (_, candidate), *_ = tuning.candidates_to_time(problem, "sm_90a", 1)
    fn = runner(candidate, problem)
    t = runner.inputs(problem)
    assert t["a"].shape == (3 * 128, k) and t["row_offsets"].tolist() == [0, 128, 256, 384, 384]
    ok, detail = runner.check(candidate, problem, fn)
    assert ok, detail
    state["corrupt"] = True
    ok, detail = runner.check(candidate, problem, fn)
    assert not ok and "tolerance" in detail
    assert runner.inputs(problem) is t  # inputs and the twin are made once per problem


def test_run_refuses_during_graph_capture(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="captur"):
        tune_cli.run(TINY, "sm_90a", cache_path=tmp_path / "x.json", buckets=(1,), top=1,
                     runner=lambda c, p: (lambda: None), timer=lambda fn: 1.0, gpu="X")


def test_cli_registration_and_argument_errors(capsys):
    assert "tune" in cli.SUBCOMMANDS
    with pytest.raises(SystemExit):
        tune_cli.main(["run", "--model", TINY, "--arch", "sm_90a", "--buckets", "3"])
    assert "powers of two" in capsys.readouterr().err
    with pytest.raises(ValueError, match="arch"):
        tune_cli.plan_kernels(custom_preset("256,128,4,2"), "sm_100a", (1,), 1)


# ------------------------------------------------------------------------------------------ layer lookup
def test_layer_bucket():
    assert tuning.layer_bucket(0, 8, 128) == 1
    assert tuning.layer_bucket(1, 8, 128) == 1  # 8 rows on 8 experts
    assert tuning.layer_bucket(8192, 8, 128) == 512
    assert tuning.layer_bucket(100, 8, 128) == 8  # 800 rows over the ~127 experts hit
    with pytest.raises(ValueError, match="top_k"):
        tuning.layer_bucket(4, 0, 128)


@needs_family
def test_kernel_configs_for_layer_tuned_vs_default(tmp_path):
    s90 = _family()
    dims = dict(hidden=2048, intermediate=768, num_experts=128, top_k=8)
    assert tuning.kernel_configs_for_layer("sm_90a", num_tokens=8192, cache=None, **dims) == (
        None, None, "default (no tuning cache)")
    cache = tuning.TuningCache(tmp_path / "layer.json")
    tuned = planner.make_candidate("sm_90a", "single", 64, 128, 64, 6)
    key1 = tuning.TuningKey("NVIDIA H200", "bfloat16", 128, 1536, 2048, "swiglu", 512)
    cache.put(tuning.TuningEntry(key1, tuned, 1e-4))
    cache.save()
    cache = tuning.TuningCache(tmp_path / "layer.json")  # round trip through the file
    g1, g2, source = tuning.kernel_configs_for_layer("sm_90a", num_tokens=8192, cache=cache, gpu="NVIDIA H200", **dims)
    # the tuned tile with the family's GEMM1 schedule (DYNAMIC, EXPERT_GROUPED_M; SKIP only on 128-row tiles)
    assert g1 == s90.Sm90GemmConfig(tile_m=64, tile_n=128, tile_k=64, stages=6, work_unit=WorkUnit.SINGLE, pair_threshold=0,
                                    scheduler=s90.Scheduler.DYNAMIC, raster=s90.Raster.EXPERT_GROUPED_M,
                                    raster_group_m=s90.GROUPED_RASTER_GROUP_M, padding_rows=s90.PaddingRows.MULTIPLY,
                                    epilogue_store=s90.EpilogueStore.UNDER_NEXT_MAINLOOP)
    assert g2 is None and source == "gemm1 tuned (bucket 512); gemm2 default (bucket 512 not tuned)"
    # another GPU's or another bucket's entries are not used
    assert tuning.kernel_configs_for_layer("sm_90a", num_tokens=8192, cache=cache, gpu="NVIDIA H100", **dims)[:2] == (None, None)
    assert tuning.kernel_configs_for_layer("sm_90a", num_tokens=16, cache=cache, gpu="NVIDIA H200", **dims)[:2] == (None, None)
    # a put() is seen despite the memo; both tuned -> source "tuned (bucket 512)"
    key2 = tuning.TuningKey("NVIDIA H200", "bfloat16", 128, 2048, 768, "plain_rowscale", 512)
    cache.put(tuning.TuningEntry(key2, planner.make_candidate("sm_90a", "pair", 256, 256, 64, 4, pair_threshold=129), 1e-4))
    g1, g2, source = tuning.kernel_configs_for_layer("sm_90a", num_tokens=8192, cache=cache, gpu="NVIDIA H200", **dims)
    assert source == "tuned (bucket 512)" and g2.work_unit is WorkUnit.PAIR and g2.pair_threshold == 129
    # router weight on the input: GEMM2's epilogue is "plain", not tuned -> default
    assert tuning.kernel_configs_for_layer("sm_90a", num_tokens=8192, cache=cache, gpu="NVIDIA H200",
                                           gemm2_row_scale=False, **dims)[1] is None
    # a stale entry (a tile the kernels reject) falls back to the default with the reason
    stale = planner.make_candidate("sm_90a", "single", 128, 80, 64, 4)  # no whole 32-column epilogue sub-tiles
    cache.put(tuning.TuningEntry(key2, stale, 1e-4))
    g1, g2, source = tuning.kernel_configs_for_layer("sm_90a", num_tokens=8192, cache=cache, gpu="NVIDIA H200", **dims)
    assert g2 is None and "rejected" in source
    with pytest.raises(ValueError, match="dtype"):
        tuning.kernel_configs_for_layer("sm_90a", num_tokens=1, cache=cache, dtype="float32", **dims)


@needs_family
def test_layer_runs_the_default_where_the_tuned_entry_is_the_default(tmp_path):
    """A cached entry that is the family default's kernel for the batch is passed on as None (the default: GEMM1
    then reads the token rows where that pays); another tuned kernel is kept; a swapped-operand default wins."""
    from moe2cta import api

    s90 = _family()
    preset = get_preset("qwen3-30b-a3b")
    dims = dict(hidden=preset.hidden, intermediate=preset.intermediate, num_experts=preset.num_experts,
                top_k=preset.top_k)
    problems = tuple(tune_cli.gemm_shapes(preset))
    fam = tuple(tuning.sm90_problem(tuning.bucket_problem(kind, preset.num_experts, n, k, 512, **fields))
                for kind, n, k, fields in problems)
    cache = tuning.TuningCache(tmp_path / "c.json")
    for (kind, n, k, fields), fam_problem in zip(problems, fam):
        bucket_problem = tuning.bucket_problem(kind, preset.num_experts, n, k, 512, **fields)
        default = tuning.family_default_candidate(bucket_problem, "sm_90a")
        other = planner.make_candidate("sm_90a", "pair", 256, 256, 64, 4, pair_threshold=129)
        winner = default if kind is planner.GemmKind.GEMM1 else other
        key = tuning.TuningKey("NVIDIA H200", "bfloat16", preset.num_experts, n, k,
                               tuning.epilogue_name(kind, **fields), 512)
        cache.put(tuning.TuningEntry(key, winner, 1e-4))
    tokens = 512 * preset.num_experts // preset.top_k  # 512 rows per expert
    g1, g2, source = tuning.kernel_configs_for_layer("sm_90a", num_tokens=tokens, cache=cache, gpu="NVIDIA H200",
                                                     **dims)
    assert source == "tuned (bucket 512)" and g1 is not None and g2.work_unit is WorkUnit.PAIR
    rows = tokens * preset.top_k / preset.num_experts
    default1 = s90.default_config(fam[0], rows_per_expert=rows)
    assert g1 != default1  # stages resolved, pair_threshold 0: equal as a kernel run, not as a dataclass
    assert s90.kernel_key(g1, fam[0]) == s90.kernel_key(default1, fam[0]) and g1.work_unit is WorkUnit.SINGLE
    assert api._sm90_tuned_configs(s90, fam, (g1, g2), rows) == (None, g2)
    assert api._sm90_tuned_configs(s90, fam, (None, None), rows) == (None, None)
    # one row per expert: the swapped-operand decode kernel is the default, whatever the cache holds
    assert s90.default_overrides_tuning(fam[0], 1.0)
    assert api._sm90_tuned_configs(s90, fam, (g1, g2), 1.0) == (None, None)


@needs_family
def test_kernel_configs_for_layer_accepts_torch_dtype_and_activation(tmp_path):
    torch = pytest.importorskip("torch")
    cache = tuning.TuningCache(tmp_path / "c.json")
    key = tuning.TuningKey("G", "float16", 4, 256, 256, "gelu_gated", 1)
    cache.put(tuning.TuningEntry(key, planner.make_candidate("sm_90a", "single", 64, 64, 64, 4), 1e-5))
    g1, g2, _ = tuning.kernel_configs_for_layer("sm_90a", 256, 128, 4, 2, 1, "gelu_gated", False, torch.float16,
                                                cache, gpu="G")
    assert g1.tile_n == 64 and g2 is None


# ------------------------------------------------------------------------------------------ compile / GPU
def test_tune_build_compiles_a_tiny_bundle(tmp_path):
    from moe2cta.grouped_gemm.cute_runtime import dsl_available

    if not dsl_available() or _family() is None:
        pytest.skip("the CuTe DSL (nvidia-cutlass-dsl) is not installed")
    out = tmp_path / "bundle"
    assert tune_cli.main(["build", "--model", TINY, "--arch", "sm_90a", "--out", str(out), "--top", "1",
                          "--buckets", "1"]) == 0
    planned = tune_cli.plan_kernels(custom_preset(TINY[len("custom:"):]), "sm_90a", (1,), 1)
    libs = {p.stem for p in out.glob("*.so")}
    assert set(planned) <= libs and len(libs) >= len(planned)
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(planned) <= set(manifest)


@pytest.mark.gpu
@pytest.mark.parametrize("bucket_rows", ["equal", "routed"])
def test_tune_run_on_gpu_with_bundle(tmp_path, bucket_rows):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"`moe2cta tune` times sm_90a kernels; this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    directory = os.environ.get("MOE2CTA_KERNEL_DIR")
    planned = tune_cli.plan_kernels(custom_preset(TINY[len("custom:"):]), "sm_90a", (1, 64), 2)
    if not directory:
        pytest.skip(f"MOE2CTA_KERNEL_DIR unset (build: moe2cta tune build --model {TINY} --arch sm_90a "
                    "--buckets 1 64 --top 2 --out DIR)")
    missing = [s for s in planned if not (pathlib.Path(directory) / f"{s}.so").exists()]
    if missing:
        pytest.skip(f"{len(missing)} kernels missing from {directory} (moe2cta tune build --model {TINY} "
                    f"--arch sm_90a --buckets 1 64 --top 2 --out {directory})")
    out_json, cache_path = tmp_path / "rows.json", tmp_path / "tune.json"
    assert tune_cli.main(["run", "--model", TINY, "--arch", "sm_90a", "--buckets", "1", "64", "--top", "2",
                          "--kernel-dir", directory, "--cache", str(cache_path), "--json", str(out_json),
                          "--rows", bucket_rows]) == 0
    report = json.loads(out_json.read_text())
    rows = report["rows"]
    assert report["bucket_rows"] == bucket_rows
    assert len(rows) == 4
    for r in rows:
        assert not r["wrong"] and not r["failed"], r
        assert r["best"]["us"] > 0 and r["speedup_vs_default"] >= 1.0
    cache = tuning.TuningCache(cache_path)
    assert len(cache) == 4 and {e.rows for e in cache.entries.values()} == {bucket_rows}
    g1, g2, source = tuning.kernel_configs_for_layer("sm_90a", 256, 128, 4, 2, 1, cache=cache)
    assert source == "tuned (bucket 1)" and g1 is not None and g2 is not None


def test_a_corrupt_tuning_cache_names_the_file_and_the_entry(tmp_path):
    path = tmp_path / "tuning.json"
    good = tuning.TuningCache(path)
    key = tuning.TuningKey("NVIDIA H200", "bfloat16", 128, 1536, 2048, "swiglu", 512)
    good.put(tuning.TuningEntry(key, planner.make_candidate("sm_90a", "single", 128, 256, 64, 4), 1e-4))
    data = good.to_json()
    path.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ValueError, match=f"tuning cache {path}: unreadable"):
        tuning.TuningCache(path)
    for entries in ([1], None):
        path.write_text(json.dumps(data | {"entries": entries}))
        with pytest.raises(ValueError, match=f"tuning cache {path}: 'entries' is a"):
            tuning.TuningCache(path)
    for field, value in (("seconds", "abc"), ("tried", "x"), ("key", {**data["entries"][key.to_str()]["key"],
                                                                       "num_experts": 0})):
        entry = dict(data["entries"][key.to_str()], **{field: value})
        path.write_text(json.dumps(data | {"entries": {key.to_str(): entry}}))
        with pytest.raises(ValueError, match=f"tuning cache {path}: entry '{key.to_str()}'"):
            tuning.TuningCache(path)


def test_two_runs_saving_one_cache_keep_each_others_entries(tmp_path):
    """Two tuning runs (two models, or two GPUs' processes) that load one file and save it in turn: the second save
    merges over what the first wrote instead of replacing it; its own entries win where both tuned a key."""
    path = tmp_path / "tuning.json"

    def entry(n, seconds):
        key = tuning.TuningKey("NVIDIA H200", "bfloat16", 8, n, 1024, "swiglu", 64)
        return tuning.TuningEntry(key, planner.make_candidate("sm_90a", "single", 128, 128, 64, 4), seconds)

    first, second = tuning.TuningCache(path), tuning.TuningCache(path)  # both loaded the (absent) file
    first.put(entry(1024, 1e-4))
    first.put(entry(2048, 2e-4))
    second.put(entry(2048, 3e-4))
    second.put(entry(4096, 4e-4))
    first.save()
    version = second.version
    second.save()
    saved = tuning.TuningCache(path)
    assert sorted(e.key.n for e in saved.entries.values()) == [1024, 2048, 4096]
    assert {e.key.n: e.seconds for e in saved.entries.values()}[2048] == 3e-4
    assert len(second) == 3 and second.version > version  # memoized lookups see the merged entries
    assert path.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600


@needs_family
def test_another_familys_entry_is_not_served(tmp_path):
    """An entry whose candidate is an sm_100a configuration (a merged or hand-edited file) in an sm_90a lookup: the
    family default with the reason, never the other family's config object."""
    cache = tuning.TuningCache(tmp_path / "t.json")
    key = tuning.TuningKey("NVIDIA H200", "bfloat16", 128, 1536, 2048, "swiglu", 512)
    cache.put(tuning.TuningEntry(key, planner.make_candidate("sm_100a", "pair", 256, 256, 64, 4), 1e-4))
    g1, g2, source = tuning.kernel_configs_for_layer("sm_90a", 2048, 768, 128, 8, 8192, cache=cache, gpu="NVIDIA H200")
    assert g1 is None and "is a sm_100a configuration, expected sm_90a" in source
    candidate, how = tuning.select_config(key, planner.GemmKind.GEMM1, "sm_90a", cache=cache)
    assert how == "heuristic" and candidate.arch is planner.Arch.SM90


def test_tuning_arguments_are_named():
    with pytest.raises(ValueError, match="top_k: expected at most num_experts"):
        tuning.layer_bucket(4, 9, 8)
    for name, dims in (("hidden", dict(hidden=0, intermediate=768)), ("intermediate", dict(hidden=2048, intermediate=-1))):
        with pytest.raises(ValueError, match=f"^{name}: expected an int >= 1"):
            tuning.kernel_configs_for_layer("sm_90a", num_experts=8, top_k=2, num_tokens=4, **dims)
    with pytest.raises(ValueError, match="tokens_per_expert: expected a finite number"):
        tuning.token_bucket(float("inf"))
    for bucket in (0, 3):
        with pytest.raises(ValueError, match="bucket: expected a power of two"):
            tuning.bucket_problem(planner.GemmKind.GEMM1, 8, 256, 128, bucket)
