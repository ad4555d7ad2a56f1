"""What a caller's routing dtypes cost: the layer on precomputed (topk_weights, topk_ids) of different dtypes.

    python -m moe2cta.serving_bench.topk_inputs_bench --models qwen3-30b-a3b gpt-oss-120b --tokens 1 8 64 2048

Callers hand the layer the routing they computed: vLLM and SGLang pass fp32 weights with int32 ids, a model written
on torch (torch.topk) bf16 or fp32 weights with int64 ids. Up to stop 53 the layer converted such inputs to fp32 /
int32 on the device first (a clamp and a cast for the ids, a cast for the weights: three small launches); since stop
54 the kernels read them as given. Per cell, in the same interleaved rounds (graph replay, rotated inputs, medians):
- `fp32+int32`: the engines' dtypes;
- `bf16+int64`: a torch model's dtypes, read as given;
- `bf16+int64 converted`: the same inputs converted the way the layer did before (the launches it no longer makes).
Every rotation's outputs of the three must be bit-identical. Needs a CUDA GPU; a measurement tool.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from moe2cta import Backend, MoELayer, route
from moe2cta.presets import get_preset

from .backends import make_expert_weights, preset_layer
from .timing import TimingConfig, TimingMode, time_interleaved

__all__ = ["main", "VARIANTS"]

VARIANTS = ("fp32+int32", "bf16+int64", "bf16+int64 converted")
ROTATIONS = 4


def _converted(weights: torch.Tensor, ids: torch.Tensor) -> dict:
    """The layer's routing arguments as it converted bf16 weights and int64 ids before stop 54 (three launches)."""
    return {"topk_weights": weights.to(torch.float32).contiguous(),
            "topk_ids": ids.clamp(-1, 2**31 - 1).to(torch.int32).contiguous()}


def time_cell(layer: MoELayer, preset, tokens: int, config: TimingConfig) -> dict:
    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    inputs = []  # per rotation: hidden, then the routing in a torch model's dtypes and in the engines'
    for _ in range(ROTATIONS):
        hidden = torch.randn(tokens, preset.hidden, generator=gen).to(device, torch.bfloat16)
        logits = torch.randn(tokens, preset.num_experts, generator=gen).to(device)
        weights, ids = route(logits, preset.routing, layer.e_score_correction_bias)
        weights = weights.to(torch.bfloat16)  # what all three variants multiply by
        inputs.append((hidden, weights, ids.to(torch.int64), weights.float(), ids.to(torch.int32)))
    fns = {
        "fp32+int32": lambda h, w, i, w32, i32: layer(h, topk_weights=w32, topk_ids=i32),
        "bf16+int64": lambda h, w, i, w32, i32: layer(h, topk_weights=w, topk_ids=i),
        "bf16+int64 converted": lambda h, w, i, w32, i32: layer(h, **_converted(w, i)),
    }
    outputs: dict = {}

    def check(name, rotation, output):
        outputs[name, rotation] = output.clone()

    results = time_interleaved(fns, inputs, device, config, check=check)
    for name, result in results.items():
        if isinstance(result, BaseException):
            raise result
        if result.mode is not TimingMode.CUDA_GRAPH:  # (outputs are checked from the graphs' replays)
            raise RuntimeError(f"{name}: not replayed in a CUDA graph ({result.note})")
    identical = all(torch.equal(outputs[name, r], outputs[VARIANTS[0], r]) for name in VARIANTS
                    for r in range(ROTATIONS))
    return {"model": preset.name, "tokens": tokens, "runs": layer.backend_for(tokens).value,
            "median_us": {name: statistics.median(results[name].samples_us) for name in VARIANTS},
            "p10_us": {name: results[name].percentile(10) for name in VARIANTS},
            "p90_us": {name: results[name].percentile(90) for name in VARIANTS},
            "samples": {name: len(results[name].samples_us) for name in VARIANTS}, "identical_outputs": identical}


def markdown(report: list) -> str:
    lines = ["| model | T | runs | " + " | ".join(f"{v} us" for v in VARIANTS) + " | read as given / converted | "
             "identical |", "|---|---|---|" + "---|" * (len(VARIANTS) + 2)]
    for r in report:
        med = r["median_us"]
        lines.append(f"| {r['model']} | {r['tokens']} | {r['runs']} | "
                     + " | ".join(f"{med[v]:.1f}" for v in VARIANTS)
                     + f" | {med['bf16+int64'] / med['bf16+int64 converted']:.3f} | {r['identical_outputs']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", required=True)
    parser.add_argument("--backend", default="auto", choices=[b.value for b in Backend if b is not Backend.TORCH])
    parser.add_argument("--seconds", type=float, default=0.2, help="sampling time per cell (all variants)")
    parser.add_argument("--repeats", type=int, default=1, help="times each cell is timed (in a row)")
    parser.add_argument("--json")
    parser.add_argument("--md")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens: expected integers >= 1")
    if not args.seconds > 0 or args.repeats < 1:
        parser.error("--seconds, --repeats: expected a time > 0 and a count >= 1")
    presets = [get_preset(name) for name in args.models]  # (names checked before any work)
    if not torch.cuda.is_available():
        print("topk_inputs_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    config = TimingConfig(max_rotation=ROTATIONS, target_seconds=args.seconds, max_samples=max(300, int(args.seconds * 3000)))
    report = []
    for preset in presets:
        weights = make_expert_weights(preset, torch.device("cuda"), seed=0)
        layer = preset_layer(preset, weights, args.backend)
        for tokens in [t for t in args.tokens for _ in range(args.repeats)]:
            r = time_cell(layer, preset, tokens, config)
            report.append(r)
            cells = "  ".join(f"{v} {us:8.1f}" for v, us in r["median_us"].items())
            print(f"{preset.name:16s} T={tokens:6d} ({r['runs']}): {cells} us  identical: {r['identical_outputs']}",
                  flush=True)
        del layer, weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(report))
    return 0 if all(r["identical_outputs"] for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
