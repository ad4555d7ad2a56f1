"""Kernel requests (CPU): a run that finds neither the CuTe DSL nor a kernel records what it asked for, and
`python -m moe2cta.aot build --requests FILE` compiles exactly those kernels.

The JSON codec of the config and problem dataclasses round-trips every preset kernel of both families; the cache
records a kernel once, only where it can neither load nor compile it; the build command compiles a recorded
sm_90a kernel (needs nvidia-cutlass-dsl) and refuses files it cannot build from, naming why.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from moe2cta import aot
from moe2cta.grouped_gemm import Activation, GemmStage
from moe2cta.grouped_gemm import cute_runtime as rt
from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
from moe2cta.grouped_gemm import sm100_grouped_gemm as sm100
from moe2cta.presets import PRESETS, get_preset

NEEDS_DSL = pytest.mark.skipif(not rt.dsl_available(), reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")
SMALL_CONFIG = s90.Sm90GemmConfig(tile_n=128)
SMALL_PROBLEM = s90.Sm90Problem(GemmStage.GEMM1, 256, 128, 4, torch.bfloat16, Activation.SWIGLU)


@pytest.mark.parametrize("model", sorted(PRESETS))
def test_every_preset_kernel_round_trips_through_json(model):
    pairs = [(c, p) for c, p in s90.preset_configs(get_preset(model))]
    pairs += [(c, p) for p, c in sm100.preset_configs(get_preset(model), "bfloat16")]
    for config, problem in pairs:
        for obj in (config, problem):
            data = json.loads(json.dumps(rt.dataclass_to_json(obj)))  # plain JSON in between
            assert rt.dataclass_from_json(type(obj), data) == obj
    request = s90.kernel_request(*pairs[0])
    assert request["family"] == s90.FAMILY and request["problem"]["dtype"] == "bfloat16"


def test_json_codec_names_what_is_wrong():
    data = rt.dataclass_to_json(SMALL_PROBLEM)
    assert data["kind"] == "gemm1" and data["activation"] == "swiglu" and data["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=r"no field\(s\) \['tile'\]"):
        rt.dataclass_from_json(s90.Sm90Problem, data | {"tile": [1, 2, 3]})
    with pytest.raises(TypeError, match="Sm90Problem.n: expected int"):
        rt.dataclass_from_json(s90.Sm90Problem, data | {"n": "256"})
    with pytest.raises(ValueError, match="Sm90Problem.kind"):
        rt.dataclass_from_json(s90.Sm90Problem, data | {"kind": "gemm3"})
    with pytest.raises(ValueError, match="torch dtype"):
        rt.dataclass_from_json(s90.Sm90Problem, data | {"dtype": "nosuch"})
    with pytest.raises(TypeError, match="dataclass instance"):
        rt.dataclass_to_json(s90.Sm90Problem)
    missing = {k: v for k, v in data.items() if k != "has_bias"}
    assert rt.dataclass_from_json(s90.Sm90Problem, missing) == SMALL_PROBLEM  # a missing field takes its default


def _key():
    return s90.kernel_key(SMALL_CONFIG, SMALL_PROBLEM)


def test_cache_records_a_kernel_it_can_neither_load_nor_compile_once(monkeypatch, tmp_path):
    requests = tmp_path / "requests.jsonl"
    monkeypatch.setattr(rt, "dsl_available", lambda: False)
    monkeypatch.setenv(rt.KERNEL_DIR_ENV, str(tmp_path / "empty-bundle"))
    monkeypatch.delenv(rt.KERNEL_REQUESTS_ENV, raising=False)

    def request():
        return s90.kernel_request(SMALL_CONFIG, SMALL_PROBLEM)

    with pytest.raises(RuntimeError, match="moe2cta.aot build --model") as info:
        rt.KernelCache().get(_key(), lambda: None, request=request)
    assert "Recorded" not in str(info.value) and not requests.exists()  # no requests file named: nothing recorded
    monkeypatch.setenv(rt.KERNEL_REQUESTS_ENV, str(requests))  # read at call time
    for _ in range(2):  # two processes' worth of caches: the kernel is recorded once
        with pytest.raises(RuntimeError, match=f"aot build --requests {requests} --arch sm_90a"):
            rt.KernelCache().get(_key(), lambda: None, request=request)
    entries = rt.read_requests(requests)
    assert [e["stem"] for e in entries] == [_key().file_stem()]
    assert entries[0]["request"] == request() and entries[0]["key"] == _key().to_json()


def test_cache_records_nothing_where_it_can_compile(monkeypatch, tmp_path):
    requests = tmp_path / "requests.jsonl"
    monkeypatch.setattr(rt, "dsl_available", lambda: True)
    kernel = rt.KernelCache(requests=requests).get(_key(), lambda: "compiled", request=lambda: 1 / 0)
    assert kernel == "compiled" and not requests.exists()


def test_record_and_read_requests_check_their_input(tmp_path):
    with pytest.raises(ValueError, match="family 'sm90_grouped_gemm'"):
        rt.record_request(tmp_path / "r.jsonl", _key(), {"family": "other"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"stem": "x", "key": {}, "request": {}}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
        rt.read_requests(bad)
    bad.write_text('{"stem": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: expected an object with stem, key and request"):
        rt.read_requests(bad)
    assert rt.read_requests(tmp_path / "absent.jsonl") == []


def test_build_requests_refuses_what_it_cannot_build(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no kernel requests"):
        aot.build_requests(str(empty), "sm_90a", str(tmp_path / "out"))
    requests = tmp_path / "r.jsonl"
    rt.record_request(requests, _key(), s90.kernel_request(SMALL_CONFIG, SMALL_PROBLEM))
    with pytest.raises(ValueError, match=r"also asks for kernels of \['sm_90a'\]"):
        aot.build_requests(str(requests), "sm_100a", str(tmp_path / "out"))
    with pytest.raises(ValueError, match="arch: expected one of"):
        aot.build_requests(str(requests), "sm_80", str(tmp_path / "out"))
    bad = dict(s90.kernel_request(SMALL_CONFIG, SMALL_PROBLEM))
    bad["config"] = dict(bad["config"], tile_n=100)
    with pytest.raises(ValueError, match=r"requests\[1\]: tile_n"):
        s90.compile_requests([bad], tmp_path / "out")
    with pytest.raises(ValueError, match=r"requests\[1\]: expected a sm90_grouped_gemm request"):
        s90.compile_requests([sm100.kernel_request(sm100.Sm100GemmConfig(), sm100.Sm100Problem(
            GemmStage.GEMM2, 256, 128, 4))], tmp_path / "out")


@NEEDS_DSL
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to export")
def test_aot_build_requests_compiles_exactly_the_recorded_kernels(tmp_path):
    requests = tmp_path / "requests.jsonl"
    other = s90.Sm90GemmConfig(tile_n=128, scheduler=s90.Scheduler.DYNAMIC)
    for config in (SMALL_CONFIG, other, SMALL_CONFIG):
        rt.record_request(requests, s90.kernel_key(config, SMALL_PROBLEM), s90.kernel_request(config, SMALL_PROBLEM))
    out = tmp_path / "bundle"
    done = subprocess.run([sys.executable, "-m", "moe2cta.aot", "build", "--requests", str(requests), "--arch",
                           "sm_90a", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 kernels" in done.stdout
    manifest = rt.read_manifest(out)
    assert set(manifest) == {s90.kernel_key(c, SMALL_PROBLEM).file_stem() for c in (SMALL_CONFIG, other)}
    for entry in manifest.values():
        assert (out / entry["library"]).exists()
