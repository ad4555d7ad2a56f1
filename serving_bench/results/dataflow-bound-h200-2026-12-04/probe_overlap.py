"""Stop 43: how much a GEMM1 -> GEMM2 dataflow (GEMM2 units start as soon as their expert's GEMM1 rows exist) could
save, bounded from above by a GEMM2 that does not wait for GEMM1 at all.

    python probe_overlap.py kernels --out DIR --nowait DIR2 --have DIR3  # (CPU, DSL) the kernels the run needs
    python probe_overlap.py run --nowait DIR2 --json OUT [--rounds R]    # (H200) interleaved graph replays

Variants of one cute MoELayer per model, forced onto its two GEMMs while the graphs are captured (sm90_grouped_gemm._run
and _launch_scratch patched: a measurement trick, not a product path):
- STREAM: both GEMMs plain launches (the layer as it ships).
- PDL: both PROGRAMMATIC (griddepcontrol.wait before the first input read, launch_dependents at once), and a DYNAMIC
  GEMM2's zeroed workspace made before GEMM1, so that no memset node separates the two launches.
- NO_WAIT: as PDL, but GEMM2 is compiled with its griddepcontrol.wait removed. Its CTAs start on the SMs that GEMM1's
  exiting CTAs free and compute at once on whatever its input buffer holds (the previous replay's GEMM1 output where
  this one's is not written yet). Its output is wrong; its time is what any dataflow between the two GEMMs could at
  best reach: every GEMM2 unit ready the moment an SM is free.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys

import torch

from moe2cta import MoELayer
from moe2cta import api
from moe2cta.grouped_gemm import sm90_grouped_gemm as s90
from moe2cta.grouped_gemm.epilogue import GemmStage
from moe2cta.presets import get_preset

MODELS = ("qwen3-30b-a3b", "gpt-oss-120b", "qwen3-235b-a22b", "mixtral-8x7b", "deepseek-v3")
CELLS = [(m, t) for m in MODELS for t in (8, 32, 128, 512)] + [
    (m, t) for m in MODELS for t in (2048, 8192) if (m, t) != ("mixtral-8x7b", 8192)]
VARIANTS = ("stream", "pdl", "no_wait")
INPUTS = 4
PDL = s90.DependentLaunch.PROGRAMMATIC


def layer_kernels(preset, tokens):
    """(config, problem) of GEMM1 and GEMM2 as the cute layer picks them for `tokens` (stop 41's probe_pdl.py)."""
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


def kernels(args):
    import cutlass.cute as cute

    have = set(os.listdir(args.have)) if args.have else set()
    wanted, nowait = [], []
    for model, tokens in CELLS:
        (c1, p1), (c2, p2) = layer_kernels(get_preset(model), tokens)
        wanted += [(dataclasses.replace(c1, dependent_launch=PDL), p1), (dataclasses.replace(c2, dependent_launch=PDL), p2)]
        nowait.append((dataclasses.replace(c2, dependent_launch=PDL), p2))
    wanted, nowait = list(dict.fromkeys(wanted)), list(dict.fromkeys(nowait))
    todo = [(c, p) for c, p in wanted if f"{s90.kernel_key(c, p).file_stem()}.so" not in have
            and not os.path.exists(f"{args.out}/{s90.kernel_key(c, p).file_stem()}.so")]
    print(f"{len(wanted)} PDL kernels, {len(todo)} to build; {len(nowait)} no-wait kernels", flush=True)
    for c, p in todo:
        s90._export(c, p, args.out, False)
    original = cute.arch.griddepcontrol_wait
    cute.arch.griddepcontrol_wait = lambda *a, **k: None  # traced at compile time: the wait is not emitted
    try:
        for c, p in nowait:
            if not os.path.exists(f"{args.nowait}/{s90.kernel_key(c, p).file_stem()}.so"):
                s90._export(c, p, args.nowait, True)
    finally:
        cute.arch.griddepcontrol_wait = original
    for c, p in nowait:  # the PTX must hold launch_dependents and no wait
        ptx = open(f"{args.nowait}/{s90.kernel_key(c, p).file_stem()}.ptx").read()
        assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" not in ptx, c
    print("no-wait PTX: launch_dependents, no wait, in every kernel", flush=True)


STATE = {"stage": None, "ws2": None, "keys": []}


@contextlib.contextmanager
def forced(variant, nowait_dir):
    run0, scratch0 = s90._run, s90._launch_scratch
    STATE["stage"] = STATE["ws2"] = None  # (run 1: a previous cell's GEMM2 stage leaked into a STREAM capture)
    if variant == "stream":  # the layer as it ships: nothing patched
        yield
        return

    def run(config, problem, *args, **kwargs):
        config = dataclasses.replace(config, dependent_launch=PDL)
        STATE["stage"] = problem.kind
        if problem.kind is GemmStage.GEMM1:
            STATE["ws2"] = torch.zeros(4, dtype=torch.int32, device=args[0].device)  # GEMM2's, before GEMM1
        elif variant == "no_wait":
            args = list(args)
            args[7] = nowait_dir
        STATE["keys"].append((variant, s90.kernel_key(config, problem).file_stem()))
        return run0(config, problem, *args, **kwargs)

    def scratch(config, device):
        workspace, bias, scale = scratch0(config, device)
        if STATE["stage"] is GemmStage.GEMM2 and config.scheduler is s90.Scheduler.DYNAMIC:
            workspace = STATE["ws2"]
        return workspace, bias, scale

    s90._run, s90._launch_scratch = run, scratch
    try:
        yield
    finally:
        s90._run, s90._launch_scratch = run0, scratch0
        STATE["stage"] = STATE["ws2"] = None


def run(args):
    from moe2cta.serving_bench.backends import make_expert_weights
    from moe2cta.serving_bench.distributions import DistributionKind, RoutingDistribution, make_router_logits
    from moe2cta.serving_bench.layer_profile import capture_forward_output
    from moe2cta.serving_bench.timing import interleaved_rounds

    dev = torch.device("cuda")
    report = []
    for model in MODELS:
        if args.models and model not in args.models:
            continue
        preset = get_preset(model)
        w = make_expert_weights(preset, dev, seed=0)
        layer = MoELayer(w.w13, w.w2, routing=preset.routing, activation=preset.activation, b13=w.b13, b2=w.b2,
                         backend="cute", e_score_correction_bias=w.e_score_correction_bias)
        del w
        for m, tokens in CELLS:
            if m != model or (args.tokens and tokens not in args.tokens):
                continue
            try:
                gen = torch.Generator(device=dev).manual_seed(tokens)
                inputs = [(torch.randn(tokens, preset.hidden, generator=gen, device=dev, dtype=torch.bfloat16),
                           make_router_logits(RoutingDistribution(DistributionKind.UNIFORM), tokens, preset.num_experts,
                                              preset.routing, seed=tokens * 10 + i, device=dev)) for i in range(INPUTS)]
                pool = torch.cuda.graph_pool_handle()
                graphs, outs = {}, {}
                reference = [layer(*x).clone() for x in inputs]
                for v in VARIANTS:
                    with forced(v, args.nowait):
                        for i, x in enumerate(inputs):
                            graphs[v, i], outs[v, i] = capture_forward_output(layer, *x, pool)
                equal = {v: True for v in VARIANTS if v != "no_wait"}  # bit-equal to the eager layer, every replay
                for _ in range(2):
                    for (v, i), g in graphs.items():
                        g.replay()
                        torch.cuda.synchronize()
                        if v in equal:
                            equal[v] = equal[v] and torch.equal(outs[v, i], reference[i])
                per = interleaved_rounds({key: g.replay for key, g in graphs.items()}, args.rounds)
                med = {v: statistics.median(statistics.median(per[v, i][r] for i in range(INPUTS))
                                            for r in range(args.rounds)) for v in VARIANTS}
                kern = [f"{c.operands.value}/{c.tile_m}x{c.tile_n}/{c.scheduler.value}"
                        for c, _ in layer_kernels(preset, tokens)]
                r = {"model": model, "tokens": tokens, "kernels": kern, "bit_equal_to_eager": equal,
                     "median_us": med, "ratio": {v: med[v] / med["stream"] for v in VARIANTS}}
                report.append(r)
                print(f"{model:16s} T={tokens:5d} " + "  ".join(f"{v} {med[v]:9.1f} ({med[v] / med['stream']:.3f})"
                                                              for v in VARIANTS)
                      + f"  equal {equal}  {kern}", flush=True)
                del graphs, outs, per
            except Exception as exc:  # a missing kernel or an out-of-memory: report and go on
                print(f"{model:16s} T={tokens:5d} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            torch.cuda.empty_cache()
        del layer
        torch.cuda.empty_cache()
    for v in VARIANTS:
        for phase, lo, hi in (("decode", 1, 512), ("prefill", 2048, 1 << 30)):
            ratios = [r["ratio"][v] for r in report if lo <= r["tokens"] <= hi]
            if ratios:
                print(f"geomean {v} {phase}: {statistics.geometric_mean(ratios):.4f} over {len(ratios)} cells "
                      f"(range {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    print("kernels used:", len(set(STATE["keys"])), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--out", required=True)
    k.add_argument("--nowait", required=True)
    k.add_argument("--have")
    r = sub.add_parser("run")
    r.add_argument("--nowait", required=True)
    r.add_argument("--json")
    r.add_argument("--rounds", type=int, default=20)
    r.add_argument("--models", nargs="*")
    r.add_argument("--tokens", nargs="*", type=int)
    args = parser.parse_args(argv)
    if args.cmd == "kernels":
        kernels(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
