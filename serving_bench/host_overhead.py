"""Host time of one eager MoELayer forward: what a caller that does not capture CUDA graphs pays per call.

    python -m moe2cta.serving_bench.host_overhead --model qwen3-30b-a3b --tokens 1 8 2048 \\
        --backends triton cute auto [--modes eager graphed graphed-in-place] [--calls 30] [--profile 25 [--sort tottime]] [--json FILE]

For each backend and T, after warm-up forwards: `--calls` forwards are launched while the GPU sleeps behind a long
sleep kernel, so the host never waits for the GPU and the host clock measures the host's own work per forward
(argument checks, planning, kernel lookups, launches). A forward that synchronizes with the GPU shows as a host
time near the sleep's length and is reported as such. Beside it, the GPU time of the same forwards (CUDA events,
after the sleep). With --profile N, the N functions with the most cumulative host time over those calls (cProfile).
--modes picks how a forward is called (CallMode): the MoELayer itself (eager), or a GraphedMoELayer of the same
layer over the --tokens sizes, captured before the timing: graphed (copies in, one replay, a copy out) or
graphed-in-place (the batch in its static_inputs() views, output its static buffer: the replay alone). With
--stages, the host us per forward spent inside each stage of the forward (STAGES: inclusive of what a stage calls,
timed by wrappers around the functions, outside the profiler). Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import enum
import importlib
import io
import json
import pstats
import sys
import time

import torch

from moe2cta import Backend, GraphedMoELayer, GraphOutput, MoELayer
from moe2cta.graphed import capture_size_for
from moe2cta.presets import get_preset

from .backends import make_expert_weights, preset_layer

__all__ = ["CallMode", "STAGES", "host_time_per_forward", "stage_times", "main"]

SLEEP_CYCLES_PER_CALL = 20_000_000  # ~10 ms of GPU sleep per timed forward: far longer than any host forward


class CallMode(enum.Enum):
    EAGER = "eager"  # MoELayer.__call__
    GRAPHED = "graphed"  # GraphedMoELayer.__call__ over the same layer (moe2cta.graphed)
    GRAPHED_IN_PLACE = "graphed-in-place"  # the same, inputs in its static_inputs() views, GraphOutput.STATIC_BUFFER


# (module, attribute path) of each stage --stages times; a missing one is skipped (another backend's module).
STAGES = (
    ("moe2cta.api", "MoELayer.validate"),
    ("moe2cta.api", "_route_dispatch_gpu"),
    ("moe2cta.api", "_dispatch_gpu"),
    ("moe2cta.api", "_forward_triton_tokens"),
    ("moe2cta.api", "_forward_triton"),
    ("moe2cta.api", "_forward_cute"),
    ("moe2cta.api", "_sm90_tuned_configs"),
    ("moe2cta.api", "_token_rows_config"),
    ("moe2cta.api", "sm90_gather_padding"),
    ("moe2cta.tuning", "kernel_configs_for_layer"),
    ("moe2cta.router.api", "route"),
    ("moe2cta.router.api", "dispatch"),
    ("moe2cta.router.api", "_dispatch_buffers"),
    ("moe2cta.router.api", "_launch_dispatch"),
    ("moe2cta.router.api", "gather"),
    ("moe2cta.router.api", "scatter_row_weights"),
    ("moe2cta.router.api", "combine"),
    ("moe2cta.grouped_gemm.sm90_grouped_gemm", "sm90_grouped_gemm1"),
    ("moe2cta.grouped_gemm.sm90_grouped_gemm", "sm90_grouped_gemm2"),
    ("moe2cta.grouped_gemm.sm90_grouped_gemm", "_run"),
    ("moe2cta.grouped_gemm.sm90_grouped_gemm", "_launch_scratch"),
    ("moe2cta.grouped_gemm.sm90_grouped_gemm", "class_counts"),
    ("moe2cta.grouped_gemm.cute_runtime", "_LoadedKernel.__call__"),
    ("moe2cta.grouped_gemm.triton_token_gemv", "token_gemv1"),
    ("moe2cta.grouped_gemm.triton_token_gemv", "token_gemv2_combine"),
    ("moe2cta.grouped_gemm.triton_grouped_gemm", "triton_grouped_gemm1"),
    ("moe2cta.grouped_gemm.triton_grouped_gemm", "triton_grouped_gemm2"),
    ("triton.runtime.jit", "JITFunction.run"),
    ("torch", "empty"),
    ("torch", "zeros"),
)


@contextlib.contextmanager
def stage_times(totals: dict):
    """Wrap each STAGES function while the block runs: totals[name] accumulates [host ns, calls]."""
    undo = []
    for module_name, path in STAGES:
        try:
            owner = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            fn = getattr(owner, attr)
        except (ImportError, AttributeError):
            continue
        entry = totals.setdefault(f"{module_name}.{path}", [0, 0])

        def timed(*args, __fn=fn, __entry=entry, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return __fn(*args, **kwargs)
            finally:
                __entry[0] += time.perf_counter_ns() - t0
                __entry[1] += 1

        setattr(owner, attr, timed)
        undo.append((owner, attr, fn))
    try:
        yield totals
    finally:
        for owner, attr, fn in reversed(undo):
            setattr(owner, attr, fn)


def host_time_per_forward(layer: "MoELayer | GraphedMoELayer", hidden: torch.Tensor, logits: torch.Tensor, calls: int,
                          profiler: cProfile.Profile | None = None) -> tuple[float, float, bool]:
    """(host us per forward, GPU us per forward, whether the host waited for the GPU) over `calls` forwards."""
    for _ in range(3):
        layer(hidden, logits)
    torch.cuda.synchronize()
    sleep_cycles = SLEEP_CYCLES_PER_CALL * calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)
    start.record()
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(calls):
        layer(hidden, logits)
    if profiler is not None:
        profiler.disable()
    host_s = time.perf_counter() - t0
    # the sleep (~10 ms per forward) over before the host is done: some forward waited for the GPU
    waited = start.query()
    end.record()
    end.synchronize()
    gpu_ms = start.elapsed_time(end)
    return 1e6 * host_s / calls, 1e3 * gpu_ms / calls, bool(waited)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model preset name (moe2cta.presets)")
    parser.add_argument("--tokens", type=int, nargs="+", required=True, help="token counts T")
    parser.add_argument("--backends", nargs="+", default=["triton", "cute", "auto"], choices=[b.value for b in Backend])
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=[m.value for m in CallMode],
                        help="how each forward is called (default eager)")
    parser.add_argument("--graph-sizes", type=int, nargs="+",
                        help="the GraphedMoELayer's batch sizes (default: the --tokens counts); a T between two sizes "
                             "runs the larger one, padded")
    parser.add_argument("--calls", type=int, default=30, help="timed forwards per cell (default 30: their launches fit the queue)")
    parser.add_argument("--profile", type=int, default=0, help="print the N functions with the most host time")
    parser.add_argument("--sort", choices=["cumulative", "tottime"], default="cumulative",
                        help="--profile order: cumulative (with callees) or tottime (own time)")
    parser.add_argument("--stages", action="store_true", help="also time each stage of the forward (STAGES)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls: expected >= 1, got {args.calls}")
    if args.profile < 0:
        parser.error(f"--profile: expected >= 0, got {args.profile}")
    if any(t < 0 for t in args.tokens):
        parser.error(f"--tokens: expected counts >= 0, got {args.tokens}")
    graph_sizes = args.graph_sizes or [t for t in args.tokens if t > 0]
    if args.modes != ["eager"] and not graph_sizes:
        parser.error("--modes: the graphed modes need a --tokens count >= 1 (T=0 runs eagerly)")
    if any(t < 1 for t in graph_sizes):
        parser.error(f"--graph-sizes: expected sizes >= 1, got {args.graph_sizes}")
    if not torch.cuda.is_available():
        print("host_overhead needs a CUDA GPU", file=sys.stderr)
        return 2
    preset = get_preset(args.model)
    dev = torch.device("cuda")
    weights = make_expert_weights(preset, dev, seed=0)
    report = []
    for backend in args.backends:
        layer = preset_layer(preset, weights, backend)
        for mode in map(CallMode, args.modes):
            forward = layer
            if mode is not CallMode.EAGER:
                output = GraphOutput.COPY if mode is CallMode.GRAPHED else GraphOutput.STATIC_BUFFER
                forward = GraphedMoELayer(layer, batch_sizes=graph_sizes, output=output)
                forward.capture()
            for tokens in args.tokens:
                gen = torch.Generator(device="cpu").manual_seed(tokens)
                hidden = torch.randn(tokens, preset.hidden, generator=gen).to(dev, torch.bfloat16)
                logits = torch.randn(tokens, preset.num_experts, generator=gen).to(dev)
                if mode is CallMode.GRAPHED_IN_PLACE and 0 < tokens <= max(graph_sizes):
                    static_hidden, static_logits = forward.static_inputs(tokens)
                    static_hidden.copy_(hidden)
                    static_logits.copy_(logits)
                    hidden, logits = static_hidden, static_logits
                host_us, gpu_us, waited = host_time_per_forward(forward, hidden, logits, args.calls)
                # the batch size that runs: a graph's (padded), or T where the call is eager
                size = None if mode is CallMode.EAGER else capture_size_for(tokens, forward.batch_sizes)
                ran = layer.backend_for(size or tokens).value
                note = " (the host waited for the GPU: a forward synchronizes)" if waited else ""
                replay = "" if size is None else f" (graph of {size})"
                print(f"{preset.name} T={tokens} backend={backend} (runs {ran}) {mode.value}{replay}: host {host_us:.1f} us "
                      f"per forward, GPU {gpu_us:.1f} us{note}")
                entry = {"model": preset.name, "tokens": tokens, "backend": backend, "runs": ran, "call": mode.value,
                         "graph_size": size, "host_us_per_forward": host_us, "gpu_us_per_forward": gpu_us,
                         "host_waited_for_gpu": waited}
                if args.profile:
                    profiler = cProfile.Profile()
                    host_time_per_forward(forward, hidden, logits, args.calls, profiler)
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.profile)
                    print(text.getvalue())
                    entry["profile"] = text.getvalue()
                if args.stages:
                    totals = collections.OrderedDict()
                    with stage_times(totals):
                        host_time_per_forward(forward, hidden, logits, args.calls)
                    # (the warm-up forwards inside are timed too: per forward = total / calls made)
                    calls = args.calls + 3
                    stages = {name: (ns / 1e3 / calls, n / calls) for name, (ns, n) in totals.items() if n}
                    for name, (us, n) in stages.items():
                        print(f"    {name:70s} {us:8.1f} us  x{n:g}")
                    entry["stages_us_per_forward"] = {name: us for name, (us, _) in stages.items()}
                    entry["stage_calls_per_forward"] = {name: n for name, (_, n) in stages.items()}
                report.append(entry)
            del forward
        del layer
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
