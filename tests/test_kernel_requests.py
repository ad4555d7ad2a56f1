"""Kernel requests (CPU): a run that finds neither the CuTe DSL nor a kernel records what it asked for, and
`python -m moe2cta.aot build --requests FILE` compiles exactly those kernels.

The JSON codec of the config and problem dataclasses round-trips every preset kernel of both families; the cache
records a kernel once, only where it can neither load nor compile it; the build command compiles a recorded
sm_90a kernel (needs nvidia-cutlass-dsl) and refuses files it cannot build from, naming why.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
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
    with pytest.raises(ValueError, match="absent.jsonl does not exist"):
        aot.build_requests(str(tmp_path / "absent.jsonl"), "sm_90a", str(tmp_path / "out"))
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
        library = (out / entry["library"]).read_bytes()
        assert entry["library_bytes"] == len(library)
        assert entry["library_sha256"] == hashlib.sha256(library).hexdigest()
    if not rt.tvm_ffi_available():
        return
    # a fresh process without LD_LIBRARY_PATH (as a deployment that never imports the DSL) opens every library
    code = ("import json, sys\nfrom moe2cta.grouped_gemm import cute_runtime as rt\n"
            "for stem, entry in rt.read_manifest(sys.argv[1]).items():\n"
            "    print(rt.load_kernel(rt.KernelKey.from_json(entry['key']), sys.argv[1]))\n"
            "print('cutlass' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    loaded = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.count("LoadedKernel(") == 2 and loaded.stdout.split()[-1] == "False"


@pytest.mark.parametrize("model", sorted(PRESETS))
def test_every_preset_kernel_reads_back_from_its_key(model):
    """kernel_from_key inverts kernel_key (through the key's JSON, as a manifest holds it) for both families."""
    preset = get_preset(model)
    for module, pairs in ((s90, s90.preset_configs(preset)),
                          (sm100, [(c, p) for p, c in sm100.preset_configs(preset, "bfloat16")])):
        for config, problem in pairs:
            key = rt.KernelKey.from_json(json.loads(json.dumps(module.kernel_key(config, problem).to_json())))
            assert key == module.kernel_key(config, problem)
            config2, problem2 = module.kernel_from_key(key)
            assert module.kernel_key(config2, problem2) == key and problem2 == problem


def test_kernel_from_key_rejects_foreign_and_made_up_keys():
    key = _key()
    with pytest.raises(ValueError, match="expected a sm100_grouped_gemm key"):
        sm100.kernel_from_key(key)
    made_up = rt.KernelKey.from_json(key.to_json() | {"epilogue": "relu"})
    with pytest.raises(ValueError, match="'relu' is no epilogue name"):
        s90.kernel_from_key(made_up)
    odd = rt.KernelKey.from_json(key.to_json() | {"extra": [["stages", 4], ["sched", "sometimes"]]})
    with pytest.raises(ValueError, match="'sometimes' is not a valid Scheduler"):
        s90.kernel_from_key(odd)
    with pytest.raises(TypeError, match="not a KernelKey"):
        rt.KernelKey.from_json({"family": "x"})


def test_requests_from_bundle_leave_out_what_another_bundle_holds(tmp_path):
    """`aot requests --from-bundle` on two manifests (no compile needed: only manifest entries are read)."""
    small, other = tmp_path / "small", tmp_path / "presets"
    pairs = [(SMALL_CONFIG, SMALL_PROBLEM), (s90.Sm90GemmConfig(tile_n=128, scheduler=s90.Scheduler.DYNAMIC),
                                             SMALL_PROBLEM)]
    for directory, chosen in ((small, pairs), (other, pairs[1:])):
        directory.mkdir()
        for config, problem in chosen:
            key = s90.kernel_key(config, problem)
            rt._write_manifest_entry(directory, key.file_stem(), {"key": key.to_json()})
    out = tmp_path / "requests.jsonl"
    cmd = [sys.executable, "-m", "moe2cta.aot", "requests", "--from-bundle", str(small), "--exclude-bundle", str(other),
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "1 kernel requests" in done.stdout
    entries = rt.read_requests(out)
    assert [e["stem"] for e in entries] == [s90.kernel_key(*pairs[0]).file_stem()]
    read_back = entries[0]["request"]  # the same kernel (its stage count now explicit, as the key holds it)
    config = rt.dataclass_from_json(s90.Sm90GemmConfig, read_back["config"])
    assert config == dataclasses.replace(SMALL_CONFIG, stages=s90.resolve_stages(SMALL_CONFIG))
    assert aot.bundle_requests(str(small), str(out)) == 1  # the second kernel; the first is already there
    with pytest.raises(ValueError, match="no manifest.json entries"):
        aot.bundle_requests(str(tmp_path / "nothing"), str(out))


def test_committed_gpu_test_kernels_read_back():
    """serving_bench/gpu-test-kernels.jsonl (the GPU tests' kernels beyond the preset builds) holds requests that
    still name kernels this code builds: each reads back to a config can_implement accepts, with its recorded key."""
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "serving_bench" / "gpu-test-kernels.jsonl"
    entries = rt.read_requests(path)
    assert len(entries) > 100
    for entry in entries:
        request = entry["request"]
        config = rt.dataclass_from_json(s90.Sm90GemmConfig, request["config"])
        problem = rt.dataclass_from_json(s90.Sm90Problem, request["problem"])
        assert s90.can_implement(config, problem) == (True, "")
        assert s90.kernel_key(config, problem) == rt.KernelKey.from_json(entry["key"])
        assert s90.kernel_key(config, problem).file_stem() == entry["stem"]


# ---------------------------------------------------------------------------------------------- bundles that cannot serve
def _tvm_ffi_or_skip():
    if not rt.tvm_ffi_available():
        pytest.skip("apache-tvm-ffi is not installed")


def _stamp(directory, key=None, sources="this"):
    """A manifest entry for `key`, as export_kernel writes it (sources: this runtime's digest, or the value given)."""
    key = key or _key()
    digest = rt.kernel_sources_digest(key.family) if sources == "this" else sources
    entry = {"key": key.to_json(), "library": f"{key.file_stem()}.so"}
    if digest is not None:
        entry["kernel_sources"] = digest
    rt._write_manifest_entry(directory, key.file_stem(), entry)


def test_a_corrupt_library_is_named_with_how_to_rebuild_it(tmp_path):
    _tvm_ffi_or_skip()
    _stamp(tmp_path)
    library = tmp_path / f"{_key().file_stem()}.so"
    for content in (b"", b"not an ELF file at all", b"\x7fELF\x02\x01\x01" + b"\x00" * 40):  # empty, garbage, truncated
        library.write_bytes(content)
        with pytest.raises(rt.BundleKernelError, match="cannot be loaded") as info:
            rt.load_kernel(_key(), tmp_path)
        assert str(library) in str(info.value) and "aot build --model MODEL --arch sm_90a" in str(info.value)


def test_a_library_without_the_entry_function_names_another_version(tmp_path):
    _tvm_ffi_or_skip()
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    source = tmp_path / "other.c"
    source.write_text("int moe2cta_some_other_kernel(void) { return 0; }\n")
    library = tmp_path / f"{_key().file_stem()}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    _stamp(tmp_path)
    with pytest.raises(rt.BundleKernelError, match=f"no entry function {_key().function_name()}.*another moe2cta"):
        rt.load_kernel(_key(), tmp_path)


def test_the_cache_compiles_where_a_bundle_library_is_broken_and_the_dsl_is_here(monkeypatch, tmp_path):
    _tvm_ffi_or_skip()
    (tmp_path / f"{_key().file_stem()}.so").write_bytes(b"garbage")
    _stamp(tmp_path)
    monkeypatch.setattr(rt, "dsl_available", lambda: True)
    with pytest.warns(RuntimeWarning, match="cannot be loaded.*compiling it with the CuTe DSL instead"):
        assert rt.KernelCache(tmp_path, prefer="bundle").get(_key(), lambda: "compiled") == "compiled"
    monkeypatch.setattr(rt, "dsl_available", lambda: False)
    with pytest.raises(rt.BundleKernelError, match="cannot be loaded"):
        rt.KernelCache(tmp_path, prefer="bundle").get(_key(), lambda: "compiled")


def test_a_library_of_other_or_unknown_kernel_sources_is_not_loaded(monkeypatch, tmp_path):
    """A kernel fix that changes no key field leaves the key, and so the library's name, as it was: the manifest's
    digest of the kernel sources is what tells an old library from the code this moe2cta runs."""
    (tmp_path / f"{_key().file_stem()}.so").write_bytes(b"a library this check never opens")
    cases = ((None, "has no entry for it, so what it was built from is unknown"),
             ({}, "records no kernel sources"),
             ({"kernel_sources": "0" * 64, "moe2cta_version": "0.0.9"},
              "built from other kernel sources \\(digest 000000000000, moe2cta 0.0.9\\) than this moe2cta runs \\("
              + rt.kernel_sources_digest(_key().family)[:12]))
    for fields, message in cases:
        (tmp_path / rt.MANIFEST_NAME).unlink(missing_ok=True)
        if fields is not None:
            rt._write_manifest_entry(tmp_path, _key().file_stem(), {"key": _key().to_json(), **fields})
        with pytest.raises(rt.BundleKernelError, match=f"is not loaded: .*{message}.*aot build --model MODEL"):
            rt.load_kernel(_key(), tmp_path)
        monkeypatch.setattr(rt, "dsl_available", lambda: False)
        with pytest.raises(rt.BundleKernelError, match=message):
            rt.KernelCache(tmp_path, prefer="bundle").get(_key(), lambda: "compiled")
        monkeypatch.setattr(rt, "dsl_available", lambda: True)  # where the DSL is present, the kernel is compiled
        with pytest.warns(RuntimeWarning, match=f"{message}.*compiling it with the CuTe DSL instead"):
            assert rt.KernelCache(tmp_path, prefer="bundle").get(_key(), lambda: "compiled") == "compiled"


def test_provenance_warn_loads_a_library_of_other_sources_and_refused_ones_are_recorded(monkeypatch, tmp_path):
    """MOE2CTA_KERNEL_PROVENANCE=warn (an A/B of an older bundle beside a new one) loads such a library with a warning;
    under the default a refused library, where nothing can compile it, is recorded in the requests file."""
    (tmp_path / f"{_key().file_stem()}.so").write_bytes(b"garbage")
    _stamp(tmp_path, sources="0" * 64)
    monkeypatch.setenv(rt.KERNEL_PROVENANCE_ENV, "warn")
    if rt.tvm_ffi_available():
        with pytest.warns(RuntimeWarning, match="built from other kernel sources.*loaded anyway"):
            with pytest.raises(rt.BundleKernelError, match="cannot be loaded"):  # (garbage: it is opened now)
                rt.load_kernel(_key(), tmp_path)
    monkeypatch.setenv(rt.KERNEL_PROVENANCE_ENV, "trust-me")
    with pytest.raises(ValueError, match="MOE2CTA_KERNEL_PROVENANCE: expected one of \\['check', 'warn'\\]"):
        rt.load_kernel(_key(), tmp_path)
    monkeypatch.delenv(rt.KERNEL_PROVENANCE_ENV)
    monkeypatch.setattr(rt, "dsl_available", lambda: False)
    requests = tmp_path / "requests.jsonl"
    with pytest.raises(rt.BundleKernelError, match=f"other kernel sources.*Recorded in {requests}"):
        rt.KernelCache(tmp_path, prefer="bundle", requests=requests).get(
            _key(), None, request=lambda: s90.kernel_request(SMALL_CONFIG, SMALL_PROBLEM))
    assert [e["stem"] for e in rt.read_requests(requests)] == [_key().file_stem()]


def test_kernel_sources_are_the_family_module_and_what_it_imports_from_the_package():
    sm90 = {path.name for path in rt.kernel_source_files("sm90_grouped_gemm")}
    assert {"sm90_grouped_gemm.py", "sm90_config.py", "cute_backend.py", "cute_swapped_backend.py",
            "cute_fused_tail_backend.py", "cute_epilogue.py", "epilogue.py", "budget.py"} <= sm90
    assert "cute_runtime.py" not in sm90 and "sm100_grouped_gemm.py" not in sm90
    sm100 = {path.name for path in rt.kernel_source_files("sm100_grouped_gemm")}
    assert "sm100_grouped_gemm.py" in sm100 and "epilogue.py" in sm100 and "cute_runtime.py" not in sm100
    assert rt.kernel_source_files("some_other_family") is None and rt.kernel_sources_digest("some_other_family") is None
    assert rt.kernel_sources_digest("sm90_grouped_gemm") != rt.kernel_sources_digest("sm100_grouped_gemm")


def test_the_kernel_sources_digest_follows_every_kernel_source_and_nothing_else(tmp_path):
    import shutil as _shutil

    package = pathlib.Path(rt.__file__).resolve().parent
    copy = tmp_path / "package"
    _shutil.copytree(package, copy, ignore=_shutil.ignore_patterns("__pycache__"))
    family = "sm90_grouped_gemm"
    assert rt.kernel_sources_digest(family, copy) == rt.kernel_sources_digest(family)
    for name, changes in (("cute_runtime.py", False), ("router_notes.txt", False),  # the loader; not a module
                          ("cute_epilogue.py", True), ("sm90_config.py", True)):  # imported by the kernel modules
        edited = tmp_path / f"edited-{name}"
        _shutil.copytree(copy, edited)
        target = edited / name
        target.write_text((target.read_text() if target.exists() else "") + "\n# one more line\n")
        assert (rt.kernel_sources_digest(family, edited) != rt.kernel_sources_digest(family)) is changes, name


def test_an_install_without_kernel_sources_checks_no_bundle_silently(tmp_path, monkeypatch):
    """An install of bytecode only (or a zipped one) has no source to digest. Its digest is SOURCES_UNAVAILABLE, not
    the digest of no file: no bundle matches it, the refusal says why and how to load unchecked, and export refuses
    to record it (which would let any such install accept any bundle)."""
    import compileall
    import shutil as _shutil

    package = pathlib.Path(rt.__file__).resolve().parent
    bytecode = tmp_path / "package"
    _shutil.copytree(package, bytecode, ignore=_shutil.ignore_patterns("__pycache__"))
    assert compileall.compile_dir(str(bytecode), quiet=1, legacy=True)
    for source in bytecode.glob("*.py"):
        source.unlink()
    family = _key().family
    assert rt.kernel_source_files(family, bytecode) == []
    assert rt.kernel_sources_digest(family, bytecode) == rt.SOURCES_UNAVAILABLE

    _stamp(tmp_path, sources="this")  # a bundle of this version's sources
    monkeypatch.setattr(rt, "_PACKAGE_DIR", bytecode)
    monkeypatch.setattr(rt, "_DIGESTS", {})
    monkeypatch.delenv(rt.KERNEL_PROVENANCE_ENV, raising=False)
    assert "holds no source of its kernel modules" in rt.provenance_problem(_key(), tmp_path)
    problem = rt.bundle_provenance_problem(tmp_path, family)
    assert "holds no source of its kernel modules" in problem and f"{rt.KERNEL_PROVENANCE_ENV}=warn" in problem
    rt._write_manifest_entry(tmp_path, _key().file_stem(),
                             {"key": _key().to_json(), "kernel_sources": rt.SOURCES_UNAVAILABLE})
    assert "holds no source of its kernel modules" in rt.bundle_provenance_problem(tmp_path, family)
    monkeypatch.setenv(rt.KERNEL_PROVENANCE_ENV, "warn")
    assert rt.bundle_provenance_problem(tmp_path, family) is None
    pytest.importorskip("cutlass.cute")
    with pytest.raises(RuntimeError, match="holds no source of its kernel modules"):
        rt.export_kernel(object(), _key(), tmp_path / "out", keep_ptx=False)
    with pytest.raises(RuntimeError, match="^build: this moe2cta install holds no source"):  # before any compile
        aot.build("qwen3-30b-a3b", "sm_90a", str(tmp_path / "out"))
    assert not (tmp_path / "out" / f"{_key().file_stem()}.so").exists()


def test_aot_check_names_each_kernel_this_version_would_not_load(tmp_path, capsys):
    other = s90.kernel_key(dataclasses.replace(SMALL_CONFIG, stages=3), SMALL_PROBLEM)
    third = s90.kernel_key(dataclasses.replace(SMALL_CONFIG, stages=4), SMALL_PROBLEM)
    for key in (_key(), other, third):
        _stamp(tmp_path, key, sources="this" if key != other else "f" * 64)
        if key != third:
            (tmp_path / f"{key.file_stem()}.so").write_bytes(b"library")
    usable, problems = aot.check_bundle(str(tmp_path))
    assert usable == 1 and len(problems) == 2
    assert any(line.startswith(other.file_stem()) and "other kernel sources" in line for line in problems)
    assert any(line.startswith(third.file_stem()) and "no library" in line for line in problems)
    assert aot.main(["check", str(tmp_path)]) == 1
    assert "1 of 3 kernels" in capsys.readouterr().out
    (tmp_path / f"{third.file_stem()}.so").write_bytes(b"library")
    _stamp(tmp_path, other)
    assert aot.check_bundle(str(tmp_path)) == (3, [])
    assert aot.main(["check", str(tmp_path)]) == 0
    assert aot.main(["check", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_the_cache_says_what_is_wrong_with_the_bundle_directory(monkeypatch, tmp_path):
    monkeypatch.setattr(rt, "dsl_available", lambda: False)
    monkeypatch.delenv(rt.KERNEL_REQUESTS_ENV, raising=False)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for directory, message in ((tmp_path / "typo", "the bundle directory .*typo does not exist"),
                               (a_file, "the bundle directory .*a-file is not a directory"),
                               (tmp_path, f"{_key().file_stem()}.so does not exist")):
        with pytest.raises(RuntimeError, match=f"no way to get kernel .*{message}"):
            rt.KernelCache(directory).get(_key(), None)
    assert rt.bundle_dir_problem(None).startswith("no bundle directory")
    assert rt.bundle_dir_problem(tmp_path) is None


def test_a_bundle_of_another_entry_abi_is_named(monkeypatch, tmp_path):
    """The same kernel under another entry ABI (a bundle built by another version) is found and named."""
    monkeypatch.setattr(rt, "dsl_available", lambda: False)
    old = _key().to_json()
    old["extra"] = [["abi", 1] if isinstance(item, list) and item[0] == "abi" else item for item in old["extra"]]
    assert old != _key().to_json()
    (tmp_path / rt.MANIFEST_NAME).write_text(json.dumps({"old-stem": {"key": old, "library": "old-stem.so"}}))
    with pytest.raises(RuntimeError, match="holds this kernel as old-stem, built for another entry ABI"):
        rt.KernelCache(tmp_path).get(_key(), None)
    with pytest.raises(FileNotFoundError, match="holds this kernel as old-stem"):
        rt.load_kernel(_key(), tmp_path)
    other_kernel = dict(old, n=old["n"] * 2)  # another kernel altogether: not named
    (tmp_path / rt.MANIFEST_NAME).write_text(json.dumps({"other": {"key": other_kernel}}))
    assert rt.other_version_note(_key(), tmp_path) == ""


def test_an_unusable_requests_file_does_not_hide_the_missing_kernel(monkeypatch, tmp_path):
    monkeypatch.setattr(rt, "dsl_available", lambda: False)
    monkeypatch.setenv(rt.KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(rt.KERNEL_REQUESTS_ENV, str(tmp_path))  # a directory, not a file
    with pytest.raises(RuntimeError, match=f"no way to get kernel .*Could not record it in the requests file "
                                           f".*\\${rt.KERNEL_REQUESTS_ENV}"):
        rt.KernelCache().get(_key(), None, request=lambda: s90.kernel_request(SMALL_CONFIG, SMALL_PROBLEM))


def test_directory_and_requests_arguments_are_checked():
    with pytest.raises(TypeError, match="directory: expected a path"):
        rt.KernelCache(123)
    with pytest.raises(ValueError, match="directory: expected a non-empty path"):
        rt.KernelCache("")
    with pytest.raises(TypeError, match="requests: expected a path"):
        rt.KernelCache(requests=1.5)
    with pytest.raises(ValueError, match="directory: expected a non-empty path"):
        rt.kernel_dir("")


def test_kernel_from_key_rejects_malformed_tiles_and_clusters():
    for change in ({"cluster": []}, {"cluster": [1]}, {"tile": [[1], 128, 64]}):
        with pytest.raises(ValueError, match="key: "):
            s90.kernel_from_key(rt.KernelKey.from_json(_key().to_json() | change))


def test_build_requests_names_a_directory(tmp_path):
    with pytest.raises(ValueError, match="requests: .* is a directory"):
        aot.build_requests(str(tmp_path), "sm_90a", str(tmp_path / "out"))


def test_a_request_its_dataclasses_refuse_is_named_by_number():
    """A request whose config or problem the dataclasses refuse when made (a float tile, zero experts) is named like
    one can_implement refuses: requests[N] and the field."""
    config, problem = s90.preset_configs(PRESETS["qwen3-30b-a3b"])[0]
    good = rt.make_request(s90.FAMILY, config, problem)
    assert rt.requested_kernels([good], s90.FAMILY, s90.Sm90GemmConfig, s90.Sm90Problem, s90.can_implement) == [
        (config, problem)]
    for part, field, value in (("problem", "num_experts", 0), ("config", "tile_k", 64.5)):
        bad = good | {part: good[part] | {field: value}}
        with pytest.raises(ValueError, match=f"^requests\\[2\\]: (Sm90\\w+\\.)?{field}: expected (an )?int"):
            rt.requested_kernels([good, bad], s90.FAMILY, s90.Sm90GemmConfig, s90.Sm90Problem, s90.can_implement)


# ---------------------------------------------------------------------------------------------- bundle files
def test_a_library_changed_since_its_build_is_refused_before_it_is_opened(tmp_path):
    """export_kernel records each library's size and sha256. The loader maps a library, so a truncated one kills the
    process (SIGBUS) when its missing part is read: load_kernel and `aot check` compare before anything opens it."""
    library = tmp_path / f"{_key().file_stem()}.so"
    built = bytes(range(256)) * 4
    library.write_bytes(built)
    _stamp(tmp_path)
    entry = rt.read_manifest(tmp_path)[_key().file_stem()]
    assert rt.library_problem(library, entry) is None  # a bundle from before the record: not checked
    entry |= {"library_bytes": len(built), "library_sha256": hashlib.sha256(built).hexdigest()}
    rt._write_manifest_entry(tmp_path, _key().file_stem(), entry)
    assert rt.library_problem(library, entry) is None and aot.check_bundle(str(tmp_path)) == (1, [])
    for content, message in ((built[:500], "holds 500 bytes where its manifest entry recorded 1024"),
                             (b"", "holds 0 bytes where"),
                             (built[::-1], "its sha256 differs")):
        library.write_bytes(content)
        with pytest.raises(rt.BundleKernelError, match=f"is not loaded: (it )?{message}.*aot build --model MODEL"):
            rt.load_kernel(_key(), tmp_path)
        usable, problems = aot.check_bundle(str(tmp_path))
        assert usable == 0 and len(problems) == 1 and message in problems[0]


def test_a_missing_dependency_of_a_library_is_named_not_called_corruption():
    path = pathlib.Path("/bundle/kernel.so")
    missing = RuntimeError("Check failed: (lib_handle_ != nullptr) is false: Failed to load dynamic shared library "
                           "/bundle/kernel.so libcute_dsl_runtime.so: cannot open shared object file: No such file")
    said = rt._load_failure(missing, path)
    assert said.startswith("the dynamic loader does not find libcute_dsl_runtime.so") and "corrupt" not in said
    assert "corrupt, truncated" in rt._load_failure(RuntimeError("kernel.so: invalid ELF header"), path)


def test_the_runtime_library_is_found_without_ld_library_path_or_named():
    """Bundle libraries need libcute_dsl_runtime.so by name, with no path: load_cute_dsl_runtime takes it from the
    loader's path, else from an installed nvidia-cutlass-dsl-libs package, else says what to install (fresh
    processes: a loaded library stays loaded)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    code = ("from moe2cta.grouped_gemm import cute_runtime as rt\n{patch}"
            "print(repr(rt.load_cute_dsl_runtime()))")
    without = subprocess.run([sys.executable, "-c", code.format(patch="rt._packaged_runtime_libraries = lambda: []\n")],
                             capture_output=True, text=True, env=env, timeout=120)
    assert without.returncode == 0, without.stderr
    assert "libcute_dsl_runtime.so, which every bundle library needs, is neither on the dynamic loader" in without.stdout
    if not rt._packaged_runtime_libraries():
        pytest.skip("no nvidia-cutlass-dsl-libs package here")
    found = subprocess.run([sys.executable, "-c", code.format(patch="")], capture_output=True, text=True, env=env,
                           timeout=120)
    assert found.returncode == 0 and found.stdout.strip() == "None", found.stdout + found.stderr


def test_manifest_and_requests_files_that_cannot_be_read_are_named(tmp_path):
    (tmp_path / rt.MANIFEST_NAME).mkdir()
    with pytest.raises(ValueError, match=f"{tmp_path / rt.MANIFEST_NAME}: not a bundle manifest"):
        rt.read_manifest(tmp_path)
    (tmp_path / rt.MANIFEST_NAME).rmdir()
    (tmp_path / rt.MANIFEST_NAME).write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="manifest.json: not a bundle manifest .*utf-8"):
        rt.read_manifest(tmp_path)
    (tmp_path / f"{_key().file_stem()}.so").write_bytes(b"library")
    with pytest.raises(rt.BundleKernelError, match="its manifest cannot be read"):  # not a bare UnicodeDecodeError
        rt.load_kernel(_key(), tmp_path)
    binary = tmp_path / "r.jsonl"
    binary.write_bytes(b"\xff\n")
    with pytest.raises(ValueError, match="r.jsonl: not a requests file"):
        rt.read_requests(binary)
    with pytest.raises(ValueError, match="requests file .* is a directory"):
        rt.record_request(tmp_path, _key(), s90.kernel_request(SMALL_CONFIG, SMALL_PROBLEM))
    assert not (tmp_path.parent / f"{tmp_path.name}.lock").exists()


def test_a_request_appended_to_a_file_without_its_last_newline_is_a_line_of_its_own(tmp_path):
    requests = tmp_path / "r.jsonl"
    other = s90.kernel_key(dataclasses.replace(SMALL_CONFIG, stages=3), SMALL_PROBLEM)
    rt.record_request(requests, _key(), s90.kernel_request(SMALL_CONFIG, SMALL_PROBLEM))
    requests.write_text(requests.read_text().rstrip("\n"))  # as an editor may save it
    assert rt.record_request(requests, other, s90.kernel_request(dataclasses.replace(SMALL_CONFIG, stages=3),
                                                                 SMALL_PROBLEM))
    assert [entry["stem"] for entry in rt.read_requests(requests)] == [_key().file_stem(), other.file_stem()]


def test_aot_build_checks_what_it_would_write_into_before_compiling(tmp_path, capsys, monkeypatch):
    requests = tmp_path / "r.jsonl"
    rt.record_request(requests, _key(), s90.kernel_request(SMALL_CONFIG, SMALL_PROBLEM))
    monkeypatch.chdir(tmp_path)
    assert aot.main(["build", "--requests", str(requests), "--arch", "sm_90a", "--out", ""]) == 2
    assert "--out: expected a directory path, got an empty one" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / rt.MANIFEST_NAME).write_text('{"x": ')
    assert aot.main(["build", "--requests", str(requests), "--arch", "sm_90a", "--out", str(corrupt)]) == 2
    assert "manifest.json: not a bundle manifest" in capsys.readouterr().err
    assert not list(corrupt.glob("*.so"))  # refused before any compile
    refused = tmp_path / "refused.jsonl"
    entry = rt.read_requests(requests)[0]
    entry["request"]["config"]["stages"] = "six"
    refused.write_text(json.dumps(entry) + "\n")
    assert aot.main(["build", "--requests", str(refused), "--arch", "sm_90a", "--out", str(tmp_path / "never")]) == 2
    assert "requests[1]: Sm90GemmConfig.stages: expected int" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_requests_from_a_bundle_name_an_entry_without_a_key(tmp_path):
    _stamp(tmp_path)
    manifest = rt.read_manifest(tmp_path)
    manifest[_key().file_stem()]["key"]["n"] = "wide"
    (tmp_path / rt.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"from_bundle: {_key().file_stem()}: its manifest entry holds no kernel key"):
        aot.bundle_requests(str(tmp_path), str(tmp_path / "r.jsonl"))
