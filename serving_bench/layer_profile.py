"""Where a full MoE layer spends its time: GPU kernel times of one forward, per backend (torch.profiler).

    python -m moe2cta.serving_bench.layer_profile --model deepseek-v3 --tokens 8192 --backends triton cute \
        [--modes eager graph] [--sustain-seconds 3]

Builds moe2cta.MoELayer for each backend on the model preset's random weights, routes uniform N(0,1) router
logits (as the layer benchmark's `uniform` distribution), runs a few warm-up forwards, then profiles
`--iters` forwards and prints each kernel's mean time per forward, largest first, and the sum. The layer
benchmark (python -m moe2cta.serving_bench) gives the graph-replay time of the whole step; this shows which
kernels make it up. Modes (ProfileMode): EAGER launches the forwards one by one (launch gaps are not in the
kernel sum); GRAPH profiles replays of one CUDA graph of the forward, as the layer benchmark times it. With
`--sustain-seconds S` each mode also runs its forwards back to back for S seconds and reports the time per forward
over that window with the board power and SM clock sampled beside it (power.sustain): kernel sum against time per
forward is what the launches and gaps add, and the clock says whether two modes ran at the same speed of the card.
The sum is not additive where the layer launches a kernel as a programmatic dependent launch (the Triton decode path,
the router): such a kernel starts early and its recorded time includes its wait for the one before, so the sum can
exceed the forward's time. The profiled forwards reuse one input (no rotation): weights small enough for L2 may
read faster than in the benchmark. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import collections
import enum
import json
import sys

import torch

from moe2cta import Backend, MoELayer
from moe2cta.presets import get_preset

from .backends import make_expert_weights, preset_layer
from .power import PowerSampler, sustain

__all__ = ["ProfileMode", "EagerForward", "capture_forward", "capture_forward_output", "profile_layer", "profile_calls", "main"]


class ProfileMode(enum.Enum):
    EAGER = "eager"  # forwards launched one by one from Python
    GRAPH = "graph"  # replays of one CUDA graph of the forward (the layer benchmark's timing)


class EagerForward:
    """One eager forward as replay(), the interface of torch.cuda.CUDAGraph that power.sustain replays."""

    def __init__(self, layer: MoELayer, hidden: torch.Tensor, logits: torch.Tensor):
        self.layer, self.hidden, self.logits = layer, hidden, logits

    def replay(self) -> None:
        self.layer(self.hidden, self.logits)


def capture_forward(layer: MoELayer, hidden: torch.Tensor, logits: torch.Tensor, pool=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one forward, captured after warm-up forwards on a side stream (as timing.py captures); pool:
    a graph memory pool to share with graphs that are replayed one at a time (torch.cuda.graph_pool_handle())."""
    return capture_forward_output(layer, hidden, logits, pool)[0]


def capture_forward_output(layer: MoELayer, hidden: torch.Tensor, logits: torch.Tensor, pool=None):
    """(graph, its output tensor): capture_forward, keeping the output that each replay rewrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer(hidden, logits)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = layer(hidden, logits)
    torch.cuda.synchronize()
    return graph, out


def profile_layer(layer: MoELayer, hidden: torch.Tensor, logits: torch.Tensor, iters: int) -> list[tuple[str, float, int]]:
    """[(kernel name, mean us per forward, launches per forward)] of `iters` eager forwards, largest time first."""
    return profile_calls(EagerForward(layer, hidden, logits), iters)


def profile_calls(forward, iters: int) -> list[tuple[str, float, int]]:
    """[(kernel name, mean us per call, launches per call)] of `iters` calls of forward.replay() (an EagerForward
    or a CUDA graph), after three unprofiled ones, largest time first."""
    for _ in range(3):
        forward.replay()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            forward.replay()
        torch.cuda.synchronize()
    total_us = collections.defaultdict(float)
    launches = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us[event.name] += event.device_time
            launches[event.name] += 1
    rows = [(name, us / iters, launches[name] // iters) for name, us in total_us.items()]
    return sorted(rows, key=lambda row: -row[1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model preset name (moe2cta.presets)")
    parser.add_argument("--tokens", type=int, nargs="+", required=True, help="token counts T")
    parser.add_argument("--backends", nargs="+", default=["triton", "cute"], choices=[b.value for b in Backend])
    parser.add_argument("--iters", type=int, default=5, help="profiled forwards per cell (default 5)")
    parser.add_argument("--modes", nargs="+", default=[ProfileMode.EAGER.value], choices=[m.value for m in ProfileMode],
                        help="eager forwards and / or replays of one CUDA graph of the forward (default eager)")
    parser.add_argument("--sustain-seconds", type=float, default=0.0,
                        help="also run each mode's forwards back to back this long: time per forward, power, SM clock")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.iters < 1:
        parser.error(f"--iters: expected >= 1, got {args.iters}")
    if args.sustain_seconds and not args.sustain_seconds > 1.0:
        parser.error(f"--sustain-seconds: expected 0 (off) or more than 1 s (the first second settles), "
                     f"got {args.sustain_seconds}")
    preset = get_preset(args.model)
    dev = torch.device("cuda")
    weights = make_expert_weights(preset, dev, seed=0)
    report = []
    for backend in args.backends:
        layer = preset_layer(preset, weights, backend)
        for tokens in args.tokens:
            gen = torch.Generator(device="cpu").manual_seed(tokens)
            hidden = torch.randn(tokens, preset.hidden, generator=gen).to(dev, torch.bfloat16)
            logits = torch.randn(tokens, preset.num_experts, generator=gen).to(dev)
            ran = layer.backend_for(tokens).value
            for mode in map(ProfileMode, args.modes):
                forward = (EagerForward(layer, hidden, logits) if mode is ProfileMode.EAGER
                           else capture_forward(layer, hidden, logits))
                rows = profile_calls(forward, args.iters)
                total = sum(us for _, us, _ in rows)
                entry = {"model": preset.name, "tokens": tokens, "backend": backend, "runs": ran, "mode": mode.value,
                         "kernel_sum_us": total,
                         "kernels": [{"name": n, "us": us, "launches": c} for n, us, c in rows]}
                line = f"kernel sum {total:.1f} us per forward"
                if args.sustain_seconds:
                    sampler = PowerSampler(torch.cuda.current_device())
                    reading = sustain(forward, 1, args.sustain_seconds, sampler, power_limit_w=sampler.power_limit_w())
                    entry["sustained"] = reading.to_json()
                    line += (f"; sustained {1e3 * reading.ms_per_call:.1f} us per forward at {reading.power_w:.0f} W, "
                             f"{reading.sm_mhz:.0f} MHz ({' '.join(reading.reasons) or 'no throttle reason'})")
                print(f"\n{preset.name} T={tokens} backend={backend} (runs {ran}) mode={mode.value}: {line}")
                for name, us, count in rows:
                    print(f"  {us:10.1f} us  x{count:<3d} {name[:110]}")
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
