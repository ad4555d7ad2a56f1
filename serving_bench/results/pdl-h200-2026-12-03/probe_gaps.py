"""Stop 41: do the CuTe GEMMs start before the previous kernel ends? Kernel start / end times of one graph replay.

    python probe_gaps.py [--model qwen3-30b-a3b] [--tokens 8 512 2048]

For each DependentLaunch variant (forced onto both GEMMs as in probe_pdl.py) one CUDA graph of the cute layer is
captured and replayed under torch.profiler; for the last of 5 replays every kernel's start, end and the gap to the
previous kernel's end (negative: it started before that one ended) are printed, and the mean of each kernel boundary
over the 5 replays.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_pdl import USED, capture, forced_launch  # noqa: E402

from moe2cta import MoELayer  # noqa: E402
from moe2cta.grouped_gemm import sm90_grouped_gemm as s90  # noqa: E402
from moe2cta.presets import get_preset  # noqa: E402


def kernel_events(graph, replays):
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    events = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return [(e["name"][:40], float(e["ts"]), float(e["dur"])) for e in events]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 512, 2048])
    parser.add_argument("--replays", type=int, default=5)
    args = parser.parse_args(argv)
    from moe2cta.serving_bench.backends import make_expert_weights
    from moe2cta.serving_bench.distributions import DistributionKind, RoutingDistribution, make_router_logits

    dev = torch.device("cuda")
    preset = get_preset(args.model)
    w = make_expert_weights(preset, dev, seed=0)
    layer = MoELayer(w.w13, w.w2, routing=preset.routing, activation=preset.activation, b13=w.b13, b2=w.b2,
                     backend="cute", e_score_correction_bias=w.e_score_correction_bias)
    for tokens in args.tokens:
        gen = torch.Generator(device=dev).manual_seed(tokens)
        hidden = torch.randn(tokens, preset.hidden, generator=gen, device=dev, dtype=torch.bfloat16)
        logits = make_router_logits(RoutingDistribution(DistributionKind.UNIFORM), tokens, preset.num_experts,
                                    preset.routing, seed=tokens, device=dev)
        for v in s90.DependentLaunch:
            USED.clear()
            with forced_launch(v):
                graph, _ = capture(layer, hidden, logits, None)
            print("   kernels launched:", sorted({stem[-60:] for stem in USED}), flush=True)
            events = kernel_events(graph, args.replays)
            per = len(events) // args.replays
            print(f"{args.model} T={tokens} {v.value}: {per} kernels per forward", flush=True)
            gaps = [[] for _ in range(per)]
            for r in range(args.replays):
                one = events[r * per:(r + 1) * per]
                for i, (name, ts, dur) in enumerate(one):
                    gaps[i].append(ts - (one[i - 1][1] + one[i - 1][2]) if i else 0.0)
                    gaps[i].append(dur)
            last = events[-per:]
            t0 = last[0][1]
            for i, (name, ts, dur) in enumerate(last):
                mean_gap = statistics.mean(gaps[i][0::2])
                mean_dur = statistics.mean(gaps[i][1::2])
                print(f"   {name:40s} start {ts - t0:8.1f} end {ts - t0 + dur:8.1f}  gap to previous end: "
                      f"mean {mean_gap:6.2f} us, duration mean {mean_dur:8.1f} us", flush=True)
            span = [events[(r + 1) * per - 1][1] + events[(r + 1) * per - 1][2] - events[r * per][1]
                    for r in range(args.replays)]
            print(f"   first start to last end: mean {statistics.mean(span):.1f} us", flush=True)
            del graph
    return 0


if __name__ == "__main__":
    sys.exit(main())
