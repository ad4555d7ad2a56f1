"""`moe2cta-bench` (also `python -m moe2cta.serving_bench`): the serving latency benchmark.

With no arguments on a GPU: a quick default (qwen3-30b-a3b and mixtral-8x7b, T = 1..8192, uniform
routing, the default GPU backends: DEFAULT_GPU_BACKENDS), under two minutes on an H200. `--full`: the whole grid (5 models x
T in {1, 8, 32, 128, 512, 2048, 8192, 32768}); `--models` picks a subset. Without a GPU: a small
qwen3-30b-a3b-like shape on the CPU torch backends, said so in the output.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from moe2cta.presets import PRESETS, custom_preset, get_preset
from moe2cta.validation import output_dir

from .backends import BACKENDS, DEFAULT_CPU_BACKENDS, DEFAULT_GPU_BACKENDS
from .distributions import BenchRouter, DistributionKind, RoutingDistribution
from .floors import DEFAULT_CEILINGS, CeilingSource, Ceilings, FloorCeilings, measure_ceilings
from .progress import Progress, ProgressStyle
from .runner import BackendOrder, CaseStatus, RunConfig, run_benchmark
from .timing import TimingConfig
from .trace import TraceConfig, bucket_tokens

__all__ = ["main", "build_parser", "plan_from_args", "DECODE_TOKENS", "PREFILL_TOKENS"]

DECODE_TOKENS = (1, 8, 32, 128, 512)
PREFILL_TOKENS = (2048, 8192, 32768)
QUICK_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")
QUICK_PREFILL_TOKENS = (2048, 8192)
CPU_PRESET = "256,128,16,4"  # qwen3-30b-a3b-like (E=16 of k=4 here), small enough for 2 CPU cores
CPU_PREFILL_TOKENS = (2048,)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_TRACE = TraceConfig(num_requests=24, arrival_rate=40.0, mean_prompt_tokens=96, mean_output_tokens=16,
                        max_prompt_tokens=512, max_output_tokens=64, token_budget=512, max_running=32)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe2cta-bench",
        description="Serving latency of one MoE layer: moe2cta backends beside torch and flashinfer peers, "
        "against the physical floor of the card.",
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--models", help=f"comma-separated presets or 'all' ({', '.join(PRESETS)})")
    g.add_argument("--custom", action="append", default=[], metavar="H,I,E,k", help="a custom shape (repeatable)")
    g.add_argument("--full", action="store_true", help="the whole grid: 5 models x T in 1..32768")
    g.add_argument("--scenario", choices=("sweep", "decode", "prefill", "trace", "all"), default="sweep",
                   help="decode (T 1..512), prefill (T 2048..32768), sweep = both, trace = serving trace, all")
    g.add_argument("--tokens", type=_int_list, help="token counts of the sweep, e.g. 1,8,32 (overrides the scenario's)")
    g.add_argument("--routing", default="uniform",
                   help="comma-separated: uniform, balanced, zipf[:s], dirichlet[:alpha], hot (default uniform)")
    g.add_argument("--router", choices=[r.value for r in BenchRouter], default=BenchRouter.MODEL.value,
                   help="model: each preset's own router (default); peer: softmax -> top-k -> renormalize for every "
                        "preset, the routing of the peer figures (differs from model only for deepseek-v3)")
    g.add_argument("--backends", help=f"comma-separated or 'all' ({', '.join(BACKENDS)})")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    g.add_argument("--dtype", choices=tuple(DTYPES), help="weights and activations (default bf16; fp32 on CPU, "
                   "where bf16 matmuls are ~10x slower)")
    g.add_argument("--list", action="store_true", help="list presets, backends (with availability) and exit")
    m = p.add_argument_group("method")
    m.add_argument("--floors", choices=[f.value for f in FloorCeilings], default=FloorCeilings.TARGETS.value,
                   help="targets (default): floors at 4.24 TB/s and 792 TFLOP/s, the ceilings the targets and the peer "
                        "figures are defined with; measured: at this card's ceilings, measured at start (they move by "
                        "several percent from start to start)")
    m.add_argument("--no-measure-ceilings", action="store_true", help="do not measure the card's ceilings at start "
                   "(they are recorded beside the floors)")
    m.add_argument("--bandwidth-tbps", type=float, help="copy bandwidth for the floor (TB/s)")
    m.add_argument("--peak-tflops", type=float, help="bf16 matmul peak for the floor (TFLOP/s)")
    m.add_argument("--time-per-case", type=float, help="seconds of sampling per case (default 0.2 GPU, 0.05 CPU)")
    m.add_argument("--settle-seconds", type=float, default=0.0,
                   help="replay each case untimed for this long before its samples, so that they see the clock of a "
                        "sustained load (default 0: samples right after the warm-up; on a power-capped H200 the first "
                        "~0.1 s after a rest run at the boost clock)")
    m.add_argument("--max-samples", type=int, default=300)
    m.add_argument("--check-rows", default="all",
                   help="token rows checked against the fp32 reference: 'all' (default) or a number of evenly "
                        "spaced rows")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--order", choices=[o.value for o in BackendOrder], default=BackendOrder.SEQUENTIAL.value,
                   help="sequential: one backend at a time, freed before the next (each in its own power steady "
                        "state; least memory); interleaved: every cell times its backends in the same rounds (no "
                        "drift between them; on a power-capped card a replay inherits its predecessor's clock)")
    t = p.add_argument_group("serving trace")
    t.add_argument("--trace-requests", type=int, help="requests (default 200; CPU 24)")
    t.add_argument("--trace-rate", type=float, help="Poisson arrivals per second (default 8)")
    t.add_argument("--trace-prompt", type=int, help="mean prompt tokens (default 1024)")
    t.add_argument("--trace-output", type=int, help="mean output tokens (default 256)")
    t.add_argument("--trace-budget", type=int, help="tokens per step (default 8192)")
    t.add_argument("--trace-max-running", type=int, help="requests in flight (default 256)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="output folder (default ./moe2cta-bench-YYYYmmdd-HHMMSS)")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--progress", choices=[s.value for s in ProgressStyle], default="auto")
    return p


def _check_rows(text: str) -> int | None:
    """--check-rows: 'all' -> None (every row), else an int >= 1."""
    if str(text).strip().lower() == "all":
        return None
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"--check-rows: expected 'all' or an int >= 1 (token rows checked against the reference), "
                         f"got {text!r}")
    return rows


def _device(choice: str) -> torch.device:
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("moe2cta-bench: --device cuda but torch sees no CUDA GPU")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _trace_config(args, on_gpu: bool) -> TraceConfig:
    base = TraceConfig() if on_gpu else CPU_TRACE
    overrides = {
        "num_requests": args.trace_requests,
        "arrival_rate": args.trace_rate,
        "mean_prompt_tokens": args.trace_prompt,
        "mean_output_tokens": args.trace_output,
        "token_budget": args.trace_budget,
        "max_running": args.trace_max_running,
        "seed": args.seed,
    }
    changes = {k: v for k, v in overrides.items() if v is not None}
    if "mean_prompt_tokens" in changes:
        changes.setdefault("max_prompt_tokens", max(base.max_prompt_tokens, 16 * changes["mean_prompt_tokens"]))
    if "mean_output_tokens" in changes:
        changes.setdefault("max_output_tokens", max(base.max_output_tokens, 16 * changes["mean_output_tokens"]))
    return dataclasses.replace(base, **changes)


def plan_from_args(args: argparse.Namespace) -> tuple[RunConfig, list[str]]:
    """The run the arguments ask for, and lines to print before it starts."""
    device = _device(args.device)
    on_gpu = device.type == "cuda"
    notes = []
    for name in ("models", "backends"):
        value = getattr(args, name)
        if value is not None and not [x for x in value.split(",") if x.strip()]:
            raise ValueError(f"--{name}: expected a comma-separated list or 'all', got {value!r}")
    for name in ("time_per_case", "bandwidth_tbps", "peak_tflops"):
        value = getattr(args, name)
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"--{name.replace('_', '-')}: expected a finite number > 0, got {value}")
    check_rows = _check_rows(args.check_rows)
    if args.models and args.models.strip().lower() == "all":
        models = [PRESETS[name] for name in PRESETS]
    elif args.models:
        models = [get_preset(name.strip()) for name in args.models.split(",") if name.strip()]
    else:
        models = []
    models += [custom_preset(spec) for spec in args.custom]
    router = BenchRouter(args.router)
    if not models:
        if not on_gpu:
            models = [custom_preset(CPU_PRESET)]
        elif args.full:
            models = [PRESETS[name] for name in PRESETS]
        else:
            models = [PRESETS[name] for name in QUICK_MODELS]
    if not on_gpu:
        chosen = (["the torch backends"] if args.backends is None else []) + (
            [f"the small qwen3-30b-a3b-like preset {models[0].name}"] if not (args.models or args.custom) else [])
        notes.append(
            "No CUDA GPU found: running on the CPU" + (" with " + " and ".join(chosen) if chosen else "")
            + ". CPU times only check the harness; run on a GPU for real numbers."
        )
    if args.tokens:
        tokens = args.tokens
    else:
        prefill = PREFILL_TOKENS if args.full else (QUICK_PREFILL_TOKENS if on_gpu else CPU_PREFILL_TOKENS)
        tokens = {"decode": DECODE_TOKENS, "prefill": prefill, "sweep": DECODE_TOKENS + prefill,
                  "all": DECODE_TOKENS + prefill, "trace": ()}[args.scenario]
    trace = _trace_config(args, on_gpu) if args.scenario in ("trace", "all") else None
    distributions = tuple(RoutingDistribution.parse(x) for x in args.routing.split(",") if x.strip())
    if args.backends and args.backends.strip().lower() == "all":
        backends = tuple(BACKENDS)
    elif args.backends:
        backends = tuple(x.strip() for x in args.backends.split(",") if x.strip())
    else:
        backends = DEFAULT_GPU_BACKENDS if on_gpu else DEFAULT_CPU_BACKENDS
    floor_ceilings = FloorCeilings(args.floors)
    given = args.bandwidth_tbps is not None or args.peak_tflops is not None
    if given and floor_ceilings is FloorCeilings.MEASURED:
        raise ValueError("--floors measured: expected no --bandwidth-tbps / --peak-tflops (those give the floors' "
                         "ceilings themselves)")
    if floor_ceilings is FloorCeilings.MEASURED and (not on_gpu or args.no_measure_ceilings):
        raise ValueError("--floors measured: needs the ceilings measured on a CUDA device (no --no-measure-ceilings)")
    measured = None
    if on_gpu and not args.no_measure_ceilings:
        try:
            measured = measure_ceilings(device)
        except Exception as exc:
            if floor_ceilings is FloorCeilings.MEASURED:
                raise ValueError(f"--floors measured: measuring the ceilings failed ({type(exc).__name__}: {exc})")
            notes.append(f"measuring ceilings failed ({type(exc).__name__}: {exc}); none recorded")
    ceilings = DEFAULT_CEILINGS
    if given:
        ceilings = Ceilings((args.bandwidth_tbps or DEFAULT_CEILINGS.bandwidth / 1e12) * 1e12,
                            (args.peak_tflops or DEFAULT_CEILINGS.matmul_flops / 1e12) * 1e12, CeilingSource.USER)
    elif floor_ceilings is FloorCeilings.MEASURED:
        ceilings = measured
    if not 0 <= args.settle_seconds < float("inf"):
        raise ValueError(f"--settle-seconds: expected a finite number of seconds >= 0, got {args.settle_seconds}")
    timing = TimingConfig(
        warmup_calls=2 if on_gpu else 1,
        target_seconds=args.time_per_case or (0.2 if on_gpu else 0.05),
        max_samples=args.max_samples,
        min_samples=min(10 if on_gpu else 5, args.max_samples),
        max_rotation=8 if on_gpu else 2,  # rotation defeats the GPU's L2; on the CPU it only costs time
        settle_seconds=args.settle_seconds,
    )
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if on_gpu else torch.float32)
    if not on_gpu and dtype is torch.float32 and not args.dtype:
        notes.append("CPU run in fp32 (bf16 matmuls are ~10x slower on CPUs without bf16 units); pass --dtype bf16 to force.")
    if on_gpu and dtype is torch.float32 and not given:
        notes.append("fp32 run: the floors' compute time is at the bf16 matmul rate, so fp32 cells read far above it; "
                     "give --peak-tflops for an fp32 floor.")
    run = RunConfig(tuple(models), tuple(tokens), distributions, backends, device, ceilings, timing, trace,
                    args.seed, check_rows, dtype, BackendOrder(args.order), router, measured)
    if trace is not None and trace.token_budget > 1 << 17:
        raise ValueError("--trace-budget: expected <= 131072 tokens per step")
    return run, notes


def _list(device: torch.device) -> str:
    lines = ["presets:"]
    for p in PRESETS.values():
        lines.append(f"  {p.name:16s} H={p.hidden} I={p.intermediate} E={p.num_experts} k={p.top_k} "
                     f"{p.routing.scoring.value} {p.activation.value}{' +bias' if p.has_bias else ''}")
    lines.append(f"backends (on {device}):")
    for spec in BACKENDS.values():
        ok, why = spec.availability(device)
        lines.append(f"  {spec.name:14s} {spec.family.value:18s} {'available' if ok else 'unavailable: ' + why}")
    lines.append("routing distributions: " + ", ".join(k.value for k in DistributionKind) + " (zipf:S, dirichlet:ALPHA)")
    return "\n".join(lines)


def _case_count(run: RunConfig) -> int:
    tokens = set(run.sweep_tokens)
    if run.trace is not None:
        from .trace import generate_requests, schedule_steps

        steps = schedule_steps(generate_requests(run.trace), run.trace)
        tokens |= {bucket_tokens(s.num_tokens) for s in steps}
    return len(run.models) * len(run.distributions) * len(tokens) * len(run.backends)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(_list(_device(args.device)))
        return 0
    try:
        run, notes = plan_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    out_dir = args.out or Path.cwd() / time.strftime("moe2cta-bench-%Y%m%d-%H%M%S")
    try:
        output_dir(out_dir, "--out")  # before the run: a bad path must not cost the results
    except ValueError as exc:
        parser.error(str(exc))
    for line in notes:
        print(line)
    total = _case_count(run)
    print(
        f"moe2cta-bench: {len(run.models)} model(s) x {len(run.distributions)} routing x "
        f"{len(run.backends)} backend(s), {total} cases on {run.device}; floor ceilings {run.ceilings.describe()}",
        flush=True,
    )
    progress = Progress(total, style=ProgressStyle(args.progress))
    try:
        bench = run_benchmark(run, progress)
    finally:
        progress.close()
    from .plots import write_plots
    from .report import terminal_report, write_reports

    plots, plot_message = ({}, "plots skipped (--no-plots)") if args.no_plots else write_plots(bench, out_dir)
    paths = write_reports(bench, out_dir, plots)
    print(terminal_report(bench))
    for line in notes:
        print(line)
    if plot_message:
        print(plot_message)
    print(f"wrote {paths['json']}, {paths['markdown']}" + "".join(f", {out_dir / f}" for f in plots.values()))
    if bench.results and not any(r.status is CaseStatus.OK for r in bench.results):
        print("moe2cta-bench: no case ran correctly (see the reasons above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
