"""CPU tests of the benchmark's tools beside the layer grid: the prefill GEMM bench, the probes (layer profile,
host overhead, padding, placement, L2 sides), layer_runs' tables, the permute and router benches."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics

import pytest
import torch

from moe2cta import RoutingConfig
from moe2cta.presets import PRESETS, custom_preset
from moe2cta.serving_bench import backends as backends_mod
from moe2cta.serving_bench.backends import BACKENDS, BackendFamily


# ------------------------------------------------------------------------------------------ prefill GEMM bench
def test_prefill_bench_variants_are_implementable_and_distinct():
    """Every CuTe variant the prefill bench times exists for every preset, and each is its own kernel
    (so `--build` compiles them and the timings compare different code)."""
    from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
    from moe2cta.serving_bench import prefill_gemm_bench as pgb

    for preset in PRESETS.values():
        for problem in pgb.problems_of(preset):
            for rows in (64, 1024):
                variants = pgb.variant_configs(problem, rows)
                assert variants["default"] == s90.default_config(problem, rows_per_expert=rows)
                assert variants["regular"] == s90.regular_config(problem, rows_per_expert=rows)
                for name, cfg in variants.items():
                    if cfg is None:  # a wide tile of 256 weight rows where N is no multiple of 256 (gpt-oss), or
                        # a 128-wide regular tile where N is no multiple of 128, or split tails whose output slices
                        # would be narrower than 16 columns (gpt-oss GEMM1: 96-column output tiles), or a default GEMM1
                        # that cannot read the token rows (a wide tile other than the 160-row one)
                        assert (name.startswith("wide128_n256") and problem.n % 256) or (
                            name == "token_rows_default" and variants["default"].wide) or (
                            name == "tile_n128" and problem.n % 128) or (
                            name == "tile_n256_tail" and problem.n % 256 == 0) or (
                            name == "split_tail" and problem.kind is s90.GemmStage.GEMM1
                            and variants["regular"].tile_n % 128), (preset.name, name)
                        continue
                    assert s90.can_implement(cfg, problem) == (True, ""), (preset.name, name)
                # distinct kernels apart from the aliases (the layer's choice, its regular-kernel choice, and GEMM2 of
                # the token-rows variant, which is the regular one)
                assert variants["token_rows"] == (
                    s90.token_rows_config(problem, rows) if problem.kind is s90.GemmStage.GEMM1 else variants["regular"])
                aliases = ("default", "regular") + (
                    ("token_rows", "token_rows_store_after", "activation_under", "token_rows_activation_under",
                     "tile_n256_tail")
                    if problem.kind is s90.GemmStage.GEMM2 else ())
                # variants that name another's kernel: GEMM1's default is expert-grouped with SKIP (v15); GEMM2's
                # default already skips, so its *_skip variants are the plain ones
                # (GEMM1 above GEMM1_EXPERT_GROUPED_MAX_ROWS: GROUPED_M 8 with MULTIPLY, as before v15)
                expert_grouped = rows <= s90.GEMM1_EXPERT_GROUPED_MAX_ROWS
                same = (({"expert_grouped8_skip": "regular", "token_rows_expert_grouped8_skip": "token_rows",
                          "padding_flip": "expert_grouped8_dynamic", "previous_gemm1": "dynamic"} if expert_grouped
                         else {"previous_gemm1": "regular", "grouped8_dynamic": "regular"})
                        if problem.kind is s90.GemmStage.GEMM1 else
                        {"expert_grouped8_skip": "expert_grouped8_dynamic", "pair_skip": "pair",
                         "token_rows_expert_grouped8_skip": "expert_grouped8_dynamic", "previous_gemm1": "regular",
                         "pair_dynamic_skip": "pair_dynamic", "pair_grouped4_dynamic_skip": "pair_grouped4_dynamic"})
                for name, twin in same.items():
                    assert variants[name] == variants[twin], (preset.name, problem.kind, name)
                aliases += tuple(same)
                # the regular choice rescheduled STATIC (and with MULTIPLY padding rows) is another variant's kernel
                # where that choice is ALONG_N ("static", the v5 default) or GROUPED_M 8 ("grouped8_static"), or
                # already MULTIPLY
                static = dataclasses.replace(variants["regular"], scheduler=s90.Scheduler.STATIC)
                assert variants["regular_static"] == static
                assert variants["regular_static_multiply"] == dataclasses.replace(
                    static, padding_rows=s90.PaddingRows.MULTIPLY)
                for name in ("regular_static", "regular_static_multiply"):
                    if any(variants[name] == variants[other] for other in ("static", "grouped8_static", "regular_static")
                           if other != name):
                        aliases += (name,)
                assert variants["store_after"] == dataclasses.replace(
                    variants["regular"], epilogue_store=s90.EpilogueStore.AFTER_MAINLOOP)
                # DYNAMIC_SIDES: the regular choice (and GEMM1's token rows) with the unit order split by L2 side; GEMM2
                # of the token-rows variant is the regular one's
                sides = s90.Scheduler.DYNAMIC_SIDES
                assert variants["regular_sides"] == dataclasses.replace(variants["regular"], scheduler=sides)
                if problem.kind is s90.GemmStage.GEMM2:
                    assert variants["token_rows_sides"] == variants["regular_sides"]
                    aliases += ("token_rows_sides",)
                elif variants["token_rows"] is not None:
                    assert variants["token_rows_sides"] == dataclasses.replace(variants["token_rows"], scheduler=sides)
                if problem.kind is s90.GemmStage.GEMM1:
                    assert variants["activation_under"] == dataclasses.replace(
                        variants["regular"], epilogue_store=s90.EpilogueStore.ACTIVATION_UNDER_NEXT_MAINLOOP)
                # the default GEMM1 on the token rows (the token_rows variant where the default is the regular kernel;
                # GEMM2: the default)
                assert variants["token_rows_default"] == (s90.token_rows_twin(variants["default"], problem)
                                                          if problem.kind is s90.GemmStage.GEMM1 else variants["default"])
                if any(variants["token_rows_default"] == variants[other] for other in ("token_rows", "default")):
                    aliases += ("token_rows_default",)
                stems = [s90.kernel_key(c, problem).file_stem() for n, c in variants.items()
                         if n not in aliases and c is not None]
                assert len(set(stems)) == len(stems), (preset.name, problem.kind)
                # the regular choice is one of the alternatives (GEMM2 at 64 rows: DYNAMIC ALONG_N, at 1024: GROUPED_M
                # 8; GEMM1: expert-grouped with SKIP), and the layer's choice is it or the wide kernel (few experts at
                # 64 rows: mixtral)
                if problem.kind is s90.GemmStage.GEMM2 or not expert_grouped:
                    assert variants["regular"] == variants["dynamic" if rows == 64 else "grouped8_dynamic"]
                else:
                    assert (variants["regular"].raster, variants["regular"].padding_rows) == (
                        s90.Raster.EXPERT_GROUPED_M, s90.PaddingRows.SKIP)
                wide_default = problem.num_experts <= s90.WIDE_MAX_EXPERTS and rows == 64
                assert variants["default"] == (variants["wide"] if wide_default else variants["regular"])


def test_prefill_bench_rejects_a_malformed_bundle(capsys):
    from moe2cta.serving_bench import prefill_gemm_bench as pgb

    with pytest.raises(SystemExit):
        pgb.main(["--bundle", "no-equals-sign"])
    assert "LABEL=DIR" in capsys.readouterr().err


def test_prefill_bench_rejects_an_unknown_variant(capsys):
    from moe2cta.serving_bench import prefill_gemm_bench as pgb

    with pytest.raises(SystemExit):
        pgb.main(["--variants", "no-such-variant"])
    err = capsys.readouterr().err
    assert "--variants" in err and "no-such-variant" in err


def test_prefill_bench_routed_counts():
    """`random`: top_k distinct experts per token; `model`: the preset's own router (DeepSeek-V3's group-limited
    router with a correction bias loads its busiest expert well above the mean). Both sum to T * top_k."""
    from moe2cta.serving_bench import prefill_gemm_bench as pgb

    gen = torch.Generator().manual_seed(3)
    for name in ("deepseek-v3", "qwen3-30b-a3b"):
        preset = PRESETS[name]
        for routing in ("random", "model"):
            counts = pgb.routed_counts(routing, preset, 512, gen)
            assert counts.dtype == torch.int32 and counts.shape == (preset.num_experts,)
            assert int(counts.sum()) == 512 * preset.top_k
    deepseek = PRESETS["deepseek-v3"]
    counts = pgb.routed_counts("model", deepseek, 2048, gen)
    assert int(counts.max()) > 1.5 * 2048 * deepseek.top_k / deepseek.num_experts
    # `balanced`: T * k / E rows each, the remainder one row apiece on the first experts
    gpt_oss = PRESETS["gpt-oss-120b"]
    assert pgb.routed_counts("balanced", gpt_oss, 8192, gen).tolist() == [256] * 128
    counts = pgb.routed_counts("balanced", PRESETS["mixtral-8x7b"], 3, gen)
    assert counts.tolist() == [1] * 6 + [0] * 2 and counts.dtype == torch.int32


def test_prefill_bench_expert_classes_cover_every_expert_once():
    """Each expert lands in exactly one class: the first range of the scheme that holds its rows, else "regular";
    classes without experts are left out; a class's counts are the expert's own rows, 0 for the others."""
    from moe2cta.serving_bench import prefill_gemm_bench as pgb

    counts = torch.tensor([0, 60, 129, 160, 161, 256, 257, 288, 289, 533], dtype=torch.int32)
    for scheme in pgb.EXPERT_CLASS_SCHEMES:
        classes = pgb.expert_classes(scheme, counts)
        assert sum(c for _, c in classes).tolist() == counts.tolist(), scheme
        for _, c in classes:
            assert c.dtype == torch.int32 and int(c.sum()) > 0
            assert all(int(x) in (0, int(y)) for x, y in zip(c, counts))
    tails = dict(pgb.expert_classes("tails", counts))
    assert tails["wide160_even"].nonzero().flatten().tolist() == [2, 3]
    assert tails["wide288_even"].nonzero().flatten().tolist() == [6, 7]
    assert tails["regular"].nonzero().flatten().tolist() == [1, 4, 5, 8, 9]
    both = dict(pgb.expert_classes("w160_w288", counts))
    assert both["wide160_even"].nonzero().flatten().tolist() == [1, 2, 3]
    assert both["wide288_even"].nonzero().flatten().tolist() == [4, 5, 6, 7]
    assert [v for v, _ in pgb.expert_classes("w160", torch.tensor([300, 400], dtype=torch.int32))] == ["regular"]
    with pytest.raises(ValueError, match="scheme"):
        pgb.expert_classes("no-such-scheme", counts)


def test_prefill_bench_class_candidates_check_every_class(monkeypatch, tmp_path):
    """An expert-class candidate runs one launch per class on its own layout, and its check reads every class's
    output against the fp32 reference: with the kernels replaced by the torch twins it passes, and a kernel that
    leaves one class's rows unwritten fails it (CPU, bundle files faked)."""
    from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
    from moe2cta.grouped_gemm.reference import grouped_gemm1_reference, grouped_gemm2_reference
    from moe2cta.serving_bench import prefill_gemm_bench as pgb

    preset = custom_preset("256,128,16,4")
    dev = torch.device("cpu")
    weights = pgb._weights(preset, dev, 0)
    w13, _, w2, _, _ = weights
    counts = torch.tensor([0, 60, 150, 200, 300, 7, 129, 288, 0, 40, 0, 0, 33, 250, 161, 1], dtype=torch.int32)
    p1, p2 = pgb.problems_of(preset)
    cfgs1, cfgs2 = pgb.variant_configs(p1, 64), pgb.variant_configs(p2, 64)
    for cfg, problem in [(cfgs1[v], p1) for v in ("regular", "wide160_even", "wide288_even")] + [
            (cfgs2[v], p2) for v in ("regular", "wide160_even", "wide288_even")]:
        (tmp_path / f"{s90.kernel_key(cfg, problem).file_stem()}.so").touch()
    launched = []
    skip_class = {"launch": None}

    def gemm1(a, packed, ro, cn, activation, b13=None, out=None, config=None, kernel_directory=None):
        launched.append(("gemm1", config.operands, int(cn.sum())))
        if len(launched) != skip_class["launch"]:
            out.copy_(grouped_gemm1_reference(a, w13, ro, cn, activation, b13))

    def gemm2(a, w, ro, cn, row_scale=None, b2=None, out=None, config=None, kernel_directory=None):
        launched.append(("gemm2", config.operands, int(cn.sum())))
        out.copy_(grouped_gemm2_reference(a, w2, ro, cn, row_scale, b2))

    monkeypatch.setattr(s90, "sm90_grouped_gemm1", gemm1)
    monkeypatch.setattr(s90, "sm90_grouped_gemm2", gemm2)
    made = pgb.class_candidates("w160_w288", "new", str(tmp_path), preset, counts, weights, cfgs1, cfgs2, dev)
    (name1, g1, run1, check1), (name2, g2, run2, check2) = made
    assert (name1, g1, name2, g2) == ("cute-new-classes-w160_w288", "gemm1", "cute-new-classes-w160_w288", "gemm2")
    assert check1() < 1e-2 and check2() < 1e-2
    # three launches per GEMM (160-row class, 288-row class, regular), every routed row in exactly one of them
    assert [rows for g, _, rows in launched if g == "gemm1"] == [1 + 60 + 7 + 129 + 40 + 33 + 150, 200 + 288 + 250 + 161,
                                                                  300]
    assert sum(rows for g, _, rows in launched if g == "gemm2") == int(counts.sum())
    skip_class["launch"] = len(launched) + 2  # the next GEMM1 run leaves its 288-row class's output unwritten
    err = check1()
    assert not err < 1e-2, err
    assert pgb.class_candidates("w160_w288", "new", str(tmp_path / "empty"), preset, counts, weights, cfgs1, cfgs2,
                                dev).startswith("wide160_even: not in bundle")


