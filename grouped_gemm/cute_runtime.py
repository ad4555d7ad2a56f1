"""Getting a compiled CuTe DSL kernel: JIT where the DSL is installed, or a prebuilt bundle without it.

Shared by the sm90 and sm100 grouped GEMM families. A kernel is named by a `KernelKey` that holds static
facts only (dtype, N, K, expert count, tile, cluster, epilogue, arch): the token count M is symbolic in every
compiled kernel, so one kernel serves every batch size.

A bundle is a directory of shared libraries, one per key, made by `export_kernel` (CuTe DSL `export_to_c`
of a kernel compiled with `--enable-tvm-ffi`, linked with `gcc -shared`), plus `manifest.json` with one
entry per key and, on request, the PTX beside each library. `load_kernel` opens one with
`tvm_ffi.load_module`; that needs only `libcute_dsl_runtime.so` and the `tvm_ffi` package, no compiler. The runtime
library is loaded first (`load_cute_dsl_runtime`): from the dynamic loader's path (LD_LIBRARY_PATH), else from an
installed nvidia-cutlass-dsl-libs package. Each entry also records its library's size and sha256; `load_kernel`
refuses a library that no longer matches them before opening it (a truncated library would kill the process when
read).

The bundle directory is found at call time: an explicit argument, else the environment variable
MOE2CTA_KERNEL_DIR (read when asked, never at import).

Provenance: each manifest entry records the digest of the sources its kernel was built from (`kernel_sources_digest`:
the family's module and every module of this package it imports, the loader excepted). `load_kernel` refuses a
library whose entry is missing or names other sources, because a kernel fix that changes no key field would otherwise
keep running the old code. Where the DSL is present the cache then compiles the kernel instead. For an A/B of an older
bundle beside a new one (a benchmark timing both), MOE2CTA_KERNEL_PROVENANCE=warn (read at each load) loads such a
library with a RuntimeWarning instead. An install without the sources (bytecode only, zipped) has no digest to compare:
it refuses every library with that reason unless the variable says warn, and exports none.

Kernel requests: where a kernel can be neither loaded nor compiled, and a requests file is named (argument, or
MOE2CTA_KERNEL_REQUESTS read at call time), the cache appends one JSON line for it (family, configuration,
problem, once per kernel) before it raises. On a machine with the DSL, `python -m moe2cta.aot build --requests
FILE --arch sm_90a --out DIR` then compiles exactly those kernels: run a workload once on the target, build what it asked for.
"""
from __future__ import annotations

import dataclasses
import enum
import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading
import types
import typing
import warnings
from typing import Callable

__all__ = [
    "KERNEL_DIR_ENV",
    "KERNEL_PROVENANCE_ENV",
    "Provenance",
    "provenance_policy",
    "bundle_provenance_problem",
    "KERNEL_REQUESTS_ENV",
    "dataclass_from_json",
    "dataclass_to_json",
    "make_request",
    "read_requests",
    "record_request",
    "requested_kernels",
    "requests_file",
    "KernelKey",
    "kernel_dir",
    "dsl_available",
    "tvm_ffi_available",
    "export_kernel",
    "load_kernel",
    "read_manifest",
    "library_problem",
    "load_cute_dsl_runtime",
    "kernel_sources_digest",
    "SOURCES_UNAVAILABLE",
    "KernelCache",
]

KERNEL_DIR_ENV = "MOE2CTA_KERNEL_DIR"
KERNEL_PROVENANCE_ENV = "MOE2CTA_KERNEL_PROVENANCE"
KERNEL_REQUESTS_ENV = "MOE2CTA_KERNEL_REQUESTS"
MANIFEST_NAME = "manifest.json"


