"""`moe2cta tune`: autotune a model's grouped GEMM configurations, compiled here, timed on a GPU host.

    moe2cta tune build --model qwen3-30b-a3b --arch sm_90a --out DIR [--buckets 1 2 4 ...] [--top 6]
        (needs the CuTe DSL, no GPU) compiles into DIR every kernel the run step times: per bucket and GEMM,
        the family default and the planner's `top` best shapes (tuning.candidates_to_time); kernels do not
        depend on the token count, so buckets share them and each is built once. The preset's default
        kernels (moe2cta.aot) are built too, so DIR also serves the untuned layer.
    moe2cta tune run --model qwen3-30b-a3b --arch sm_90a [--kernel-dir DIR] [--cache PATH] [--json OUT]
                     [--rows equal|routed]
        (needs a GPU and the bundle, not the DSL) runs each candidate once against the torch twin (a wrong
        kernel is reported, never cached), times the right ones, writes the fastest per bucket into the
        tuning cache (--cache, else $MOE2CTA_TUNING_CACHE, else ~/.cache/moe2cta/tuning.json) and prints one
        table per GEMM. Refuses inside CUDA-graph capture. --rows routed times each bucket on counts spread as
        uniform routing spreads them (tuning.BucketRows: partial row blocks and padding, as real batches have);
        the candidates, and so the bundle, are the same as for equal rows.
    --model custom:H,I,E,k[,ACTIVATION[,bias]] names a layer of that shape (SwiGLU by default; as in moe2cta.aot).

Use the same --buckets and --top for both steps (a kernel missing from the bundle is reported as failed).
Only sm_90a for now: the sm_100a family has no (config -> default candidate) mapping here yet.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import planner, tuning
from .grouped_gemm.budget import Arch
from .presets import model_preset
from .validation import output_dir, output_file

__all__ = ["DEFAULT_BUCKETS", "DEFAULT_TOP", "PlannedKernel", "plan_kernels", "build", "run", "main"]

ARCHES = ("sm_90a",)
# every power of two up to 4096 rows per expert: a layer's bucket is then always tuned (exact-bucket lookup)
DEFAULT_BUCKETS = tuple(b for b in tuning.BUCKETS if b <= 4096)
DEFAULT_TOP = 6


def _preset(model: str):
    return model_preset(model)


def gemm_shapes(preset) -> list[tuple[planner.GemmKind, int, int, dict]]:
    """[(kind, n, k, GemmProblem fields)] of the layer's two GEMMs (GEMM2 with the router-weight row scale)."""
    h, i = preset.hidden, preset.intermediate
    return [
        (planner.GemmKind.GEMM1, 2 * i, h, dict(activation=preset.activation, has_bias=preset.has_bias)),
        (planner.GemmKind.GEMM2, h, i, dict(has_bias=preset.has_bias, has_row_scale=True)),
    ]


class PlannedKernel:
    """One kernel the run step may time: its family config and problem, its key, and where it is used."""

    def __init__(self, config, family_problem, key):
        self.config, self.family_problem, self.key = config, family_problem, key
        self.uses: list[tuple[str, int, str]] = []  # (gemm, bucket, role)


def plan_kernels(preset, arch: str, buckets, top: int, dtype: str = "bfloat16") -> dict[str, PlannedKernel]:
    """{kernel file stem: PlannedKernel} over both GEMMs and all buckets, deduplicated (M-free keys)."""
    arch = Arch.parse(arch)
    if arch is not Arch.SM90:
        raise ValueError(f"arch: `moe2cta tune` supports {ARCHES}, got {arch.value!r}")
    from .grouped_gemm import sm90_grouped_gemm as s90

    kernels: dict[str, PlannedKernel] = {}
    for kind, n, k, fields in gemm_shapes(preset):
        for bucket in buckets:
            problem = tuning.bucket_problem(kind, preset.num_experts, n, k, bucket, dtype=dtype, **fields)
            family_problem = tuning.sm90_problem(problem)
            for role, candidate in tuning.candidates_to_time(problem, arch, top):
                config = planner.to_kernel_config(candidate, problem)
                key = s90.kernel_key(config, family_problem)
                planned = kernels.setdefault(key.file_stem(), PlannedKernel(config, family_problem, key))
                planned.uses.append((kind.value, bucket, role))
    return kernels