def test_prefill_bench_builds_only_the_named_variants(monkeypatch, tmp_path):
    """`--build DIR --variants ...` compiles the presets' kernels plus exactly those variants' (all without it)."""
    from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
    from moe2cta.serving_bench import prefill_gemm_bench as pgb

    built = {}
    monkeypatch.setattr(s90, "compile_for_preset", lambda preset, out, extra_configs=(): built.setdefault(
        preset.name, list(extra_configs)) or [])
    assert pgb.main(["--models", "gpt-oss-120b", "--build", str(tmp_path), "--variants", "wide", "regular"]) == 0
    p1, p2 = pgb.problems_of(PRESETS["gpt-oss-120b"])
    expected = []
    for problem in (p1, p2):
        variants = pgb.variant_configs(problem)
        expected += [(c, problem) for c in dict.fromkeys((variants["wide"], variants["regular"]))]
    assert built["gpt-oss-120b"] == expected
    built.clear()
    assert pgb.main(["--models", "gpt-oss-120b", "--build", str(tmp_path)]) == 0
    assert len(built["gpt-oss-120b"]) > len(expected)


def test_prefill_bench_rejects_an_unknown_padding_or_routing(capsys):
    from moe2cta.serving_bench import prefill_gemm_bench as pgb

    for flag in ("--padding", "--routing"):
        with pytest.raises(SystemExit):
            pgb.main([flag, "nope"])
        assert flag in capsys.readouterr().err


