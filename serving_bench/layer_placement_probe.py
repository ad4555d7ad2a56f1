"""Does where the expert weights sit in memory change the layer's speed? Graph-replay times of equal layer copies.

    python -m moe2cta.serving_bench.layer_placement_probe --models mixtral-8x7b deepseek-v3 --tokens 2048 8192

The layer benchmark builds one MoELayer per backend, each with its own prepared weights. Two backends that run the
same kernels (cute and auto at prefill sizes, or cute and cute-tuned where the tuning kept the defaults) have
measured 2-10% apart in one run. This probe separates the two readings: placement (each copy's weights at other
addresses) against time (the card's clock and power drifting between the cases). It builds `--copies` layers with
the same weight values at different addresses (w13 passed prepacked, W13Layout.CHUNKED, so each copy holds one
w13), captures one graph per (copy, rotated input), and replays all of them in interleaved rounds, each round
starting at another copy. Per copy: the median over the rounds and the medians of the even and the odd rounds
(placement shows as copies apart by more than their own halves are). It also checks that every copy's outputs
are bit-identical. Needs a CUDA GPU; a measurement tool, not part of the layer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from moe2cta import Backend, MoELayer, W13Layout, pack_gate_up_rows
from moe2cta.presets import get_preset

from .backends import make_expert_weights
from .layer_profile import capture_forward
from .timing import interleaved_rounds

__all__ = ["main", "placement_summary"]

INPUTS = 4  # rotated inputs per cell (their graphs replay round-robin, as in the layer benchmark)


def placement_summary(times_us: list[list[float]]) -> dict:
    """times_us[copy] = one time per round (in round order) -> medians per copy, per half, and the spreads.

    spread_between: (largest - smallest copy median) / smallest; spread_within: the largest |even - odd| half-median
    difference of one copy, over its median. Placement matters where spread_between clearly exceeds spread_within.
    """
    if not times_us or any(len(t) < 2 for t in times_us):
        raise ValueError("times_us: expected at least one copy with at least two rounds")
    medians = [statistics.median(t) for t in times_us]
    halves = [(statistics.median(t[0::2]), statistics.median(t[1::2])) for t in times_us]
    return {
        "median_us": medians,
        "half_medians_us": halves,
        "spread_between": (max(medians) - min(medians)) / min(medians),
        "spread_within": max(abs(a - b) / m for (a, b), m in zip(halves, medians)),
    }


def probe_cell(layers: list[MoELayer], preset, tokens: int, rounds: int) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    inputs = [(torch.randn(tokens, preset.hidden, generator=gen).to(dev, torch.bfloat16),
               torch.randn(tokens, preset.num_experts, generator=gen).to(dev)) for _ in range(INPUTS)]
    pool = torch.cuda.graph_pool_handle()  # replayed one at a time: one pool
    graphs = {(c, i): capture_forward(layer, *args, pool=pool)
              for i, args in enumerate(inputs) for c, layer in enumerate(layers)}
    outputs = [[layer(*args) for args in inputs] for layer in layers]
    identical = all(torch.equal(out, ref) for per_copy in outputs for out, ref in zip(per_copy, outputs[0]))
    per_graph = interleaved_rounds({key: graph.replay for key, graph in graphs.items()}, rounds)
    times = [[statistics.median(per_graph[c, i][r] for i in range(INPUTS)) for r in range(rounds)]
             for c in range(len(layers))]
    return {"model": preset.name, "tokens": tokens, "runs": layers[0].backend_for(tokens).value,
            "identical_outputs": identical, "times_us": times, **placement_summary(times)}


def _addresses(layer: MoELayer) -> dict:
    w13 = layer.prepared["packed_w13"] if isinstance(getattr(layer, "prepared", None), dict) else layer.w13
    return {"w13": hex(w13.data_ptr()), "w2": hex(layer.w2.data_ptr())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", required=True)
    parser.add_argument("--backend", default="cute", choices=[b.value for b in Backend])
    parser.add_argument("--copies", type=int, default=4, help="layer copies (weights at other addresses)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.copies < 2 or args.rounds < 2:
        parser.error("--copies and --rounds: expected at least 2")
    if not torch.cuda.is_available():
        print("layer_placement_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    report = []
    for name in args.models:
        preset = get_preset(name)
        weights = make_expert_weights(preset, torch.device("cuda"), seed=0)
        small = dict(b13=weights.b13, b2=weights.b2, e_score_correction_bias=weights.e_score_correction_bias)
        packed, w2 = pack_gate_up_rows(weights.w13), weights.w2
        del weights
        layers = [MoELayer(packed.clone(), w2.clone(), routing=preset.routing, activation=preset.activation,
                           w13_layout=W13Layout.CHUNKED, backend=args.backend, **small) for _ in range(args.copies)]
        del packed, w2
        torch.cuda.empty_cache()
        addresses = [_addresses(layer) for layer in layers]
        for tokens in args.tokens:
            r = probe_cell(layers, preset, tokens, args.rounds)
            r["addresses"] = addresses
            cells = "  ".join(f"{us:9.1f}" for us in r["median_us"])
            print(f"{name:16s} T={tokens:6d} ({r['runs']}): copies {cells} us; between {r['spread_between']:.3f}, "
                  f"within {r['spread_within']:.3f}; identical outputs: {r['identical_outputs']}", flush=True)
            report.append(r)
        del layers
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["identical_outputs"] for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
