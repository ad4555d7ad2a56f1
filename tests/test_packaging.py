"""Packaging: one distribution `moe2cta` with import names moe2cta, moe2cta.router, moe2cta.grouped_gemm,
moe2cta.serving_bench; it works as the editable install run from the repo root, and as a wheel installed
into a fresh venv and imported from another folder. Importing it needs no GPU and no CuTe DSL.

The fresh venv reuses this interpreter's torch / triton (a .pth file naming this environment's
site-packages; `--system-site-packages` alone would only reach the base interpreter's), so the test takes
seconds, not a multi-GB install.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig
import urllib.parse
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
IMPORT_NAMES = ("moe2cta", "moe2cta.router", "moe2cta.grouped_gemm", "moe2cta.serving_bench")
FOLDERS = {"moe2cta": "moe2cta", "moe2cta.router": "router", "moe2cta.grouped_gemm": "grouped_gemm",
           "moe2cta.serving_bench": "serving_bench"}

# Imports every package, checks that neither cutlass nor tvm_ffi got imported and CUDA was not initialized,
# runs a tiny layer, and prints where each package came from.
PROBE = """
import json, sys
import torch
import moe2cta, moe2cta.router, moe2cta.grouped_gemm, moe2cta.serving_bench
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'tvm_ffi'))
assert not heavy, heavy
assert not torch.cuda.is_initialized()
h = torch.randn(3, 16); w13 = torch.randn(4, 16, 16); w2 = torch.randn(4, 16, 8); logits = torch.randn(3, 4)
out = moe2cta.fused_moe(h, w13, w2, logits, routing=moe2cta.RoutingConfig(top_k=2), backend='torch')
assert out.shape == (3, 16)
print(json.dumps({n: sys.modules[n].__file__ for n in %r}))
""" % (IMPORT_NAMES,)


def _probe(python: str, cwd: pathlib.Path) -> dict:
    result = subprocess.run([python, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _editable_install() -> bool:
    """Whether an installed moe2cta distribution is an editable install of this repository."""
    from importlib.metadata import distributions

    for dist in distributions(name="moe2cta"):  # a stray moe2cta.egg-info in the repo root has no record
        direct = dist.read_text("direct_url.json")
        if direct:
            info = json.loads(direct)
            url = urllib.parse.urlparse(info.get("url", ""))
            if info.get("dir_info", {}).get("editable") and pathlib.Path(url.path).resolve() == REPO.resolve():
                return True
    return False


@pytest.mark.parametrize("where", ["repo-root", "elsewhere"])
def test_editable_install_maps_every_import_name(where, tmp_path):
    if not _editable_install():
        pytest.skip("moe2cta is not installed in editable mode in this environment")
    cwd = REPO if where == "repo-root" else tmp_path
    files = _probe(sys.executable, cwd)
    for name, folder in FOLDERS.items():
        assert pathlib.Path(files[name]).resolve() == (REPO / folder / "__init__.py").resolve(), (name, files[name])


def _copy_tree(dest: pathlib.Path) -> pathlib.Path:
    """The source tree without VCS data and build outputs (so the build never writes into the repo)."""
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".venv",
                                    "out", "bench-out*", "moe2cta-bench-*", ".whl", ".bundle", ".kernels", "*.ptx")
    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


def _can_build_without_isolation() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def test_wheel_in_fresh_venv_imported_from_another_folder(tmp_path):
    source = _copy_tree(tmp_path / "src")
    wheel_dir = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(source)]
    if _can_build_without_isolation():
        build.insert(4, "--no-build-isolation")
    result = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    (wheel,) = wheel_dir.glob("moe2cta-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("moe2cta/__init__.py", "moe2cta/api.py", "moe2cta/router/reference.py",
                     "moe2cta/grouped_gemm/epilogue.py", "moe2cta/serving_bench/__init__.py"):
        assert expected in names, expected
    assert not any(n.startswith(("tests/", "router/", "grouped_gemm/")) for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "moe2cta = moe2cta.cli:main" in scripts and "moe2cta-bench = moe2cta.serving_bench.cli:main" in scripts

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    venv_site = pathlib.Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    # reuse this environment's torch / triton: appended after the venv's own site-packages
    ours = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if pathlib.Path(p).is_dir()]
    (venv_site / "_moe2cta_test_reuse.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                             str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    files = _probe(str(python), elsewhere)
    for name in IMPORT_NAMES:
        path = pathlib.Path(files[name]).resolve()
        assert path.is_relative_to(venv_site.resolve()), (name, path)
    result = subprocess.run([str(venv / "bin" / "moe2cta"), "--help"], cwd=elsewhere, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "plan" in result.stdout, result.stderr[-2000:]
    assert (venv / "bin" / "moe2cta-bench").exists()