def build(model: str, arch: str, out_dir: str, buckets=DEFAULT_BUCKETS, top: int = DEFAULT_TOP,
          log=print) -> list:
    """Compile the preset's default kernels plus every planned kernel into out_dir; returns the library paths."""
    from .grouped_gemm.cute_runtime import dsl_available

    preset = _preset(model)
    kernels = plan_kernels(preset, arch, buckets, top)
    if not dsl_available():
        raise RuntimeError("build: the CuTe DSL (nvidia-cutlass-dsl) is needed to compile kernels")
    from .grouped_gemm import sm90_grouped_gemm as s90

    defaults = {s90.kernel_key(c, p).file_stem() for c, p in s90.preset_configs(preset)}
    extra = [(pk.config, pk.family_problem) for stem, pk in kernels.items() if stem not in defaults]
    log(f"{preset.name}: {len(kernels)} kernels to time ({len(kernels) - len(extra)} among the preset defaults), "
        f"{len(defaults)} preset defaults; compiling {len(defaults) + len(extra)}")
    return s90.compile_for_preset(preset, out_dir, extra_configs=extra)


def _row(gemm: str, bucket: int, trials: list, entry) -> dict:
    """One table row: the default's, the planner's first and the best time of a bucket, and the rejects."""
    by_role = {}
    for t in trials:
        for role in t.role.split(" = "):
            by_role[role] = t

    def cell(t):
        if t is None:
            return None
        return {"label": t.candidate.label(), "status": t.status, "us": None if t.seconds is None else t.seconds * 1e6,
                "detail": t.detail}

    default, first = by_role.get("default"), by_role.get("planner 1")
    best = cell(next((t for t in trials if entry is not None and t.candidate == entry.candidate and t.seconds), None))
    base = default.seconds if default is not None and default.seconds else None
    return {
        "gemm": gemm,
        "bucket": bucket,
        "default": cell(default),
        "planner": cell(first),
        "best": best,
        "speedup_vs_default": (base / entry.seconds) if (base and entry is not None) else None,
        "speedup_vs_planner": (first.seconds / entry.seconds) if (first and first.seconds and entry) else None,
        "tried": len(trials),
        "wrong": [cell(t) for t in trials if t.status == "wrong"],
        "failed": [cell(t) for t in trials if t.status == "failed"],
    }


def format_table(rows: list[dict]) -> str:
    def c(cell):
        if cell is None:
            return "-"
        if cell["us"] is None:
            return f"{cell['label']} {cell['status'].upper()}"
        return f"{cell['label']} {cell['us']:.1f}us"

    lines = []
    for gemm in dict.fromkeys(r["gemm"] for r in rows):
        lines.append(f"{gemm}:")
        lines.append(f"  {'bucket':>6}  {'default':<38} {'planner 1':<38} {'best':<38} {'vs def':>6} {'vs plan':>7}  bad")
        for r in (r for r in rows if r["gemm"] == gemm):
            sd = f"{r['speedup_vs_default']:.2f}x" if r["speedup_vs_default"] else "-"
            sp = f"{r['speedup_vs_planner']:.2f}x" if r["speedup_vs_planner"] else "-"
            bad = len(r["wrong"]) + len(r["failed"])
            lines.append(f"  {r['bucket']:>6}  {c(r['default']):<38} {c(r['planner']):<38} {c(r['best']):<38} "
                         f"{sd:>6} {sp:>7}  {bad or ''}")
    return "\n".join(lines)


