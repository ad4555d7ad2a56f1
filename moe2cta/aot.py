"""Ahead-of-time kernel bundles: compile a model's grouped GEMM kernels on a machine without a GPU.

    python -m moe2cta.aot build --model qwen3-30b-a3b --arch sm_90a --out DIR [--keep-ptx]
    python -m moe2cta.aot build --model custom:H,I,E,k[,ACTIVATION[,bias]] --arch sm_90a --out DIR   (a layer of that
    shape: SwiGLU, or e.g. swiglu_oai,bias for a gpt-oss-120b kind of layer)

    python -m moe2cta.aot build --requests FILE --arch sm_90a --out DIR   (exactly the kernels a workload asked for:
    FILE is what a run with MOE2CTA_KERNEL_REQUESTS=FILE recorded where it found neither the DSL nor the kernel)
    python -m moe2cta.aot requests --from-bundle DIR --out FILE   (a requests file of every kernel in a bundle, to
    build the same bundle elsewhere or with another compiler version)
    python -m moe2cta.aot check DIR   (whether this moe2cta loads every kernel of a bundle: each library present and
    built from this version's kernel sources; exit status 1 when one is not)

writes one shared library per kernel (tvm-ffi ABI, symbolic token count) plus manifest.json into DIR, and
with --keep-ptx the PTX beside each. At run time point MOE2CTA_KERNEL_DIR (or the kernel_directory argument)
at DIR; loading needs libcute_dsl_runtime.so and tvm_ffi, not the CuTe DSL compiler.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time

from .presets import model_preset
from .validation import output_dir, output_file

__all__ = ["build", "build_requests", "bundle_requests", "check_bundle", "main", "read_build_requests"]

ARCHES = ("sm_90a", "sm_100a")
FAMILY_MODULES = {"sm_90a": "moe2cta.grouped_gemm.sm90_grouped_gemm",
                  "sm_100a": "moe2cta.grouped_gemm.sm100_grouped_gemm"}
FAMILIES = {"sm90_grouped_gemm": FAMILY_MODULES["sm_90a"], "sm100_grouped_gemm": FAMILY_MODULES["sm_100a"]}
# each family's (configuration, problem) classes: what a request's two objects are read back into
REQUEST_TYPES = {"sm_90a": ("Sm90GemmConfig", "Sm90Problem"), "sm_100a": ("Sm100GemmConfig", "Sm100Problem")}


def _require_kernel_sources(arch: str) -> None:
    """Before any compile: a bundle records the digest of its kernels' sources, which an install without them (bytecode
    only, zipped) cannot give (export_kernel refuses it too, but only after a kernel has been compiled)."""
    from moe2cta.grouped_gemm.cute_runtime import SOURCES_UNAVAILABLE, kernel_sources_digest

    if kernel_sources_digest(FAMILY_MODULES[arch].rsplit(".", 1)[-1]) == SOURCES_UNAVAILABLE:
        raise RuntimeError("build: this moe2cta install holds no source of its kernel modules (bytecode only, or "
                           "zipped), so a bundle could not record what its kernels were built from; build from a "
                           "source install")


def build(model: str, arch: str, out_dir: str, keep_ptx: bool = False) -> list:
    """Compile and export every kernel of `model` for `arch` into out_dir; returns the library paths."""
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {ARCHES}, got {arch!r}")
    preset = model_preset(model)
    from moe2cta.grouped_gemm.cute_runtime import dsl_available

    if not dsl_available():
        raise RuntimeError("build: the CuTe DSL (nvidia-cutlass-dsl) is needed to compile kernels")
    _require_kernel_sources(arch)
    if arch == "sm_90a":
        from moe2cta.grouped_gemm.sm90_grouped_gemm import compile_for_preset

        return compile_for_preset(preset, out_dir, keep_ptx=keep_ptx)
    module_name = FAMILY_MODULES[arch]
    if importlib.util.find_spec(module_name) is None:
        raise RuntimeError(f"build: {module_name} is absent in this checkout: no sm_100a kernels to build")
    module = importlib.import_module(module_name)
    if not hasattr(module, "compile_for_preset"):
        raise RuntimeError(f"build: {module_name} has no compile_for_preset(): no sm_100a kernels to build")
    return module.compile_for_preset(preset, out_dir, keep_ptx=keep_ptx)


def build_requests(requests_path: str, arch: str, out_dir: str, keep_ptx: bool = False) -> list:
    """Compile and export every kernel recorded in a requests file (cute_runtime.record_request) for `arch`;
    returns the library paths. Entries recorded for another arch are an error (the file names a target)."""
    from moe2cta.grouped_gemm.cute_runtime import dsl_available

    entries = read_build_requests(requests_path, arch)
    if not dsl_available():
        raise RuntimeError("build: the CuTe DSL (nvidia-cutlass-dsl) is needed to compile kernels")
    _require_kernel_sources(arch)
    module = importlib.import_module(FAMILY_MODULES[arch])
    paths = module.compile_requests([e["request"] for e in entries], out_dir, keep_ptx=keep_ptx)
    return [item[-1] if isinstance(item, tuple) else item for item in paths]


def read_build_requests(requests_path: str, arch: str) -> list[dict]:
    """The entries of a requests file to build for `arch`: ValueError where the file is missing, empty, or holds an
    entry of another arch or of none."""
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {ARCHES}, got {arch!r}")
    from moe2cta.grouped_gemm.cute_runtime import read_requests

    if not isinstance(requests_path, str) or not requests_path:
        raise ValueError(f"requests: expected the path of a requests file, got {requests_path!r}")
    if os.path.isdir(requests_path):
        raise ValueError(f"requests: {requests_path} is a directory; expected the requests file (a run with "
                         "MOE2CTA_KERNEL_REQUESTS=FILE writes it)")
    if not os.path.isfile(requests_path):
        raise ValueError(f"requests: {requests_path} does not exist (a run with MOE2CTA_KERNEL_REQUESTS=FILE writes it)")
    entries = read_requests(requests_path)
    if not entries:
        raise ValueError(f"requests: {requests_path} holds no kernel requests")
    without = [number for number, e in enumerate(entries, 1) if not isinstance(e["key"].get("arch"), str)]
    if without:
        raise ValueError(f"requests: {requests_path}: entries {without} name no arch in their key")
    other = sorted({e["key"]["arch"] for e in entries} - {arch})
    if other:
        raise ValueError(f"requests: {requests_path} also asks for kernels of {other}; build each arch with its --arch")
    _check_requests_buildable([e["request"] for e in entries], arch, requests_path)
    return entries


def _check_requests_buildable(requests: list, arch: str, requests_path: str) -> None:
    """Each request read back into its family's configuration and problem and accepted by its can_implement, before
    any compile or output directory: otherwise the ValueError of cute_runtime.requested_kernels, naming the file."""
    from moe2cta.grouped_gemm.cute_runtime import requested_kernels

    module = importlib.import_module(FAMILY_MODULES[arch])
    config_type, problem_type = (getattr(module, name) for name in REQUEST_TYPES[arch])
    try:
        requested_kernels(requests, module.FAMILY, config_type, problem_type, module.can_implement)
    except ValueError as error:
        raise ValueError(f"requests: {requests_path}: {error}") from None


def bundle_requests(bundle_dir: str, out_file: str, exclude_dirs=()) -> int:
    """Append a request for every kernel in bundle_dir's manifest (except those also in the `exclude_dirs` bundles)
    to out_file; returns how many were new there. Each key is read back into its configuration and checked to give
    the same key again, so a file written here builds the same libraries."""
    from moe2cta.grouped_gemm.cute_runtime import KernelKey, read_manifest, record_request

    manifest = read_manifest(bundle_dir)
    if not manifest:
        raise ValueError(f"from_bundle: {bundle_dir} has no manifest.json entries")
    skip = set().union(*(read_manifest(d) for d in exclude_dirs)) if exclude_dirs else set()
    written = 0
    for stem, entry in sorted(manifest.items()):
        if stem in skip:
            continue
        if not isinstance(entry.get("key"), dict):
            raise ValueError(f"from_bundle: {stem}: its manifest entry has no key object")
        try:
            key = KernelKey.from_json(entry["key"])
        except (TypeError, ValueError) as error:
            raise ValueError(f"from_bundle: {stem}: its manifest entry holds no kernel key ({error})") from None
        if key.family not in FAMILIES:
            raise ValueError(f"from_bundle: {stem}: no family {key.family!r} here ({sorted(FAMILIES)})")
        module = importlib.import_module(FAMILIES[key.family])
        written += record_request(out_file, key, module.kernel_request(*module.kernel_from_key(key)))
    return written


def check_bundle(bundle_dir: str) -> tuple[int, list[str]]:
    """(how many of bundle_dir's kernels this moe2cta would load, one line per kernel it would not: its library
    missing, or built from other kernel sources than this version's, or of unknown provenance). The libraries are
    not opened: that needs the runtime, which a build machine may lack; a library whose size or sha256 differs from
    what its entry recorded (truncated, or changed since the build) is one it would not load."""
    import pathlib

    from moe2cta.grouped_gemm.cute_runtime import KernelKey, library_problem, provenance_problem, read_manifest

    directory = pathlib.Path(bundle_dir)
    if not directory.is_dir():
        raise ValueError(f"bundle: {bundle_dir} is not a directory")
    manifest = read_manifest(directory)
    if not manifest:
        raise ValueError(f"bundle: {bundle_dir} has no manifest.json entries")
    usable, problems = 0, []
    for stem, entry in sorted(manifest.items()):
        try:
            key = KernelKey.from_json(entry.get("key"))
        except TypeError as error:
            problems.append(f"{stem}: its manifest entry holds no kernel key ({error})")
            continue
        if key.file_stem() != stem:
            problems.append(f"{stem}: its manifest entry is for {key.file_stem()}")
        elif not (directory / f"{stem}.so").is_file():
            problems.append(f"{stem}: no library {stem}.so")
        elif key.family not in FAMILIES:
            problems.append(f"{stem}: no family {key.family!r} here ({sorted(FAMILIES)})")
        else:
            why = provenance_problem(key, directory) or library_problem(directory / f"{stem}.so", entry)
            if why is None:
                usable += 1
            else:
                problems.append(f"{stem}: {why}")
    return usable, problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moe2cta aot", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile a model's kernels into a bundle directory")
    what = b.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="preset name (moe2cta.presets.PRESETS), or custom:H,I,E,k[,ACTIVATION[,bias]]")
    what.add_argument("--requests", metavar="FILE", help="the kernels recorded in FILE (MOE2CTA_KERNEL_REQUESTS)")
    b.add_argument("--arch", required=True, choices=ARCHES)
    b.add_argument("--out", required=True, help="bundle directory")
    b.add_argument("--keep-ptx", action="store_true", help="write each kernel's PTX beside it")
    r = sub.add_parser("requests", help="write a requests file of every kernel in a bundle")
    r.add_argument("--from-bundle", required=True, metavar="DIR", help="bundle directory (its manifest.json)")
    r.add_argument("--exclude-bundle", action="append", default=[], metavar="DIR",
                   help="leave out the kernels this bundle also holds (repeatable; e.g. the preset builds)")
    r.add_argument("--out", required=True, metavar="FILE", help="requests file (appended, one line per kernel)")
    c = sub.add_parser("check", help="whether this moe2cta loads every kernel of a bundle (exit status 1 if not)")
    c.add_argument("bundle", metavar="DIR", help="bundle directory (its manifest.json)")
    args = parser.parse_args(argv)
    if args.command == "check":
        try:
            usable, problems = check_bundle(args.bundle)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for line in problems[:20]:
            print(line)
        if len(problems) > 20:
            print(f"... and {len(problems) - 20} more")
        print(f"{usable} of {usable + len(problems)} kernels in {args.bundle} are loadable by this moe2cta")
        return 1 if problems else 0
    if args.command == "requests":
        try:
            output_file(args.out, "--out")
            for directory in args.exclude_bundle:
                if not os.path.isfile(os.path.join(directory, "manifest.json")):
                    raise ValueError(f"--exclude-bundle: {directory} has no manifest.json")
            count = bundle_requests(args.from_bundle, args.out, args.exclude_bundle)
        except (OSError, TypeError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{count} kernel requests -> {args.out}")
        return 0
    start = time.time()
    try:
        if args.requests is not None:  # what to build is checked before --out is made
            read_build_requests(args.requests, args.arch)
        else:
            model_preset(args.model)
        output_dir(args.out, "--out")
        from moe2cta.grouped_gemm.cute_runtime import read_manifest

        read_manifest(args.out)  # an unreadable manifest there fails now, not after the compiles
        if args.requests is not None:
            paths = build_requests(args.requests, args.arch, args.out, args.keep_ptx)
        else:
            paths = build(args.model, args.arch, args.out, args.keep_ptx)
    except (OSError, RuntimeError, TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for item in paths:
        print(item[-1] if isinstance(item, tuple) else item)  # sm_100a returns (key, path) pairs
    print(f"{len(paths)} kernels in {time.time() - start:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
