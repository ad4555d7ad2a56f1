"""Bad command-line input: every tool names the argument and exits nonzero before its long work, never with a
traceback; output paths are checked before anything is computed or compiled. CPU only."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe2cta import aot, cli, plan_cli, tune_cli
from moe2cta.grouped_gemm import cute_runtime
from moe2cta.serving_bench import cli as bench_cli
from moe2cta.serving_bench import ep_bench, layer_runs
from moe2cta.validation import output_dir, output_file


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


def _exits(main, argv, capsys, code=2):
    """main(argv) exits (returns or raises SystemExit) with `code`; returns its stderr."""
    try:
        result = main(argv)
    except SystemExit as exc:
        result = exc.code
    assert result == code, (argv, result)
    return capsys.readouterr().err


def test_output_paths_are_checked_up_front(tmp_path, a_file):
    assert output_dir(tmp_path / "new" / "dir", "--out").is_dir()
    with pytest.raises(ValueError, match="^--out: cannot make the directory"):
        output_dir(a_file, "--out")
    with pytest.raises(ValueError, match="^--json: .* is a directory"):
        output_file(tmp_path, "--json")
    with pytest.raises(ValueError, match="^--json: cannot make the directory"):
        output_file(a_file / "r.json", "--json")
    assert output_file(tmp_path / "sub" / "r.json", "--json").parent.is_dir()


def test_bench_rejects_bad_arguments_before_running(tmp_path, a_file, capsys):
    base = ["--tokens", "1", "--backends", "moe2cta-torch", "--no-plots", "--progress", "off"]
    assert "--out: cannot make the directory" in _exits(bench_cli.main, base + ["--out", str(a_file)], capsys)
    for extra, name in ((["--check-rows", "0"], "--check-rows"), (["--models", ""], "--models"),
                        (["--backends", ""], "--backends"), (["--time-per-case", "0"], "--time-per-case"),
                        (["--bandwidth-tbps", "0"], "--bandwidth-tbps")):
        assert f"error: {name}: expected" in _exits(bench_cli.main, base + extra + ["--out", str(tmp_path)], capsys)


def test_bench_fails_when_no_case_ran(tmp_path, capsys):
    """Backends that cannot run here (the CuTe one on a CPU) time no case: status 1, not a silent 0."""
    argv = ["--tokens", "1", "--backends", "cute", "--no-plots", "--progress", "off", "--out", str(tmp_path)]
    assert "no case ran correctly" in _exits(bench_cli.main, argv, capsys, code=1)


def test_aot_and_tune_check_their_outputs_before_compiling(tmp_path, a_file, capsys):
    err = _exits(aot.main, ["build", "--model", "qwen3-30b-a3b", "--arch", "sm_90a", "--out", str(a_file)], capsys)
    assert "--out: cannot make the directory" in err
    err = _exits(tune_cli.main, ["build", "--model", "qwen3-30b-a3b", "--arch", "sm_90a", "--out", str(a_file),
                                 "--buckets", "1"], capsys)
    assert "--out: cannot make the directory" in err
    err = _exits(tune_cli.main, ["run", "--model", "qwen3-30b-a3b", "--arch", "sm_90a", "--json", str(tmp_path)],
                 capsys)
    assert "--json:" in err and "is a directory" in err
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    err = _exits(aot.main, ["requests", "--from-bundle", str(bundle), "--out", str(tmp_path)], capsys)
    assert "--out:" in err and "is a directory" in err
    err = _exits(aot.main, ["requests", "--from-bundle", str(bundle), "--exclude-bundle", str(tmp_path / "none"),
                            "--out", str(tmp_path / "r.jsonl")], capsys)
    assert "--exclude-bundle:" in err


def test_malformed_requests_and_manifests_are_named(tmp_path, capsys):
    requests = tmp_path / "bad.jsonl"
    requests.write_text(json.dumps({"stem": "s", "key": 5, "request": {}}) + "\n")
    with pytest.raises(ValueError, match="expected key and request to be JSON objects"):
        cute_runtime.read_requests(requests)
    err = _exits(aot.main, ["build", "--requests", str(requests), "--arch", "sm_90a", "--out", str(tmp_path / "k")],
                 capsys)
    assert "expected key and request to be JSON objects" in err
    for text, match in (("[1, 2]", "not a bundle manifest"), ("garbage", "not a bundle manifest")):
        (tmp_path / "manifest.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            cute_runtime.read_manifest(tmp_path)


def test_other_tools_name_their_bad_arguments(tmp_path, capsys):
    assert "--model:" in _exits(ep_bench.main, ["--model", "nope", "--tokens", "16"], capsys)
    assert "--steps: expected an int >= 1" in _exits(ep_bench.main, ["--steps", "0", "--tokens", "16"], capsys)
    assert "--nprocs: expected an int >= 1" in _exits(ep_bench.main, ["--nprocs", "0", "--tokens", "16"], capsys)
    err = _exits(layer_runs.main, ["--run", "x", "--json", str(tmp_path / "a.json"), "--md", str(tmp_path / "a.md"),
                                   str(tmp_path / "missing")], capsys)
    assert "does not exist" in err
    assert "--buckets: expected MAX_ROWS >= 1" in _exits(plan_cli.main, ["--model", "qwen3-30b-a3b", "--buckets", "0"],
                                                         capsys)
    assert "--top: expected an int >= 1" in _exits(plan_cli.main, ["--model", "qwen3-30b-a3b", "--tokens", "8",
                                                                   "--top", "0"], capsys)
    assert "takes no arguments" in _exits(cli.main, ["backends", "extra"], capsys)


def test_python_m_moe2cta_runs_the_command():
    result = subprocess.run([sys.executable, "-m", "moe2cta", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "subcommands:" in result.stdout, result.stderr[-2000:]


def test_aot_build_checks_what_it_builds_before_making_out(tmp_path, capsys):
    """A mistyped model, an empty --requests or a requests file whose entry names no arch is named with exit status 2,
    and --out is not made for it."""
    out = tmp_path / "never"
    assert "model: expected one of" in _exits(aot.main, ["build", "--model", "nope", "--arch", "sm_90a", "--out",
                                                         str(out)], capsys)
    assert "requests: expected the path of a requests file, got ''" in _exits(
        aot.main, ["build", "--requests", "", "--arch", "sm_90a", "--out", str(out)], capsys)
    requests = tmp_path / "mixed.jsonl"
    requests.write_text(json.dumps({"stem": "a", "key": {"family": "sm90_grouped_gemm"}, "request": {}}) + "\n"
                        + json.dumps({"stem": "b", "key": {"arch": "sm_100a"}, "request": {}}) + "\n")
    assert "entries [1] name no arch in their key" in _exits(
        aot.main, ["build", "--requests", str(requests), "--arch", "sm_90a", "--out", str(out)], capsys)
    assert not out.exists()


def test_model_names_and_custom_specs_on_the_command_lines():
    from moe2cta.presets import custom_preset, model_preset

    assert model_preset("Qwen3-30B-A3B").name == "qwen3-30b-a3b"
    assert model_preset("Custom:256,128,16,4").name == "custom-256-128-16-4"
    spaced = custom_preset(" 256, 128 ,16,4 , SwiGLU_OAI , BIAS ")
    assert (spaced.name, spaced.has_bias) == ("custom-256-128-16-4-swiglu_oai-bias", True)
    for bad in ("4_096,768,128,8", "+256,128,16,4", "256,128,16"):
        with pytest.raises(ValueError, match="four integers first"):
            custom_preset(bad)
    with pytest.raises(TypeError, match="model: expected a preset name"):
        model_preset(None)


def test_moe_config_names_a_tile_heights_that_is_no_tuple():
    from moe2cta.config import MoEConfig

    for bad in (128, None, "128"):
        with pytest.raises(TypeError, match="tile_heights: expected a tuple of ints >= 1"):
            MoEConfig(None, tile_heights=bad)


def test_tools_refuse_empty_paths_and_check_the_cache_variable_first(tmp_path, a_file, capsys, monkeypatch):
    """An empty --out is not the current directory; `tune run` checks the tuning cache it will write, named by the
    variable it came from, before any timing; `tune build` makes no --out for a model it does not know."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^--out: expected a directory path, got an empty one"):
        output_dir("", "--out")
    with pytest.raises(ValueError, match="^--json: expected a file path, got an empty one"):
        output_file("", "--json")
    err = _exits(tune_cli.main, ["build", "--model", "qwen3-30b-a3b", "--arch", "sm_90a", "--out", "", "--buckets",
                                 "1"], capsys)
    assert "--out: expected a directory path" in err and [p.name for p in tmp_path.iterdir()] == ["a_file"]
    monkeypatch.setenv("MOE2CTA_TUNING_CACHE", str(a_file / "tuning.json"))
    err = _exits(tune_cli.main, ["run", "--model", "qwen3-30b-a3b", "--arch", "sm_90a"], capsys)
    assert "$MOE2CTA_TUNING_CACHE: cannot make the directory" in err
    err = _exits(tune_cli.main, ["build", "--model", "nope", "--arch", "sm_90a", "--out", str(tmp_path / "never")],
                 capsys)
    assert "model: expected one of" in err and not (tmp_path / "never").exists()


def test_plan_takes_custom_models_and_checks_given_counts(capsys):
    assert plan_cli.main(["--model", "custom:1024,512,16,2", "--tokens", "64", "--arch", "sm_90a"]) == 0
    assert "model=custom-1024-512-16-2" in capsys.readouterr().out
    assert plan_cli.main(["--model", "custom:1024,512,16,2", "--buckets", "8", "--arch", "sm_90a"]) == 0
    counts = ",".join(["1"] * 128)  # 128 rows, where 10 tokens x top-8 route 80
    err = _exits(plan_cli.main, ["--model", "qwen3-30b-a3b", "--tokens", "10", "--counts", counts], capsys)
    assert "counts: expected rows >= 0 per expert summing to T x k = 10 x 8 = 80, got 128" in err