def run(model: str, arch: str, *, kernel_dir=None, cache_path=None, buckets=DEFAULT_BUCKETS, top: int = DEFAULT_TOP,
        runner=None, timer=None, gpu: str | None = None, log=None,
        rows: "tuning.BucketRows | str" = "equal") -> tuple[list[dict], "tuning.TuningCache"]:
    """Autotune both GEMMs of `model` over `buckets`, timed on `rows` (tuning.BucketRows); returns (table rows, the
    saved cache).

    runner/timer/gpu: stand-ins for tests (default: tuning.cute_runner with its twin check, batched CUDA
    events, the current device's name). The runner's `.check` (when it has one) gates every candidate.
    """
    preset = _preset(model)
    arch_enum = Arch.parse(arch)
    if arch_enum is not Arch.SM90:
        raise ValueError(f"arch: `moe2cta tune` supports {ARCHES}, got {arch!r}")
    rows_mode = tuning.BucketRows.parse(rows)
    tuning._check_not_capturing()
    if runner is None:
        runner = tuning.cute_runner(align=128, kernel_directory=kernel_dir)  # MoELayer's dispatch alignment
    if timer is None:
        timer = tuning.batched_event_timer
    if gpu is None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("run: no CUDA device (the run step times kernels on the GPU; `build` needs none)")
        gpu = torch.cuda.get_device_name()
    cache = tuning.TuningCache(cache_path)
    table = []
    for kind, n, k, fields in gemm_shapes(preset):
        key = tuning.TuningKey(gpu, "bfloat16", preset.num_experts, n, k, tuning.epilogue_name(kind, **fields), 1)
        trials: list = []
        results = tuning.autotune(key, kind, arch_enum, runner, buckets=buckets, top=top, timer=timer, cache=cache,
                                  save=False, log=log, check=getattr(runner, "check", None), trials=trials,
                                  rows=rows_mode, **fields)
        for bucket in buckets:
            table.append(_row(kind.value, bucket, [t for t in trials if t.bucket == bucket], results.get(bucket)))
    if len(cache):
        cache.save()
    return table, cache


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moe2cta tune", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("build", "compile every kernel the run step times (needs the CuTe DSL, no GPU)"),
                       ("run", "time the candidates on this GPU and write the tuning cache (needs the bundle)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--model", required=True, help="preset name (moe2cta.presets.PRESETS), or custom:H,I,E,k[,ACTIVATION[,bias]]")
        p.add_argument("--arch", required=True, choices=ARCHES)
        p.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS),
                       help="rows per expert, powers of two (default: 1 2 4 ... 4096)")
        p.add_argument("--top", type=int, default=DEFAULT_TOP, help=f"planner shapes per bucket (default {DEFAULT_TOP})")
        if name == "build":
            p.add_argument("--out", required=True, help="bundle directory (then MOE2CTA_KERNEL_DIR=DIR on the GPU host)")
        else:
            p.add_argument("--kernel-dir", help="bundle directory (default: $MOE2CTA_KERNEL_DIR)")
            p.add_argument("--cache", help="tuning cache file (default: $MOE2CTA_TUNING_CACHE, else ~/.cache/moe2cta/tuning.json)")
            p.add_argument("--json", help="also write the table rows as JSON here")
            p.add_argument("--verbose", action="store_true", help="print every candidate as it is timed")
            p.add_argument("--rows", choices=[m.value for m in tuning.BucketRows], default="equal",
                           help="how each bucket's rows spread over the experts: equal (default) or routed "
                                "(uniform routing's spread: partial row blocks and padding as real batches have)")
    args = parser.parse_args(argv)
    for b in args.buckets:
        if b not in tuning.BUCKETS:
            parser.error(f"--buckets: expected powers of two in 1..{tuning.MAX_BUCKET}, got {b}")
    if args.top < 1:
        parser.error(f"--top: expected >= 1, got {args.top}")
    start = time.time()
    try:
        # the model and the output paths first: a bad one must not cost the compiles or the GPU timing before it
        model_preset(args.model)
        if args.command == "build":
            output_dir(args.out, "--out")
        else:
            if args.json is not None:
                output_file(args.json, "--json")
            cache_source = "--cache" if args.cache is not None else (
                "$MOE2CTA_TUNING_CACHE" if os.environ.get("MOE2CTA_TUNING_CACHE") else "the default tuning cache")
            output_file(tuning.default_cache_path(args.cache), cache_source)
        if args.command == "build":
            paths = build(args.model, args.arch, args.out, tuple(args.buckets), args.top)
            print(f"{len(paths)} kernels in {time.time() - start:.1f} s -> {args.out}")
            return 0
        log = (lambda line: print(line, flush=True)) if args.verbose else None
        rows, cache = run(args.model, args.arch, kernel_dir=args.kernel_dir, cache_path=args.cache,
                          buckets=tuple(args.buckets), top=args.top, log=log, rows=args.rows)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    for r in rows:
        for cell in r["wrong"]:
            print(f"WRONG {r['gemm']} b{r['bucket']} {cell['label']}: {cell['detail']}")
        for cell in r["failed"]:
            print(f"FAILED {r['gemm']} b{r['bucket']} {cell['label']}: {cell['detail'][:300]}")
    print(f"cache: {cache.path} ({len(cache)} entries); {time.time() - start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "arch": args.arch, "bucket_rows": args.rows, "cache": str(cache.path),
                       "rows": rows}, f, indent=1)
    return 0  # wrong kernels are printed above (and in --json), not an error of the tuning run


if __name__ == "__main__":
    sys.exit(main())
