"""Ahead-of-time kernel bundles: compile a model's grouped GEMM kernels on a machine without a GPU.

    python -m moe2cta.aot build --model qwen3-30b-a3b --arch sm_90a --out DIR [--keep-ptx]
    python -m moe2cta.aot build --model custom:H,I,E,k[,ACTIVATION[,bias]] --arch sm_90a --out DIR   (a layer of that
    shape: SwiGLU, or e.g. swiglu_oai,bias for a gpt-oss-120b kind of layer)

    python -m moe2cta.aot build --requests FILE --arch sm_90a --out DIR   (exactly the kernels a workload asked for:
    FILE is what a run with MOE2CTA_KERNEL_REQUESTS=FILE recorded where it found neither the DSL nor the kernel)

writes one shared library per kernel (tvm-ffi ABI, symbolic token count) plus manifest.json into DIR, and
with --keep-ptx the PTX beside each. At run time point MOE2CTA_KERNEL_DIR (or the kernel_directory argument)
at DIR; loading needs libcute_dsl_runtime.so and tvm_ffi, not the CuTe DSL compiler.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time

from .presets import custom_preset, get_preset

__all__ = ["build", "build_requests", "main"]

ARCHES = ("sm_90a", "sm_100a")
FAMILY_MODULES = {"sm_90a": "moe2cta.grouped_gemm.sm90_grouped_gemm",
                  "sm_100a": "moe2cta.grouped_gemm.sm100_grouped_gemm"}


def build(model: str, arch: str, out_dir: str, keep_ptx: bool = False) -> list:
    """Compile and export every kernel of `model` for `arch` into out_dir; returns the library paths."""
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {ARCHES}, got {arch!r}")
    preset = custom_preset(model[len("custom:"):]) if model.startswith("custom:") else get_preset(model)
    from moe2cta.grouped_gemm.cute_runtime import dsl_available

    if not dsl_available():
        raise RuntimeError("build: the CuTe DSL (nvidia-cutlass-dsl) is needed to compile kernels")
    if arch == "sm_90a":
        from moe2cta.grouped_gemm.sm90_grouped_gemm import compile_for_preset

        return compile_for_preset(preset, out_dir, keep_ptx=keep_ptx)
    module_name = "moe2cta.grouped_gemm.sm100_grouped_gemm"
    if importlib.util.find_spec(module_name) is None:
        raise RuntimeError(f"build: {module_name} is absent in this checkout: no sm_100a kernels to build")
    module = importlib.import_module(module_name)
    if not hasattr(module, "compile_for_preset"):
        raise RuntimeError(f"build: {module_name} has no compile_for_preset(): no sm_100a kernels to build")
    return module.compile_for_preset(preset, out_dir, keep_ptx=keep_ptx)


def build_requests(requests_path: str, arch: str, out_dir: str, keep_ptx: bool = False) -> list:
    """Compile and export every kernel recorded in a requests file (cute_runtime.record_request) for `arch`;
    returns the library paths. Entries recorded for another arch are an error (the file names a target)."""
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {ARCHES}, got {arch!r}")
    from moe2cta.grouped_gemm.cute_runtime import dsl_available, read_requests

    entries = read_requests(requests_path)
    if not entries:
        raise ValueError(f"requests: {requests_path} holds no kernel requests")
    other = sorted({e["key"].get("arch") for e in entries} - {arch})
    if other:
        raise ValueError(f"requests: {requests_path} also asks for kernels of {other}; build each arch with its --arch")
    if not dsl_available():
        raise RuntimeError("build: the CuTe DSL (nvidia-cutlass-dsl) is needed to compile kernels")
    module = importlib.import_module(FAMILY_MODULES[arch])
    paths = module.compile_requests([e["request"] for e in entries], out_dir, keep_ptx=keep_ptx)
    return [item[-1] if isinstance(item, tuple) else item for item in paths]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe2cta.aot", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile a model's kernels into a bundle directory")
    what = b.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="preset name (moe2cta.presets.PRESETS), or custom:H,I,E,k[,ACTIVATION[,bias]]")
    what.add_argument("--requests", metavar="FILE", help="the kernels recorded in FILE (MOE2CTA_KERNEL_REQUESTS)")
    b.add_argument("--arch", required=True, choices=ARCHES)
    b.add_argument("--out", required=True, help="bundle directory")
    b.add_argument("--keep-ptx", action="store_true", help="write each kernel's PTX beside it")
    args = parser.parse_args(argv)
    start = time.time()
    try:
        if args.requests:
            paths = build_requests(args.requests, args.arch, args.out, args.keep_ptx)
        else:
            paths = build(args.model, args.arch, args.out, args.keep_ptx)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for item in paths:
        print(item[-1] if isinstance(item, tuple) else item)  # sm_100a returns (key, path) pairs
    print(f"{len(paths)} kernels in {time.time() - start:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