def _token(value) -> str:
    """One filesystem-safe token for a key field."""
    if isinstance(value, (tuple, list)):
        return "x".join(_token(v) for v in value)
    text = str(value.value if hasattr(value, "value") and not isinstance(value, (int, str)) else value)
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-") or "none"


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Static facts that select one compiled kernel (never M, the token count)."""

    family: str  # "sm90_grouped_gemm", "sm100_grouped_gemm", ...
    arch: str  # "sm_90a", "sm_100a"
    dtype: str  # "bfloat16", "float16"
    n: int  # output columns of the GEMM (before a fused gated activation halves them)
    k: int  # reduction length
    num_experts: int
    tile: tuple  # (tile_m, tile_n, tile_k)
    cluster: tuple  # (cluster_m, cluster_n, 1)
    epilogue: str  # "swiglu", "gelu_gated", "swiglu_oai", "row_scale", "plain", ... (+ "_bias")
    extra: tuple = ()  # further static choices: stages, scheduler, raster, ... as (name, value) pairs or values

    def __post_init__(self):
        for name in ("family", "arch", "dtype", "epilogue"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise TypeError(f"KernelKey.{name}: expected a non-empty str, got {getattr(self, name)!r}")
        for name in ("n", "k", "num_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TypeError(f"KernelKey.{name}: expected a positive int, got {value!r}")
        for name in ("tile", "cluster", "extra"):
            if not isinstance(getattr(self, name), tuple):
                raise TypeError(f"KernelKey.{name}: expected a tuple, got {getattr(self, name)!r}")

    def file_stem(self) -> str:
        """Stable, filesystem-safe name of this kernel (the same on every machine and Python run)."""
        parts = [
            _token(self.family),
            _token(self.arch),
            _token(self.dtype),
            f"n{self.n}",
            f"k{self.k}",
            f"e{self.num_experts}",
            "t" + _token(self.tile),
            "c" + _token(self.cluster),
            _token(self.epilogue),
        ]
        for item in self.extra:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                parts.append(_token(item[0]) + _token(item[1]))  # (name, value) pair
            else:
                parts.append(_token(item))
        stem = "_".join(parts)
        if len(stem) > 180:  # keep names short enough for every filesystem; the hash keeps them unique
            digest = hashlib.sha1(stem.encode()).hexdigest()[:12]
            stem = stem[:160] + "_" + digest
        return stem

    def function_name(self) -> str:
        """Symbol of the exported entry function (a C identifier)."""
        return "moe2cta_" + re.sub(r"[^A-Za-z0-9_]", "_", self.file_stem())

    @classmethod
    def from_json(cls, data: dict) -> "KernelKey":
        """The key to_json wrote (a bundle manifest's or a requests file's "key")."""
        if not isinstance(data, dict):
            raise TypeError(f"data: expected a dict of KernelKey fields, got {type(data).__name__}")

        def tuples(value):
            return tuple(tuples(v) for v in value) if isinstance(value, list) else value

        try:
            return cls(**{name: tuples(value) for name, value in data.items()})
        except TypeError as exc:
            raise TypeError(f"data: not a KernelKey ({exc})") from None

    def to_json(self) -> dict:
        return {
            "family": self.family,
            "arch": self.arch,
            "dtype": self.dtype,
            "n": self.n,
            "k": self.k,
            "num_experts": self.num_experts,
            "tile": list(self.tile),
            "cluster": list(self.cluster),
            "epilogue": self.epilogue,
            "extra": [list(x) if isinstance(x, tuple) else x for x in self.extra],
        }


def _checked_path(value, name: str) -> pathlib.Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a path (str or os.PathLike), got {type(value).__name__}")
    if not os.fspath(value):
        raise ValueError(f"{name}: expected a non-empty path, got an empty one")
    return pathlib.Path(value)


def kernel_dir(explicit: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The bundle directory: `explicit`, else $MOE2CTA_KERNEL_DIR (read now), else None. An empty variable counts as
    unset; an explicit path must be a non-empty str or os.PathLike."""
    if explicit is not None:
        return _checked_path(explicit, "directory")
    value = os.environ.get(KERNEL_DIR_ENV)
    return pathlib.Path(value) if value else None


def bundle_dir_problem(directory: pathlib.Path | None) -> str | None:
    """Why `directory` (kernel_dir()'s answer) cannot serve kernels, or None when it is a directory."""
    if directory is None:
        return f"no bundle directory (${KERNEL_DIR_ENV} unset)"
    if not directory.exists():
        return f"the bundle directory {directory} does not exist"
    if not directory.is_dir():
        return f"the bundle directory {directory} is not a directory"
    return None