def test_layer_profile_arguments(capsys):
    """The layer profiler names a bad argument; without a GPU it says so and returns 2."""
    from moe2cta.serving_bench import layer_profile

    with pytest.raises(SystemExit):
        layer_profile.main(["--model", "qwen3-30b-a3b", "--tokens", "8", "--backends", "nope"])
    assert "--backends" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        layer_profile.main(["--model", "qwen3-30b-a3b", "--tokens", "8", "--modes", "replayed"])
    assert "--modes" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert layer_profile.main(["--model", "qwen3-30b-a3b", "--tokens", "8"]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_host_overhead_arguments(capsys):
    """The host-overhead bench names a bad argument; without a GPU it says so and returns 2."""
    from moe2cta.serving_bench import host_overhead

    with pytest.raises(SystemExit):
        host_overhead.main(["--model", "qwen3-30b-a3b", "--tokens", "8", "--backends", "nope"])
    assert "--backends" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_overhead.main(["--model", "qwen3-30b-a3b", "--tokens", "8", "--calls", "0"])
    assert "--calls" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_overhead.main(["--model", "qwen3-30b-a3b", "--tokens", "8", "--modes", "replayed"])
    assert "--modes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_overhead.main(["--model", "qwen3-30b-a3b", "--tokens", "0", "--modes", "graphed-in-place"])
    assert "--modes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_overhead.main(["--model", "qwen3-30b-a3b", "--tokens", "-1"])
    assert "--tokens" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert host_overhead.main(["--model", "qwen3-30b-a3b", "--tokens", "8", "--modes", "eager", "graphed", "graphed-in-place"]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_host_overhead_stage_timers_wrap_and_restore():
    """--stages wraps the forward's functions while it times them, counts each call, and puts them back after."""
    import collections

    from moe2cta import MoELayer
    from moe2cta.api import MoELayer as layer_class
    from moe2cta.serving_bench import host_overhead

    validate = layer_class.validate
    layer = MoELayer(torch.randn(4, 16, 8), torch.randn(4, 8, 8), routing=RoutingConfig(top_k=2), backend="torch")
    totals = collections.OrderedDict()
    with host_overhead.stage_times(totals):
        assert layer_class.validate is not validate
        layer(torch.randn(3, 8), torch.randn(3, 4))
        layer(torch.randn(5, 8), torch.randn(5, 4))
    assert layer_class.validate is validate
    ns, calls = totals["moe2cta.api.MoELayer.validate"]
    assert calls == 2 and ns > 0


def test_launch_cost_arguments(capsys):
    """The launch-cost probe names a bad argument; without a GPU it says so and returns 2."""
    from moe2cta.serving_bench import launch_cost

    for bad in (["--calls", "0"], ["--calls", "901"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            launch_cost.main(bad)
        assert bad[0] in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert launch_cost.main([]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_layer_padding_probe_arguments(capsys):
    """The padding probe names a bad content; without a GPU it says so and returns 2."""
    from moe2cta.serving_bench import layer_padding_probe

    with pytest.raises(SystemExit):
        layer_padding_probe.main(["--models", "qwen3-30b-a3b", "--tokens", "8", "--contents", "ones"])
    assert "--contents" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert layer_padding_probe.main(["--models", "qwen3-30b-a3b", "--tokens", "8"]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_topk_inputs_bench_arguments_and_table(capsys):
    """The routing-dtype bench names a bad token count and an unknown model before any work; without a GPU it says
    so and returns 2; its table sets the inputs read as given against the converted ones."""
    from moe2cta.serving_bench import topk_inputs_bench as bench

    with pytest.raises(SystemExit):
        bench.main(["--models", "qwen3-30b-a3b", "--tokens", "0"])
    assert "--tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--models", "qwen3-30b-a3b", "--tokens", "1", "--seconds", "0"])
    assert "--seconds" in capsys.readouterr().err
    with pytest.raises(ValueError, match="qwen9"):
        bench.main(["--models", "qwen9", "--tokens", "1"])
    if not torch.cuda.is_available():
        assert bench.main(["--models", "qwen3-30b-a3b", "--tokens", "1"]) == 2
        assert "CUDA" in capsys.readouterr().err
    row = {"model": "m", "tokens": 1, "runs": "triton", "identical_outputs": True,
           "median_us": {"fp32+int32": 27.0, "bf16+int64": 27.2, "bf16+int64 converted": 34.0}}
    table = bench.markdown([row])
    assert "| m | 1 | triton | 27.0 | 27.2 | 34.0 | 0.800 | True |" in table


def test_prefill_gemm_bench_takes_several_paddings(monkeypatch, capsys):
    """--padding takes several contents (timed side by side in one process, each once), each one of the known ones."""
    from moe2cta.serving_bench import prefill_gemm_bench

    with pytest.raises(SystemExit) as exit_info:
        prefill_gemm_bench.main(["--padding", "random", "ones"])
    assert exit_info.value.code == 2 and "--padding" in capsys.readouterr().err
    cells = []
    monkeypatch.setattr(prefill_gemm_bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(prefill_gemm_bench, "Watchdog", lambda seconds: None)
    monkeypatch.setattr(prefill_gemm_bench, "_weights", lambda preset, device, seed: None)
    monkeypatch.setattr(prefill_gemm_bench, "run_cell", lambda *args: cells.append(args[9]) or [])
    assert prefill_gemm_bench.main(["--models", "qwen3-30b-a3b", "--tokens", "2048",
                                    "--padding", "zero", "bits", "zero"]) == 0
    assert cells == [("zero", "bits")]


def test_layer_runs_combines_per_model_runs(tmp_path):
    """layer_runs: one combined JSON of every cell, geomeans of time / floor per phase over the ok cells only, the
    worst cell, and the previous run's medians beside."""
    from moe2cta.serving_bench import layer_runs

    def run(name, cells, **fields):
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps({**fields, "results": [
            {"model": m, "tokens": t, "backend": b, "floor_us": 10.0, "median_us": us, "rel_err": 1e-3, "status": st,
             "p10_us": us * 0.99, "p90_us": us * (1.1 if t in (1, 8192) else 1.01)}  # decode: never marked
            for m, t, b, us, st in cells]}))
        return d

    a = run("a", [("m1", 1, "auto", 11.0, "ok"), ("m1", 2048, "auto", 20.0, "ok"), ("m1", 1024, "auto", 99.0, "ok")],
            timing={"settle_seconds": 0.5, "target_seconds": 0.05}, backend_order="sequential", router="model",
            backends={"auto": {"description": "the AUTO layer"}})
    b = run("b", [("m2", 1, "auto", 14.0, "ok"), ("m2", 8192, "auto", 15.0, "ok"), ("m2", 32, "auto", 500.0, "error")])
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"results": [{"model": "m1", "tokens": 1, "backend": "auto", "floor_us": 10.0,
                                             "median_us": 12.5, "status": "ok", "ratio": 1.25, "phase": "decode"}]}))
    out_json, out_md = tmp_path / "v.json", tmp_path / "v.md"
    assert layer_runs.main([str(a), str(b), "--run", "vX", "--json", str(out_json), "--md", str(out_md),
                            "--previous", str(prev), "--floors", "recorded"]) == 0
    cells = json.loads(out_json.read_text())["results"]
    assert len(cells) == 6 and {c["phase"] for c in cells} == {"decode", "prefill", "between"}
    s = layer_runs.summary(cells)["auto"]
    assert s["decode"] == pytest.approx(math.sqrt(1.1 * 1.4))  # the error cell does not count
    assert s["prefill"] == pytest.approx(math.sqrt(2.0 * 1.5))
    assert s["worst"] == (pytest.approx(9.9), "m1", 1024)
    md = out_md.read_text()
    assert "# Full layer, run vX" in md and "| m1 | 1 | 10.0 | 11.0 (1.10x) | 12.5 |" in md
    # how the runs were timed, from the runs that recorded it (b, an older run, did not)
    assert json.loads(out_json.read_text())["conditions"]["settle_seconds"] == [0.5]
    assert ("- timing: settle before each case's samples: 0.5 s; samples per case: 0.05 s; backend order: sequential; "
            "router: model") in md and "- backends: `auto` = the AUTO layer" in md
    assert "| m2 | 32 | 10.0 | error | - |" in md and "1.250 / - / 1.25" in md  # not timed; the previous run
    assert "| m2 | 8192 | 10.0 | 15.0 (1.50x)~ |" in md and "`~`: 1 prefill cells whose samples spread" in md
    assert layer_runs.spread(cells[1]) == pytest.approx(1.01 / 0.99) and not layer_runs.marked(cells[0])
    with pytest.raises(ValueError, match="run_dirs: .*results.json does not exist"):
        layer_runs.load_cells([tmp_path / "missing"])
    with pytest.raises(ValueError, match="records no ceilings, model shapes or dtype .*--floors recorded"):
        layer_runs.load_cells([a])  # the targets' ceilings by default: this run recorded nothing to restate from
    with pytest.raises(ValueError, match="both hold the cell \\('m1', 'uniform', 1, 'auto'\\)"):
        layer_runs.load_cells([a, a], "recorded")


def test_layer_runs_restates_floors_under_the_targets_ceilings(tmp_path):
    """A run whose floors used a measured matmul ceiling (here 760 TFLOP/s, and a copy of 4.25 TB/s) restated at 792 /
    4.24: a compute-bound cell's floor scales with the FLOP rate, a memory-bound one with the bandwidth, and each
    sample's ratio is over its own rotation's restated floor. Routing distributions are kept apart."""
    from moe2cta.serving_bench import layer_runs

    hidden, inter, experts, top_k = 1024, 512, 16, 4
    bw, flops_rate = 4.25e12, 760e12
    per_expert = 3 * hidden * inter * 2

    def floor_us(tokens, hit):
        return max((hit * per_expert + 2 * tokens * hidden * 2) / bw, 2 * tokens * top_k * 3 * hidden * inter
                   / flops_rate) * 1e6

    small = [floor_us(4, 3), floor_us(4, 5)]  # memory-bound; the rotations hit 3 and 5 experts
    big = floor_us(1 << 16, experts)  # compute-bound
    assert big == pytest.approx(2 * (1 << 16) * top_k * 3 * hidden * inter / flops_rate * 1e6)
    rows = [{"model": "m", "distribution": dist, "tokens": 4, "backend": "auto", "status": "ok",
             "floor_us": sum(small) / 2, "median_us": 30.0, "samples_us": [20.0, 40.0, 22.0, 44.0],
             "rotation_floors_us": small, "rotation_experts_hit": [3, 5], "experts_hit": 4.0}
            for dist in ("uniform", "zipf")]
    rows.append({"model": "m", "distribution": "uniform", "tokens": 1 << 16, "backend": "auto", "status": "ok",
                 "floor_us": big, "median_us": 2 * big, "samples_us": [2 * big] * 3, "rotation_floors_us": [big],
                 "experts_hit": float(experts)})  # (a run before rotation_experts_hit: the cell's mean stands in)
    d = tmp_path / "r"
    d.mkdir()
    (d / "results.json").write_text(json.dumps({
        "ceilings": {"bandwidth_bytes_per_s": bw, "matmul_flops_per_s": flops_rate}, "dtype": "bfloat16",
        "models": [{"name": "m", "hidden": hidden, "intermediate": inter, "num_experts": experts, "top_k": top_k,
                    "has_bias": False}], "results": rows}))
    recorded = {(c["distribution"], c["tokens"]): c for c in layer_runs.load_cells([d], "recorded")}
    restated = {(c["distribution"], c["tokens"]): c for c in layer_runs.load_cells([d])}
    assert restated["uniform", 1 << 16]["floor_us"] == pytest.approx(big * 760 / 792)
    assert restated["uniform", 1 << 16]["ratio"] == pytest.approx(2 * 792 / 760)
    assert recorded["uniform", 1 << 16]["ratio"] == pytest.approx(2.0)
    new = [f * 4.25 / 4.24 for f in small]
    assert restated["uniform", 4]["floor_us"] == pytest.approx(sum(new) / 2)
    assert restated["uniform", 4]["ratio"] == pytest.approx(statistics.median(
        [20 / new[0], 40 / new[1], 22 / new[0], 44 / new[1]]))
    assert set(layer_runs.summary(list(restated.values()))) == {"auto [uniform]", "auto [zipf]"}
    out_md = tmp_path / "v.md"
    assert layer_runs.main([str(d), "--run", "v", "--json", str(tmp_path / "v.json"), "--md", str(out_md)]) == 0
    assert "- floors: the targets' ceilings (4.24 TB/s, 792 TFLOP/s)" in out_md.read_text()


def test_layer_runs_sets_each_layer_against_the_dense_ceiling(tmp_path):
    """layer_runs: where a run holds a ceiling backend, each layer's time over the ceiling's in every cell both timed,
    with the SM clocks, and the geomeans; nothing without one."""
    from moe2cta.serving_bench import layer_runs

    d = tmp_path / "r"
    d.mkdir()
    rows = [("auto", "moe2cta", 8192, 130.0, 1500.0), ("auto", "moe2cta", 32768, 480.0, 1400.0),
            ("dense-ceiling", "ceiling", 8192, 100.0, 1600.0), ("dense-ceiling", "ceiling", 32768, 400.0, 1450.0),
            ("auto", "moe2cta", 2048, 50.0, None)]
    (d / "results.json").write_text(json.dumps({"results": [
        {"model": "m", "tokens": t, "backend": b, "family": f, "floor_us": 80.0 * t / 8192, "median_us": us,
         "status": "ok", "sm_mhz": mhz, "power_w": 690.0} for b, f, t, us, mhz in rows]
        + [{"model": "m", "tokens": 2048, "backend": "dense-ceiling", "family": "ceiling", "floor_us": 20.0,
            "status": "unsupported"}]}))
    cells = layer_runs.load_cells([d], "recorded")
    lines = layer_runs.ceiling_lines(cells)
    text = "\n".join(lines)
    assert "Against `dense-ceiling`" in text and "| model | T | dense-ceiling us (x floor) @ MHz | auto / ceiling @ MHz |" in text
    assert "| m | 8192 | 100.0 (1.25x) @ 1600 | 1.300 @ 1500 |" in text
    assert "| m | 32768 | 400.0 (1.25x) @ 1450 | 1.200 @ 1400 |" in text
    assert f"| geomean | 2 cells | 1.250x floor | {math.sqrt(1.3 * 1.2):.3f} |" in text
    assert "2048" not in text
    assert layer_runs.ceiling_lines([c for c in cells if c["backend"] == "auto"]) == []
    assert "Against `dense-ceiling`" in layer_runs.markdown("v", cells)


def test_permute_bench_grid_and_cells():
    """The gather / combine launch grid skips BLOCK_H wider than the row's power of two, and every default cell names
    a preset."""
    from moe2cta.presets import PRESETS
    from moe2cta.serving_bench import permute_bench as pb

    narrow = list(pb._grid(pb.COMBINE_GRID, 600))
    assert narrow and all(p["block_h"] <= 1024 for p in narrow) and any(p["block_h"] == 1024 for p in narrow)
    assert len(list(pb._grid(pb.COMBINE_GRID, 4096))) == 4 * 3 * 2
    for cell in pb.DEFAULT_CELLS:
        model, tokens = pb.parse_cell(cell)
        assert model in PRESETS and tokens > 0
    for bad in ("qwen3-30b-a3b", "qwen3-30b-a3b:0", "qwen3-30b-a3b:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="MODEL:T"):
            pb.parse_cell(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="model"):
        pb.parse_cell("no-such-model:8")


def test_router_bench_variant_specs():
    """router_bench --variants: presets and key=value items parse to the kernel choices; a bad item names it."""
    from moe2cta.serving_bench.router_bench import parse_variant

    assert parse_variant("v3,groups=per_group,bt=8") == {"name": "v3,groups=per_group,bt=8", "keys": "auto", "bt": 8,
                                                       "warps": None, "slots": None, "groups": "per_group"}
    assert parse_variant("v2")["keys"] == "score_int64" and parse_variant("v2")["groups"] == "auto"
    with pytest.raises(ValueError, match="groups="):
        parse_variant("v3,lanes=4")
    with pytest.raises(ValueError, match="group_reduce: expected one of"):
        parse_variant("v3,groups=pairwise")


def test_cute_tuned_backend_finds_its_cache_at_check_time(tmp_path, monkeypatch):
    """cute-tuned reads MOE2CTA_TUNING_CACHE when checked (never at import) and says why it cannot run: no GPU,
    no cache file, an empty cache."""
    from moe2cta import planner, tuning

    spec = BACKENDS["cute-tuned"]
    assert spec.family is BackendFamily.OURS
    ok, why = spec.availability(torch.device("cpu"))
    assert not ok and "GPU" in why
    monkeypatch.setattr(backends_mod, "_moe2cta_available", lambda *_: (lambda device: (True, "")))
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("MOE2CTA_TUNING_CACHE", str(path))
    ok, why = spec.availability(torch.device("cuda"))
    assert not ok and str(path) in why and "no tuning cache" in why
    path.write_text(json.dumps(tuning.TuningCache(path).to_json()))
    ok, why = spec.availability(torch.device("cuda"))
    assert not ok and "no entries" in why
    cache = tuning.TuningCache(path)
    key = tuning.TuningKey("G", "bfloat16", 4, 256, 256, "swiglu", 1)
    cache.put(tuning.TuningEntry(key, planner.make_candidate("sm_90a", "single", 64, 64, 64, 4), 1e-5))
    cache.save()
    assert spec.availability(torch.device("cuda")) == (True, "")


def test_placement_summary_separates_copies_from_rounds():
    from moe2cta.serving_bench.layer_placement_probe import placement_summary

    # two copies 10% apart, each steady: placement
    s = placement_summary([[100.0, 101.0, 100.0, 101.0], [110.0, 111.0, 110.0, 111.0]])
    assert s["median_us"] == [100.5, 110.5] and s["spread_between"] == pytest.approx(10 / 100.5)
    assert s["spread_within"] == pytest.approx(1 / 100.5)
    # equal copies whose rounds alternate: time, not placement
    s = placement_summary([[100.0, 110.0, 100.0, 110.0], [100.0, 110.0, 100.0, 110.0]])
    assert s["spread_between"] == 0 and s["spread_within"] == pytest.approx(10 / 105)
    with pytest.raises(ValueError, match="times_us"):
        placement_summary([[1.0]])


def test_interleaved_rounds_names_bad_arguments():
    from moe2cta.serving_bench.timing import interleaved_rounds

    with pytest.raises(ValueError, match="replays"):
        interleaved_rounds({}, 3)
    with pytest.raises(ValueError, match="rounds"):
        interleaved_rounds({"a": lambda: None}, 0)


def test_placement_probe_names_bad_arguments(capsys):
    from moe2cta.serving_bench import layer_placement_probe

    for flag in ("--copies", "--rounds"):
        with pytest.raises(SystemExit):
            layer_placement_probe.main(["--models", "qwen3-30b-a3b", "--tokens", "8", flag, "1"])
        assert flag in capsys.readouterr().err


def test_l2_sides_probe_analysis_splits_by_latency_and_gpc():
    """sides_from_probe on a synthetic probe of 16 SMs in 4 GPCs: SMs 0-7 on the first reference's side (fast upper
    quartile), 8-15 slow (their medians half fast, half slow: not what splits them); the second pass's reference is on the other side (its labels flip back into the first's frame); SM 3's
    slow readings in two of the four passes (a tie of the passes) are outvoted by its GPC. Builtin maps and load_side_map's errors name the argument."""
    from moe2cta.serving_bench import l2_sides_probe as probe

    def one_pass(reference_block, near, bumped=()):
        # a block on the far side: its median may sit at either level (only some lines are far), its upper
        # quartile is at the far one
        blocks = [{"sm": sm, "median": 300 + 170 * (sm % 2 and sm not in near), "q25": 290,
                   "q75": (300 if sm in near and sm not in bumped else 470) + sm % 3} for sm in range(16)]
        return {"reference_block": reference_block, "blocks": blocks}

    first, second = set(range(8)), set(range(8, 16))
    raw = {"device": "fake", "passes": [one_pass(0, first, bumped={3}), one_pass(15, second),
                                        one_pass(0, first, bumped={3}), one_pass(15, second)],
           "clusters": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [1, 2]]}
    result = probe.sides_from_probe(raw)
    assert result["side_of_sm"] == [0] * 8 + [1] * 8
    assert result["sides"] == [8, 8] and result["gpcs"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                          [12, 13, 14, 15]]
    assert result["gpcs_split_by_latency"] == 1  # SM 3
    assert [round(a, 4) for a in result["agreement"]] == [1.0, 0.9375, 1.0, 0.9375]  # against the first pass
    assert result["passes"][0]["near_cycles"] < result["passes"][0]["far_cycles"]
    assert probe.builtin_side_map("zero") == [0] * probe.MAP_IDS
    assert sum(probe.builtin_side_map("random")) == probe.MAP_IDS // 2
    assert probe.builtin_side_map("parity")[:4] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="spec: expected one of"):
        probe.load_side_map("no-such-map")
    with pytest.raises(ValueError, match="name: expected one of"):
        probe.builtin_side_map("gpc")


def test_every_bench_tool_uses_the_targets_ceilings():
    """The per-GEMM benches keep their own copies of the floor's ceilings (a bare checkout runs them): the same
    figures as the layer benchmark's (before stop 52 two of them used 4.3 TB/s and 790 TFLOP/s)."""
    from moe2cta.serving_bench import floors, hopper_gemm_bench, layer_runs, triton_gemm_bench

    for bandwidth, rate in ((hopper_gemm_bench.FLOOR_BANDWIDTH, hopper_gemm_bench.FLOOR_MATMUL_FLOPS),
                            (triton_gemm_bench.BANDWIDTH, triton_gemm_bench.MATRIX_RATE),
                            (layer_runs.TARGET_BANDWIDTH, layer_runs.TARGET_MATMUL_FLOPS)):
        assert (bandwidth, rate) == (floors.DEFAULT_BANDWIDTH, floors.DEFAULT_MATMUL_FLOPS)
