"""Where a full MoE layer spends its time: GPU kernel times of one forward, per backend (torch.profiler).

    python -m moe2cta.serving_bench.layer_profile --model deepseek-v3 --tokens 8192 --backends triton cute

Builds moe2cta.MoELayer for each backend on the model preset's random weights, routes uniform N(0,1) router
logits (as the layer benchmark's `uniform` distribution), runs a few warm-up forwards, then profiles
`--iters` forwards and prints each kernel's mean time per forward, largest first, and the sum. The layer
benchmark (python -m moe2cta.serving_bench) gives the graph-replay time of the whole step; this shows which
kernels make it up (eager launches: launch gaps are not in the kernel sum). Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

import torch

from moe2cta import Backend, MoELayer
from moe2cta.presets import get_preset

from .backends import make_expert_weights

__all__ = ["profile_layer", "main"]


def profile_layer(layer: MoELayer, hidden: torch.Tensor, logits: torch.Tensor, iters: int) -> list[tuple[str, float, int]]:
    """[(kernel name, mean us per forward, launches per forward)], largest time first."""
    for _ in range(3):
        layer(hidden, logits)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            layer(hidden, logits)
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
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.iters < 1:
        parser.error(f"--iters: expected >= 1, got {args.iters}")
    preset = get_preset(args.model)
    dev = torch.device("cuda")
    weights = make_expert_weights(preset, dev, seed=0)
    report = []
    for backend in args.backends:
        layer = MoELayer(weights.w13, weights.w2, routing=preset.routing, activation=preset.activation,
                         b13=weights.b13, b2=weights.b2, e_score_correction_bias=weights.e_score_correction_bias,
                         backend=backend)
        for tokens in args.tokens:
            gen = torch.Generator(device="cpu").manual_seed(tokens)
            hidden = torch.randn(tokens, preset.hidden, generator=gen).to(dev, torch.bfloat16)
            logits = torch.randn(tokens, preset.num_experts, generator=gen).to(dev)
            rows = profile_layer(layer, hidden, logits, args.iters)
            ran = layer.backend_for(tokens).value
            total = sum(us for _, us, _ in rows)
            print(f"\n{preset.name} T={tokens} backend={backend} (runs {ran}): kernel sum {total:.1f} us per forward")
            for name, us, count in rows:
                print(f"  {us:10.1f} us  x{count:<3d} {name[:110]}")
            report.append({"model": preset.name, "tokens": tokens, "backend": backend, "runs": ran,
                           "kernel_sum_us": total,
                           "kernels": [{"name": n, "us": us, "launches": c} for n, us, c in rows]})
        del layer
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