def requests_file(explicit: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The kernel requests file: `explicit`, else $MOE2CTA_KERNEL_REQUESTS (read now), else None."""
    if explicit is not None:
        return _checked_path(explicit, "requests")
    value = os.environ.get(KERNEL_REQUESTS_ENV)
    return pathlib.Path(value) if value else None


# ---------------------------------------------------------------------------------------------- JSON of configs
def _encode(value):
    if isinstance(value, enum.Enum):
        return value.value
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as JSON")


def dataclass_to_json(obj) -> dict:
    """{field: value} of a frozen config / problem dataclass: enums by value, torch dtypes by name, tuples as
    lists. dataclass_from_json reads it back."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"obj: expected a dataclass instance, got {type(obj).__name__}")
    return {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _decode(hint, value, where: str):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is not type(None):
                try:
                    return _decode(option, value, where)
                except (TypeError, ValueError):
                    continue
        raise ValueError(f"{where}: {value!r} is none of {hint}")
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ValueError(f"{where}: expected one of {[m.value for m in hint]}, got {value!r}") from None
    if getattr(hint, "__module__", None) == "torch" and getattr(hint, "__name__", None) == "dtype":
        import torch

        dtype = getattr(torch, str(value), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: expected a torch dtype name, got {value!r}")
        return dtype
    if typing.get_origin(hint) is tuple or hint is tuple:
        if not isinstance(value, list):
            raise TypeError(f"{where}: expected a list, got {value!r}")
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # JSON writes 2.0 as 2 in some writers
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise TypeError(f"{where}: expected {hint.__name__}, got {value!r}")
        return value
    raise TypeError(f"{where}: cannot read a field of type {hint}")


def dataclass_from_json(cls, data: dict):
    """`cls(**fields)` from dataclass_to_json's dict; a missing field takes its default, an unknown one is an
    error (ValueError / TypeError naming the field)."""
    if not isinstance(data, dict):
        raise TypeError(f"data: expected a dict of {cls.__name__} fields, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"data: {cls.__name__} has no field(s) {unknown}")
    return cls(**{name: _decode(hints[name], value, f"{cls.__name__}.{name}") for name, value in data.items()})


# ---------------------------------------------------------------------------------------------- requests
def make_request(family: str, config, problem) -> dict:
    """{"family", "config", "problem"}: what a family's compile_requests needs to build one kernel elsewhere."""
    return {"family": family, "config": dataclass_to_json(config), "problem": dataclass_to_json(problem)}


def requested_kernels(requests, family: str, config_type, problem_type, can_implement) -> list[tuple]:
    """The distinct (config, problem) pairs of make_request dicts (in order), each of `family` and accepted by the
    family's can_implement; otherwise a ValueError naming the request (1-based) and why."""
    pairs = []
    for number, request in enumerate(requests, 1):
        if not isinstance(request, dict) or request.get("family") != family:
            raise ValueError(f"requests[{number}]: expected a {family} request, got {request!r}")
        try:
            config = dataclass_from_json(config_type, request.get("config"))
            problem = dataclass_from_json(problem_type, request.get("problem"))
        except (TypeError, ValueError) as error:  # a field the config / problem refuses
            raise ValueError(f"requests[{number}]: {error}") from None
        ok, why = can_implement(config, problem)
        if not ok:
            raise ValueError(f"requests[{number}]: {why}")
        pairs.append((config, problem))
    return list(dict.fromkeys(pairs))


def record_request(path: str | os.PathLike, key: "KernelKey", request: dict) -> bool:
    """Append {"stem", "key", "request"} as one JSON line to `path` unless that kernel is already there; True when
    written. `request` holds what its family's compile_requests needs ({"family", "config", "problem"})."""
    if not isinstance(request, dict) or request.get("family") != key.family:
        raise ValueError(f"request: expected a dict with family {key.family!r}, got {request!r}")
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"requests file {path}: is a directory, expected a file (one JSON line per kernel)")
    path.parent.mkdir(parents=True, exist_ok=True)
    stem = key.file_stem()
    with _manifest_lock, open(str(path) + ".lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if any(entry["stem"] == stem for entry in read_requests(path)):
            return False
        with open(path, "ab+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a last line written by hand without its newline: end it first
                    f.write(b"\n")
            record = {"stem": stem, "key": key.to_json(), "request": request}
            f.write((json.dumps(record, sort_keys=True) + "\n").encode())
    return True


def read_requests(path: str | os.PathLike) -> list[dict]:
    """The entries of a requests file, in the order recorded ([] when it does not exist)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a requests file ({exc})") from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from None
        if not isinstance(entry, dict) or not {"stem", "key", "request"} <= set(entry):
            raise ValueError(f"{path}:{number}: expected an object with stem, key and request")
        if not isinstance(entry["key"], dict) or not isinstance(entry["request"], dict):
            raise ValueError(f"{path}:{number}: expected key and request to be JSON objects")
        entries.append(entry)
    return entries


def dsl_available() -> bool:
    """True when the CuTe DSL compiler (nvidia-cutlass-dsl) can be imported here."""
    try:
        return importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cutlass.cute") is not None
    except (ImportError, ValueError):
        return False


def tvm_ffi_available() -> bool:
    try:
        return importlib.util.find_spec("tvm_ffi") is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------- provenance
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
_FAMILY_MODULES = {"sm90_grouped_gemm": "sm90_grouped_gemm", "sm100_grouped_gemm": "sm100_grouped_gemm"}
_NOT_KERNEL_SOURCES = frozenset({"cute_runtime"})  # this loader: it shapes no kernel
# kernel_sources_digest's answer where this install holds no source of the family's module (bytecode only, zipped):
# it matches no manifest entry, and export_kernel refuses to record it
SOURCES_UNAVAILABLE = "unavailable"


def _package_imports(source: str) -> set[str]:
    """Names of this package's modules that `source` imports (`from .x import ...`, `from . import x`), at any depth
    of the file (the families import their kernel modules inside functions)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.update([node.module.split(".")[0]] if node.module else [alias.name for alias in node.names])
    return names


def kernel_source_files(family: str, package_dir: pathlib.Path | None = None) -> list[pathlib.Path] | None:
    """The files whose code a `family` kernel is built from: the family's module and, transitively, every module of
    this package it imports (the loader excepted), sorted; None for a family this runtime does not know; [] where the
    family's module has no source file here (an install of bytecode only, or a zipped one)."""
    if family not in _FAMILY_MODULES:
        return None
    package_dir = _PACKAGE_DIR if package_dir is None else pathlib.Path(package_dir)
    if not (package_dir / f"{_FAMILY_MODULES[family]}.py").is_file():
        return []
    seen: set[str] = set()
    todo = [_FAMILY_MODULES[family]]
    while todo:
        name = todo.pop()
        if name in seen or name in _NOT_KERNEL_SOURCES:
            continue
        path = package_dir / f"{name}.py"
        if not path.is_file():  # a name imported from the package's __init__, not a module file
            continue
        seen.add(name)
        todo.extend(_package_imports(path.read_text()))
    return sorted(package_dir / f"{name}.py" for name in seen)


_DIGESTS: dict = {}


def kernel_sources_digest(family: str, package_dir: pathlib.Path | None = None) -> str | None:
    """sha256 (hex) over the names and bytes of kernel_source_files(family): what a bundle's manifest records for each
    kernel and what load_kernel compares. None for a family this runtime does not know, SOURCES_UNAVAILABLE where this
    install holds no source of it. Computed once per process."""
    cache_key = (family, None if package_dir is None else str(package_dir))
    if cache_key not in _DIGESTS:
        files = kernel_source_files(family, package_dir)
        if not files:
            _DIGESTS[cache_key] = None if files is None else SOURCES_UNAVAILABLE
        else:
            digest = hashlib.sha256()
            for path in files:
                digest.update(path.name.encode() + b"\0" + path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
            _DIGESTS[cache_key] = digest.hexdigest()
    return _DIGESTS[cache_key]


def _distribution_version(name: str) -> str:
    """The installed version of distribution `name` ("unknown" for a source tree or a package not installed)."""
    try:
        import importlib.metadata

        return importlib.metadata.version(name)
    except Exception:  # noqa: BLE001
        return "unknown"


class Provenance(enum.Enum):
    """What load_kernel does with a library whose manifest entry is missing or names other kernel sources."""

    CHECK = "check"  # refuse it (BundleKernelError): the default
    WARN = "warn"  # load it with a RuntimeWarning (an A/B of an older bundle beside a new one)


def provenance_policy() -> Provenance:
    """$MOE2CTA_KERNEL_PROVENANCE, read now: "check" (also when unset or empty) or "warn"."""
    value = os.environ.get(KERNEL_PROVENANCE_ENV) or Provenance.CHECK.value
    try:
        return Provenance(value.strip().lower())
    except ValueError:
        raise ValueError(f"${KERNEL_PROVENANCE_ENV}: expected one of {[p.value for p in Provenance]}, "
                         f"got {value!r}") from None


_MANIFESTS: dict = {}  # manifest path -> ((inode, mtime_ns, size), parsed manifest)


def _cached_manifest(directory: pathlib.Path) -> dict:
    """read_manifest(directory), parsed once per version of the file ({} when there is none)."""
    path = pathlib.Path(directory) / MANIFEST_NAME
    try:
        stat = path.stat()
    except FileNotFoundError:
        return {}
    version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    cached = _MANIFESTS.get(str(path))
    if cached is None or cached[0] != version:
        cached = (version, read_manifest(directory))
        _MANIFESTS[str(path)] = cached
    return cached[1]


def _manifest_entry(directory: pathlib.Path, stem: str) -> dict | None:
    """The manifest entry of `stem` in `directory`, None when there is none."""
    return _cached_manifest(directory).get(stem)


def provenance_problem(key: "KernelKey", directory: pathlib.Path) -> str | None:
    """Why the library of `key` in `directory` may not be the code this moe2cta runs, or None when its manifest entry
    names this runtime's kernel sources (or the family is not one this runtime knows)."""
    expected = kernel_sources_digest(key.family)
    if expected is None:
        return None
    if expected == SOURCES_UNAVAILABLE:
        return _NO_SOURCES
    try:
        entry = _manifest_entry(directory, key.file_stem())
    except ValueError as error:
        return f"its manifest cannot be read ({error})"
    if entry is None:
        return f"{directory / MANIFEST_NAME} has no entry for it, so what it was built from is unknown"
    recorded = entry.get("kernel_sources")
    if recorded is None:
        return "its manifest entry records no kernel sources (a bundle built before moe2cta recorded them)"
    if recorded != expected:
        built_by = entry.get("moe2cta_version", "unknown")
        return (f"it was built from other kernel sources (digest {str(recorded)[:12]}, moe2cta {built_by}) than this "
                f"moe2cta runs ({expected[:12]}, moe2cta {_distribution_version('moe2cta')}), so its code may differ")
    return None


_NO_SOURCES = ("this moe2cta install holds no source of its kernel modules (bytecode only, or zipped), so the bundle's "
               f"provenance cannot be checked; ${KERNEL_PROVENANCE_ENV}=warn loads bundles unchecked")


def bundle_provenance_problem(directory: pathlib.Path, family: str) -> str | None:
    """Why the bundle `directory` can serve no `family` kernel to this moe2cta (it holds none, or none built from this
    version's kernel sources), or None. What a layer's backend check asks before it plans the CuTe path without the
    DSL; under Provenance.WARN only a bundle without any `family` kernel is refused."""
    try:
        manifest = _cached_manifest(directory)
    except (OSError, ValueError) as error:
        return f"the bundle {directory}'s manifest cannot be read ({error})"
    entries = [e for e in manifest.values() if isinstance(e.get("key"), dict) and e["key"].get("family") == family]
    if not entries:
        return f"the bundle {directory} holds no {family} kernel"
    expected = kernel_sources_digest(family)
    if expected is None or provenance_policy() is Provenance.WARN:
        return None
    if expected == SOURCES_UNAVAILABLE:
        return f"the bundle {directory} cannot serve this install: {_NO_SOURCES}"
    if any(e.get("kernel_sources") == expected for e in entries):
        return None
    return (f"the bundle {directory} was built from other kernel sources than this moe2cta's (rebuild it with "
            f"{_build_hint(entries[0]['key'].get('arch', 'ARCH'), directory)})")


_manifest_lock = threading.Lock()


def read_manifest(directory: str | os.PathLike) -> dict:
    """{file_stem: entry} of a bundle directory ({} when it has no manifest)."""
    path = pathlib.Path(directory) / MANIFEST_NAME
    if not path.exists():
        return {}
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a bundle manifest ({exc})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a bundle manifest (JSON: {exc})") from None
    if not isinstance(manifest, dict) or not all(isinstance(v, dict) for v in manifest.values()):
        raise ValueError(f"{path}: not a bundle manifest (expected an object of file stem -> entry object)")
    return manifest


def _without_abi(extra) -> list:
    return [item for item in extra if not (isinstance(item, (list, tuple)) and len(item) == 2 and item[0] == "abi")]


def other_version_note(key: KernelKey, directory: pathlib.Path) -> str:
    """' ...' naming a manifest entry of `directory` for the same kernel under another entry ABI (a bundle built by
    another moe2cta version, whose kernels this version does not call), else ''."""
    try:
        manifest = read_manifest(directory)
    except (OSError, ValueError):
        return ""
    mine = key.to_json()
    mine_rest = {name: value for name, value in mine.items() if name != "extra"}
    for stem, entry in manifest.items():
        other = entry.get("key")
        if not isinstance(other, dict) or other == mine or not isinstance(other.get("extra"), list):
            continue
        if ({name: value for name, value in other.items() if name != "extra"} == mine_rest
                and _without_abi(other["extra"]) == _without_abi(mine["extra"])):
            return (f" ({directory} holds this kernel as {stem}, built for another entry ABI by another moe2cta "
                    "version: rebuild the bundle with this version)")
    return ""


def _write_manifest_entry(directory: pathlib.Path, stem: str, entry: dict) -> None:
    """Read-modify-write under a thread lock and an exclusive file lock, so that several build processes
    exporting into one bundle directory (e.g. one per model preset) keep every entry."""
    with _manifest_lock, open(directory / (MANIFEST_NAME + ".lock"), "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        manifest = read_manifest(directory)
        manifest[stem] = entry
        tmp = directory / f"{MANIFEST_NAME}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        tmp.replace(directory / MANIFEST_NAME)


def export_kernel(
    compiled,
    key: KernelKey,
    out_dir: str | os.PathLike,
    keep_ptx: bool,
    smem_bytes: int | None = None,
    info: dict | None = None,
) -> pathlib.Path:
    """Write `compiled` (a cute.compile result made with --enable-tvm-ffi) as `<out_dir>/<stem>.so`.

    With keep_ptx, the PTX goes beside it as `<stem>.ptx` (needs the kernel compiled with --keep-ptx).
    Adds a manifest entry: the key fields, the entry function name, SMEM bytes and any `info`.
    """
    if not isinstance(key, KernelKey):
        raise TypeError(f"key: expected KernelKey, got {type(key).__name__}")
    import cutlass.cute as cute  # lazy: the DSL is optional

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = key.file_stem()
    sources = kernel_sources_digest(key.family)
    if sources == SOURCES_UNAVAILABLE:
        raise RuntimeError(f"export_kernel: {stem}: this moe2cta install holds no source of its kernel modules, so the "
                           "bundle could not record what the kernel was built from; build from a source install")
    lib_path = out / f"{stem}.so"
    with tempfile.TemporaryDirectory() as tmp:
        obj = pathlib.Path(tmp) / f"{stem}.o"
        compiled.export_to_c(str(obj), function_name=key.function_name())
        libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
        linked = pathlib.Path(tmp) / f"{stem}.so"  # linked aside, then moved: never a truncated library in out_dir
        cmd = ["gcc", "-shared", "-o", str(linked), str(obj), *libs]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"export_kernel: gcc failed for {stem}:\n{result.stderr}")
        library_bytes, library_sha256 = _file_size_and_sha256(linked)
        staged = out / f".{stem}.so.{os.getpid()}.tmp"
        shutil.copyfile(linked, staged)
        staged.replace(lib_path)
    ptx_file = None
    if keep_ptx:
        ptx = getattr(compiled, "__ptx__", None)
        if not ptx:
            raise RuntimeError(f"export_kernel: no PTX kept for {stem}; compile with options '--keep-ptx'")
        ptx_file = out / f"{stem}.ptx"
        ptx_file.write_text(ptx)
    entry = {
        "key": key.to_json(),
        "library": lib_path.name,
        "library_bytes": library_bytes,
        "library_sha256": library_sha256,
        "function": key.function_name(),
        "ptx": ptx_file.name if ptx_file else None,
        "smem_bytes": smem_bytes,
        "kernel_sources": sources,
        "moe2cta_version": _distribution_version("moe2cta"),
        "cutlass_dsl_version": _distribution_version("nvidia-cutlass-dsl"),
    }
    if info:
        entry["info"] = info
    _write_manifest_entry(out, stem, entry)
    return lib_path


def _file_size_and_sha256(path: pathlib.Path) -> tuple[int, str]:
    data = path.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def library_problem(path: pathlib.Path, entry: dict | None) -> str | None:
    """Why the library file `path` is not the one its manifest entry recorded at export (another size or sha256:
    truncated, or changed since), or None. A library whose entry records neither (a bundle exported before moe2cta
    recorded them) is not checked. Checked before the library is opened: the loader maps a truncated library, and
    the process dies (SIGBUS) when it reads the missing part."""
    if not isinstance(entry, dict) or ("library_bytes" not in entry and "library_sha256" not in entry):
        return None
    try:
        size, sha256 = _file_size_and_sha256(path)
    except OSError as exc:
        return f"it cannot be read ({exc})"
    if "library_bytes" in entry and size != entry["library_bytes"]:
        return (f"it holds {size} bytes where its manifest entry recorded {entry['library_bytes']} (truncated or "
                "changed since it was built)")
    if "library_sha256" in entry and sha256 != entry["library_sha256"]:
        return "its sha256 differs from the one its manifest entry recorded (changed since it was built)"
    return None


RUNTIME_LIBRARY = "libcute_dsl_runtime.so"
_runtime_lock = threading.Lock()
_runtime_loaded: list = []  # the ctypes handle of RUNTIME_LIBRARY, once loaded: kept for the process's life


def _packaged_runtime_libraries() -> list[pathlib.Path]:
    """RUNTIME_LIBRARY in an installed nvidia-cutlass-dsl-libs package (nvidia_cutlass_dsl/cu*/lib), found without
    importing the DSL; highest CUDA major first."""
    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found = [path for location in spec.submodule_search_locations
             for path in pathlib.Path(location).glob(f"cu*/lib/{RUNTIME_LIBRARY}")]
    return sorted(found, key=lambda path: (len(path.parent.parent.name), path.parent.parent.name), reverse=True)


def load_cute_dsl_runtime() -> str | None:
    """Load RUNTIME_LIBRARY, which every bundle library needs by name, into this process (RTLD_GLOBAL, once), so that
    the dynamic loader resolves the bundle libraries' dependency to it. Where it is found: the loader's own search
    path first (LD_LIBRARY_PATH, as a deployment without the DSL sets it), else the copy an installed
    nvidia-cutlass-dsl-libs package holds (the DSL itself is not imported). None once loaded, else why not."""
    import ctypes

    with _runtime_lock:
        if _runtime_loaded:
            return None
        tried = []
        for candidate in [RUNTIME_LIBRARY, *map(str, _packaged_runtime_libraries())]:
            try:
                _runtime_loaded.append(ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL))
                return None
            except OSError as exc:
                tried.append(str(exc))
        return (f"{RUNTIME_LIBRARY}, which every bundle library needs, is neither on the dynamic loader's path nor in "
                "an installed nvidia-cutlass-dsl-libs-cu12 / -cu13 package: install that package (the version the "
                f"bundle was built with) or start Python with its lib directory on LD_LIBRARY_PATH ({'; '.join(tried)})")


def _load_failure(exc: Exception, path: pathlib.Path) -> str:
    """What tvm_ffi's failure to open `path` says, in words: a missing dependency named, else the loader's reason."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    reason = reason.replace(str(path), path.name).replace("Check failed: (lib_handle_ != nullptr) is false: ", "")
    missing = re.search(r"([^\s:]+): cannot open shared object file", reason)
    if missing:
        return (f"the dynamic loader does not find {missing.group(1)}, which it needs; put that library's directory on "
                f"LD_LIBRARY_PATH ({reason[-400:]})")
    return f"it cannot be loaded ({reason[-400:]}): it is corrupt, truncated or built for another platform"


def _build_hint(arch: str, directory) -> str:
    return (f"`python -m moe2cta.aot build --model MODEL --arch {arch} --out {directory}` (or `--requests FILE` for the "
            "kernels a workload recorded) on a machine with nvidia-cutlass-dsl")


class BundleKernelError(RuntimeError):
    """A bundle's library for a key exists but cannot serve it: built from other kernel sources than this moe2cta's
    (or of unknown provenance), not loadable (corrupt, truncated, another platform) or without the entry function this
    version calls (built by another moe2cta version)."""


def load_kernel(key: KernelKey, directory: str | os.PathLike) -> Callable:
    """Open `<directory>/<stem>.so` with tvm_ffi and return its entry function (called with torch tensors).
    FileNotFoundError where the library is missing; BundleKernelError where its manifest entry is missing or names
    other kernel sources than this moe2cta's, or where it cannot be loaded or lacks the entry function; both say how
    to build it again."""
    if not isinstance(key, KernelKey):
        raise TypeError(f"key: expected KernelKey, got {type(key).__name__}")
    path = _checked_path(directory, "directory") / f"{key.file_stem()}.so"
    if not path.exists():
        raise FileNotFoundError(
            f"load_kernel: no prebuilt kernel {path.name} in {directory}{other_version_note(key, path.parent)} "
            f"(build it with {_build_hint(key.arch, directory)})"
        )
    stale = provenance_problem(key, path.parent)
    if stale is not None:
        if provenance_policy() is Provenance.CHECK:
            raise BundleKernelError(f"load_kernel: {path} is not loaded: {stale}. Build it again with "
                                    f"{_build_hint(key.arch, path.parent)}")
        warnings.warn(f"load_kernel: {path}: {stale}; loaded anyway (${KERNEL_PROVENANCE_ENV}=warn)", RuntimeWarning,
                      stacklevel=2)
    try:
        changed = library_problem(path, _manifest_entry(path.parent, key.file_stem()))
    except (OSError, ValueError):  # an unreadable manifest: provenance_problem said so unless the policy is WARN
        changed = None
    if changed is not None:
        raise BundleKernelError(f"load_kernel: {path} is not loaded: {changed}. Build it again with "
                                f"{_build_hint(key.arch, path.parent)}")
    try:
        import tvm_ffi  # lazy: only the runtime needs it
    except ImportError as exc:
        raise RuntimeError("load_kernel: the tvm_ffi package (apache-tvm-ffi) is needed to load bundles") from exc
    runtime = load_cute_dsl_runtime()
    if runtime is not None:
        raise BundleKernelError(f"load_kernel: {path} is not loaded: {runtime}")
    try:
        module = tvm_ffi.load_module(str(path))
    except Exception as exc:  # tvm-ffi reports a library dlopen refuses as a RuntimeError from its C++ check
        raise BundleKernelError(
            f"load_kernel: {path}: {_load_failure(exc, path)}. Build it again with {_build_hint(key.arch, path.parent)}"
        ) from exc
    try:
        function = module[key.function_name()]
    except (AttributeError, KeyError) as exc:
        raise BundleKernelError(
            f"load_kernel: {path} has no entry function {key.function_name()}: it was built by another moe2cta "
            f"version. Build it again with {_build_hint(key.arch, path.parent)}"
        ) from exc
    # keep the module alive as long as the function
    return _LoadedKernel(function, module, path)


class _LoadedKernel:
    def __init__(self, function, module, path: pathlib.Path):
        self.function = function
        self.module = module
        self.path = path

    def __call__(self, *args):
        return self.function(*args)

    def __repr__(self) -> str:
        return f"LoadedKernel({self.path.name})"


class KernelCache:
    """In-process kernels by key: JIT through `compile_fn()` where the DSL is present, else a bundle.

    `prefer` chooses when both are possible: "jit" (default) or "bundle" (a prebuilt kernel when one is
    in the bundle directory, else JIT; the sm90 and sm100 families ask for this). A bundle library that cannot be
    loaded (BundleKernelError) is compiled instead, with a RuntimeWarning, where the DSL is present, and raised
    where it is not.
    """

    def __init__(self, directory: str | os.PathLike | None = None, prefer: str = "jit",
                 requests: str | os.PathLike | None = None):
        if prefer not in ("jit", "bundle"):
            raise ValueError(f"prefer: expected 'jit' or 'bundle', got {prefer!r}")
        if directory is not None:
            _checked_path(directory, "directory")
        if requests is not None:
            _checked_path(requests, "requests")
        self._directory = directory
        self._requests = requests
        self._prefer = prefer
        self._kernels: dict[KernelKey, Callable] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kernels)

    def __contains__(self, key: KernelKey) -> bool:
        return key in self._kernels

    def get(self, key: KernelKey, compile_fn: Callable[[], Callable] | None,
            request: Callable[[], dict] | None = None) -> Callable:
        """The kernel for `key`; `compile_fn()` returns a callable compiled kernel (used only with the DSL).
        `request()` describes how to build it ({"family", "config", "problem"}): recorded in the requests file,
        when one is named, if the kernel can be neither loaded nor compiled here."""
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is not None:
                return kernel
            kernel = self._make(key, compile_fn, request)
            self._kernels[key] = kernel
            return kernel

    def _record(self, key: KernelKey, request) -> str:
        """Record the kernel in the requests file (when one is named): ' Recorded in ...' or why not, else ''."""
        path = requests_file(self._requests)
        if path is None or request is None:
            return ""
        try:
            record_request(path, key, request())
        except (OSError, ValueError) as exc:
            return f" Could not record it in the requests file {path} (${KERNEL_REQUESTS_ENV}): {exc}."
        return (f" Recorded in {path}: `python -m moe2cta.aot build --requests {path} --arch {key.arch} "
                "--out DIR` builds every kernel recorded there.")

    def _make(self, key: KernelKey, compile_fn, request=None) -> Callable:
        directory = kernel_dir(self._directory)
        bundle_file = directory / f"{key.file_stem()}.so" if directory is not None else None
        has_bundle = bundle_file is not None and bundle_file.exists()
        can_jit = compile_fn is not None and dsl_available()
        if has_bundle and (self._prefer == "bundle" or not can_jit):
            try:
                return load_kernel(key, directory)
            except BundleKernelError as exc:
                if not can_jit:
                    recorded = self._record(key, request)
                    raise BundleKernelError(f"{exc}{recorded}") from exc
                warnings.warn(f"{exc}; compiling it with the CuTe DSL instead", RuntimeWarning, stacklevel=3)
        if can_jit:
            return compile_fn()
        where = bundle_dir_problem(directory) or f"{bundle_file} does not exist{other_version_note(key, directory)}"
        recorded = self._record(key, request)
        raise RuntimeError(
            f"no way to get kernel {key.file_stem()}: the CuTe DSL (nvidia-cutlass-dsl) is not installed here and "
            f"{where}. Build a bundle on a machine with the DSL (no GPU needed): "
            f"`python -m moe2cta.aot build --model MODEL --arch {key.arch} --out DIR`, then set "
            f"{KERNEL_DIR_ENV}=DIR or pass the directory.{recorded}"
        )
