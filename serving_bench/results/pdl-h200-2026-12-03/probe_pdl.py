"""Stop 41: the CuTe GEMMs as programmatic dependent launches (DependentLaunch), A/B in the layer.

    python probe_pdl.py kernels --out DIR            # (CPU, with the DSL) export the cells' kernels of every variant
    python probe_pdl.py run --json OUT [--rounds R]  # (H200) graph replays of every variant, interleaved rounds

One MoELayer (backend cute) per model; for each cell the graphs of every DependentLaunch variant are captured with
that variant forced onto both GEMMs (sm90_grouped_gemm._run patched for the capture: a measurement trick, not a
product path), their outputs compared bit for bit, and all graphs replayed in interleaved rounds (4 rotated inputs
each). Reports each variant's median and its ratio to STREAM_ORDER per cell.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys

import torch

from moe2cta import MoELayer
from moe2cta import api
from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
from moe2cta.grouped_gemm.epilogue import GemmStage
from moe2cta.presets import get_preset

CELLS = [(m, t) for m in ("qwen3-30b-a3b", "gpt-oss-120b", "qwen3-235b-a22b", "mixtral-8x7b", "deepseek-v3")
         for t in (8, 32, 128, 512)] + [("qwen3-30b-a3b", 2048), ("qwen3-235b-a22b", 2048), ("qwen3-30b-a3b", 8192)]
VARIANTS = list(s90.DependentLaunch)
INPUTS = 4


def layer_kernels(preset, tokens):
    """(config, problem) of GEMM1 and GEMM2 as the cute layer picks them for `tokens` (no tuning cache, router weight
    on GEMM2's output)."""
    bf = torch.bfloat16
    p1 = s90.Sm90Problem(GemmStage.GEMM1, 2 * preset.intermediate, preset.hidden, preset.num_experts, bf,
                         preset.activation, preset.has_bias)
    p2 = s90.Sm90Problem(GemmStage.GEMM2, preset.hidden, preset.intermediate, preset.num_experts, bf, None,
                         preset.has_bias, True)
    rows = tokens * preset.routing.top_k / preset.num_experts
    cfg1 = s90.default_config(p1, rows_per_expert=rows)
    if s90.token_rows_pays(p1, rows):
        cfg1 = api._token_rows_config(s90, p1, None, rows) or cfg1
    return [(cfg1, p1), (s90.default_config(p2, rows_per_expert=rows), p2)]


USED = []  # the kernel keys that forced_launch passed on (to check that the variant reached the launches)


@contextlib.contextmanager
def forced_launch(launch):
    original = s90._run

    def run(config, problem, *args, **kwargs):
        config = dataclasses.replace(config, dependent_launch=launch)
        USED.append(s90.kernel_key(config, problem).file_stem())
        return original(config, problem, *args, **kwargs)

    s90._run = run
    try:
        yield
    finally:
        s90._run = original


def capture(layer, hidden, logits, pool):
    """(graph, its output tensor) of one forward (layer_profile.capture_forward_output; as run on the device, this
    probe held its own copy of that capture)."""
    from moe2cta.serving_bench.layer_profile import capture_forward_output

    return capture_forward_output(layer, hidden, logits, pool)


def kernels(out_dir):
    pairs = []
    for model, tokens in CELLS:
        for cfg, problem in layer_kernels(get_preset(model), tokens):
            pairs += [(dataclasses.replace(cfg, dependent_launch=v), problem) for v in VARIANTS]
    pairs = list(dict.fromkeys(pairs))
    import os
    todo = [(c, p) for c, p in pairs if not os.path.exists(f"{out_dir}/{s90.kernel_key(c, p).file_stem()}.so")]
    print(len(pairs), "kernels,", len(todo), "to build", flush=True)
    for cfg, problem in todo:
        s90._export(cfg, problem, out_dir, False)


def run(args):
    from moe2cta.serving_bench.backends import make_expert_weights
    from moe2cta.serving_bench.distributions import DistributionKind, RoutingDistribution, make_router_logits
    from moe2cta.serving_bench.timing import interleaved_rounds

    dev = torch.device("cuda")
    report = []
    models = list(dict.fromkeys(m for m, _ in CELLS if not args.models or m in args.models))
    for model in models:
        preset = get_preset(model)
        w = make_expert_weights(preset, dev, seed=0)
        layer = MoELayer(w.w13, w.w2, routing=preset.routing, activation=preset.activation, b13=w.b13, b2=w.b2,
                         backend="cute", e_score_correction_bias=w.e_score_correction_bias)
        del w
        for m, tokens in CELLS:
            if m != model:
                continue
            gen = torch.Generator(device=dev).manual_seed(tokens)
            inputs = [(torch.randn(tokens, preset.hidden, generator=gen, device=dev, dtype=torch.bfloat16),
                       make_router_logits(RoutingDistribution(DistributionKind.UNIFORM), tokens, preset.num_experts,
                                          preset.routing, seed=tokens * 10 + i, device=dev)) for i in range(INPUTS)]
            pool = torch.cuda.graph_pool_handle()
            graphs, outs, eager = {}, {}, {}
            for v in VARIANTS:
                with forced_launch(v):
                    eager[v] = [layer(*x).clone() for x in inputs]
                    for i, x in enumerate(inputs):
                        graphs[v, i], outs[v, i] = capture(layer, *x, pool)
            # every variant's graph, replayed 3 times, and its eager forward, bit-equal to STREAM_ORDER's eager output
            first = VARIANTS[0]
            identical = all(torch.equal(eager[v][i], eager[first][i]) for v in VARIANTS for i in range(INPUTS))
            for _ in range(3):
                for (v, i), g in graphs.items():
                    g.replay()
                    torch.cuda.synchronize()
                    identical = identical and torch.equal(outs[v, i], eager[first][i])
            per = interleaved_rounds({key: g.replay for key, g in graphs.items()}, args.rounds)
            med = {v: statistics.median(statistics.median(per[v, i][r] for i in range(INPUTS))
                                        for r in range(args.rounds)) for v in VARIANTS}
            base = med[s90.DependentLaunch.STREAM_ORDER]
            kern = [f"{c.operands.value}/{c.tile_m}x{c.tile_n}/{c.scheduler.value}" for c, _ in layer_kernels(preset, tokens)]
            r = {"model": model, "tokens": tokens, "kernels": kern, "identical_outputs": identical,
                 "median_us": {v.value: med[v] for v in VARIANTS},
                 "ratio": {v.value: med[v] / base for v in VARIANTS}}
            report.append(r)
            print(f"{model:16s} T={tokens:5d} " + "  ".join(f"{v.value} {med[v]:9.1f} ({med[v] / base:.3f})"
                                                          for v in VARIANTS)
                  + f"  identical {identical}  {kern}", flush=True)
            del graphs, outs, eager, per
            torch.cuda.empty_cache()
        del layer
        torch.cuda.empty_cache()
    for v in VARIANTS:
        ratios = [r["ratio"][v.value] for r in report]
        gm = statistics.geometric_mean(ratios) if ratios else float("nan")
        print(f"geomean {v.value}: {gm:.4f} over {len(ratios)} cells", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["identical_outputs"] for r in report) else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--json")
    r.add_argument("--rounds", type=int, default=20)
    r.add_argument("--models", nargs="*")
    args = parser.parse_args(argv)
    if args.cmd == "kernels":
        kernels(args.out)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
