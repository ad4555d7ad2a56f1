"""The Triton layer's token-GEMV path against its grouped-GEMM path, side by side, at decode batch sizes.

    python -m moe2cta.serving_bench.token_gemv_bench --models all --tokens 1 2 4 8 16 --json out.json
    python -m moe2cta.serving_bench.token_gemv_bench --models qwen3-30b-a3b --tokens 1 --sweep

For each model preset and token count T: one moe2cta.MoELayer per path on the same weights (Backend.TRITON
with token_gemv_max_tokens = 0, the grouped GEMMs, and = T, the token GEMVs; plus the same pair on the
packed w13 of an AUTO layer where AUTO splits, i.e. where the CuTe kernels load). Every layer is checked
against the fp32 reference first (serving_bench.correctness), then timed by CUDA-graph replay over rotated
inputs (each input routes to other experts, so no expert's weights stay in L2), all layers of a cell in the same
rounds (timing.time_interleaved; before stop 52 one after the other). Prints median us, the ratio token / grouped,
and the floor (weight bytes of the experts hit / copy bandwidth at the targets' 4.24 TB/s; before stop 52 the
bandwidth measured at start, and the mean floor against the median time: the JSON now also has each layer's median
time / floor over its samples, each against its own input's floor).

--sweep times the two token-GEMV kernels alone over a few configs (rotated routings), per model and T, to
check the default config.

--chain splits the token path's time, per model and T, into its launches and their chains, side by side in one
process: the router alone, GEMV1 alone, GEMV2 alone (topk ids / weights given), GEMV1 + GEMV2 (the layer given
topk ids / weights) and the whole layer (router logits in), each part timed twice (the second round in reverse
order) and reported as the mean of its two medians. layer - gemvs is what routing adds to the chain;
gemvs - gemv1 - gemv2 what the boundary between the two GEMVs costs or saves.

--profile runs GEMV1 + GEMV2 eagerly, no timing, for a profiler: PROFILE_ROUNDS times on rotated routings,
after a warm-up outside cudaProfilerStart / Stop (run it under `ncu --profile-from-start off`). Then, as a plain
stream of the same bytes, a row sum (torch's reduce_kernel) over the first min(E, T * k) experts' w13 and w2.
It prints the launch order, which is the profiler's kernel order.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from moe2cta import Backend, MoELayer, is_supported, route
from moe2cta.grouped_gemm import triton_token_gemv as tk
from moe2cta.grouped_gemm.epilogue import GemmStage, W13Layout, pack_gate_up_rows
from moe2cta.presets import PRESETS, get_preset

from .backends import make_expert_weights
from .correctness import AmbiguousRows, CheckStatus, check_output, make_reference
from .floors import DEFAULT_CEILINGS, moe_floor
from .routing_twin import route_twin
from .timing import TimingConfig, rotation_count, time_callable, time_interleaved

__all__ = ["main"]

# (block_n, block_k, num_warps); GEMV2's block_j is next_pow2(k). GEMV1 runs on the packed w13 (W13Layout.CHUNKED,
# what an AUTO layer reads), so its block_n is a multiple of GATE_UP_CHUNK.
SWEEP_GEMV1 = ((8, 128, 2), (8, 256, 2), (8, 128, 4), (8, 256, 4), (16, 128, 4), (8, 512, 4), (16, 256, 8), (32, 256, 8))
SWEEP_GEMV2 = ((4, 256, 8), (4, 128, 4), (1, 256, 2), (2, 256, 4), (2, 128, 2), (2, 512, 4), (1, 512, 2), (4, 64, 2),
               (8, 256, 8))  # the first two: default_config's two GEMV2 tiles


def _layers(preset, weights, num_tokens: int) -> dict[str, MoELayer]:
    common = dict(routing=preset.routing, activation=preset.activation, b13=weights.b13, b2=weights.b2,
                  e_score_correction_bias=weights.e_score_correction_bias)
    layers = {
        "triton-grouped": MoELayer(weights.w13, weights.w2, backend=Backend.TRITON, token_gemv_max_tokens=0, **common),
        "triton-token": MoELayer(weights.w13, weights.w2, backend=Backend.TRITON, token_gemv_max_tokens=num_tokens,
                                 **common),
    }
    auto = MoELayer(weights.w13, weights.w2, backend=Backend.AUTO, token_gemv_max_tokens=0, **common)
    if "packed_w13" in auto.prepared and auto.backend_for(num_tokens) is Backend.TRITON:
        layers["packed-grouped"] = auto
        layers["packed-token"] = MoELayer(weights.w13, weights.w2, backend=Backend.AUTO,
                                          token_gemv_max_tokens=num_tokens, **common)
    return layers


def _inputs(preset, num_tokens: int, count: int, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randn(num_tokens, preset.hidden, device=device, generator=gen).to(torch.bfloat16),
             torch.randn(num_tokens, preset.num_experts, device=device, generator=gen))
            for _ in range(count)]


def _reference_or_none(preset, weights, hidden, routed):
    """The rotated input's fp32 reference, or None where every row's top-k is ambiguous (a near-tie at T=1): that
    input is timed but not checked."""
    try:
        return make_reference(hidden, weights, routed, preset.activation)
    except AmbiguousRows:
        return None


def _check_rotations(out_of, inputs, references, num_tokens: int, hidden_size: int):
    """(the first failing verdict or the one closest to failing, whether all passed) over the checkable rotations;
    out_of(rotation) computes that rotation's output. None when no rotation is checkable."""
    verdicts = [check_output(out_of(r), reference, num_tokens, hidden_size)
                for r, reference in enumerate(references) if reference is not None]
    if not verdicts:
        return None, True
    failed = [v for v in verdicts if v.status is not CheckStatus.PASS]
    return (failed[0], False) if failed else (max(verdicts, key=lambda v: v.margin_used), True)


def _verdict_fields(verdict) -> dict:
    if verdict is None:
        return {"check": "unchecked (every rotated input ambiguous)"}
    return {"check": verdict.status.value, "rel_err": verdict.rel_err, "tolerance": verdict.tolerance,
            "row_err": verdict.row_err, "row_tolerance": verdict.row_tolerance}


def bench_cell(preset, weights, num_tokens: int, ceilings, timing: TimingConfig, seed: int) -> dict:
    device = weights.w13.device
    bytes_per_input = num_tokens * (preset.hidden * 2 + preset.num_experts * 4)
    inputs = _inputs(preset, num_tokens, max(4, rotation_count(bytes_per_input, timing)), device, seed)
    floors, references = [], []
    for hidden, logits in inputs:
        routed = route_twin(logits, preset.routing, weights.e_score_correction_bias)
        floors.append(moe_floor(preset, num_tokens, float(torch.unique(routed.topk_ids).numel()), ceilings).us)
        references.append(_reference_or_none(preset, weights, hidden, routed))
    row = {"model": preset.name, "tokens": num_tokens, "floor_us": sum(floors) / len(floors), "layers": {}}
    layers, timed = _layers(preset, weights, num_tokens), {}
    for name, layer in layers.items():
        # every rotated input checked before timing; the reported error is the rotation closest to failing
        verdict, passed = _check_rotations(lambda r, layer=layer: layer(*inputs[r]), inputs, references, num_tokens,
                                           preset.hidden)
        row["layers"][name] = _verdict_fields(verdict)
        if passed:
            timed[name] = layer
    # every passing layer in the same rounds (drift falls on all alike); time / floor per sample against the floor of
    # the rotated input it ran, its median as the layer's ratio (the floor of a cell is the mean over the inputs);
    # each rotation's timed graph checked again after the rounds
    def replay_check(name, rotation, out):
        reference = references[rotation]
        return None if reference is None else check_output(out, reference, num_tokens, preset.hidden)

    results = time_interleaved(timed, inputs, device, timing, check=replay_check) if timed else {}
    for name, result in results.items():
        if isinstance(result, BaseException):
            row["layers"][name].update(check="error", error=f"{type(result).__name__}: {result}")
            continue
        wrong = next(((r, v) for r, v in enumerate(result.checks)
                      if v is not None and v.status is not CheckStatus.PASS), None)
        if wrong is not None:
            row["layers"][name].update(_verdict_fields(wrong[1]),
                                       error=f"timed graph replay of rotated input {wrong[0]}: {wrong[1].reason}")
            continue
        ratios = sorted(t / floors[result.rotation_of(i)] for i, t in enumerate(result.samples_us))
        row["layers"][name].update(median_us=result.median_us, mode=result.mode.value,
                                   time_over_floor=ratios[len(ratios) // 2])
    del layers, timed
    return row


def _kernel_inputs(preset, weights, num_tokens: int, count: int, seed: int):
    device = weights.w13.device
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(count):
        logits = torch.randn(num_tokens, preset.num_experts, device=device, generator=gen)
        routed = route_twin(logits, preset.routing, weights.e_score_correction_bias)
        sets.append((torch.randn(num_tokens, preset.hidden, device=device, generator=gen).to(torch.bfloat16),
                     routed.topk_ids.to(torch.int32).contiguous(), routed.topk_weights.float().contiguous()))
    return sets


def sweep_cell(preset, weights, num_tokens: int, timing: TimingConfig, seed: int) -> list[dict]:
    """Each GEMV kernel alone over SWEEP_* configs (the default first), rotated routings; GEMV1 on the packed
    w13."""
    device = weights.w13.device
    sets = _kernel_inputs(preset, weights, num_tokens, 8, seed)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    k = preset.top_k
    w13 = pack_gate_up_rows(weights.w13)
    layout = W13Layout.CHUNKED
    a2s = [tk.token_gemv1(h, ids, w13, preset.activation, b13=weights.b13, w13_layout=layout) for h, ids, _ in sets]
    rows = []
    for stage, sweep in ((GemmStage.GEMM1, SWEEP_GEMV1), (GemmStage.GEMM2, SWEEP_GEMV2)):
        n, kdim = (preset.intermediate, preset.hidden) if stage is GemmStage.GEMM1 else (preset.hidden, preset.intermediate)
        problem = tk.TokenGemvProblem(stage, num_tokens, k, n, kdim, torch.bfloat16, num_sms,
                                      layout if stage is GemmStage.GEMM1 else W13Layout.GATE_THEN_UP)
        block_j = 1 if stage is GemmStage.GEMM1 else 1 << (k - 1).bit_length()
        configs = [tk.default_config(problem)] + [tk.TokenGemvConfig(block_j, bn, bk, nw) for bn, bk, nw in sweep]
        for index, config in enumerate(configs):
            if not tk.can_implement(config, problem)[0] or (index and config == configs[0]):
                continue
            if stage is GemmStage.GEMM1:
                fn = lambda h, ids, w, a2, c=config: tk.token_gemv1(h, ids, w13, preset.activation, b13=weights.b13,
                                                                  config=c, w13_layout=layout)
            else:
                fn = lambda h, ids, w, a2, c=config: tk.token_gemv2_combine(a2, ids, weights.w2, w, b2=weights.b2,
                                                                          out_dtype=torch.bfloat16, config=c)
            inputs = [(h, ids, w, a2) for (h, ids, w), a2 in zip(sets, a2s)]
            result = time_callable(fn, inputs, device, timing)
            rows.append({"model": preset.name, "tokens": num_tokens, "stage": stage.value, "default": index == 0,
                         "config": dataclasses.asdict(config), "median_us": result.median_us})
    return rows


CHAIN_PARTS = ("route", "gemv1", "gemv2", "gemvs", "layer")


def chain_cell(preset, weights, num_tokens: int, timing: TimingConfig, seed: int) -> dict:
    """Median us of each CHAIN_PARTS entry (see the module docstring) on rotated inputs, the layer checked first."""
    device = weights.w13.device
    layer = MoELayer(weights.w13, weights.w2, backend=Backend.TRITON, token_gemv_max_tokens=num_tokens,
                     routing=preset.routing, activation=preset.activation, b13=weights.b13, b2=weights.b2,
                     e_score_correction_bias=weights.e_score_correction_bias)
    bias = weights.e_score_correction_bias
    bytes_per_input = num_tokens * (preset.hidden * 2 + preset.num_experts * 4)
    inputs = []
    for hidden, logits in _inputs(preset, num_tokens, max(4, rotation_count(bytes_per_input, timing)), device, seed):
        topk_weights, topk_ids = route(logits, preset.routing, bias, backend=Backend.TRITON)
        a2 = tk.token_gemv1(hidden, topk_ids, weights.w13, preset.activation, b13=weights.b13)
        inputs.append((hidden, logits, topk_weights, topk_ids, a2))
    references = [_reference_or_none(preset, weights, hidden, route_twin(logits, preset.routing, bias))
                  for hidden, logits, *_ in inputs]
    verdict, passed = _check_rotations(lambda r: layer(*inputs[r][:2]), inputs, references, num_tokens, preset.hidden)
    row = {"model": preset.name, "tokens": num_tokens} | _verdict_fields(verdict)
    if not passed:
        return row
    parts = {
        "route": lambda h, lg, w, ids, a2: route(lg, preset.routing, bias, backend=Backend.TRITON),
        "gemv1": lambda h, lg, w, ids, a2: tk.token_gemv1(h, ids, weights.w13, preset.activation, b13=weights.b13),
        "gemv2": lambda h, lg, w, ids, a2: tk.token_gemv2_combine(a2, ids, weights.w2, w, b2=weights.b2,
                                                                  out_dtype=h.dtype),
        "gemvs": lambda h, lg, w, ids, a2: layer(h, topk_weights=w, topk_ids=ids),
        "layer": lambda h, lg, w, ids, a2: layer(h, lg),
    }
    assert list(parts) == list(CHAIN_PARTS)
    row["median_us"], row["round_medians_us"] = _two_rounds(parts, inputs, device, timing)
    return row


def _two_rounds(parts: dict, inputs, device, timing: TimingConfig) -> tuple[dict, dict]:
    """(mean of each part's two medians, the medians): two rounds, the second in reverse order, so that drift of
    the card's clock during the cell does not favour a part."""
    medians = {name: [] for name in parts}
    for order in (list(parts), list(parts)[::-1]):
        for name in order:
            medians[name].append(time_callable(parts[name], inputs, device, timing).median_us)
    return {name: sum(m) / len(m) for name, m in medians.items()}, medians


PROFILE_ROUNDS = 3


def profile_cell(preset, weights, num_tokens: int, seed: int) -> list[str]:
    """Launch GEMV1 (packed w13) + GEMV2 PROFILE_ROUNDS times on rotated routings, then a plain row sum over the
    same bytes, between cudaProfilerStart / Stop (warmed up before); returns the launch order, one entry per
    kernel."""
    sets = _kernel_inputs(preset, weights, num_tokens, PROFILE_ROUNDS, seed)
    w13 = pack_gate_up_rows(weights.w13)
    experts = min(preset.num_experts, num_tokens * preset.top_k)  # the bytes GEMV1 / GEMV2 read, at T * k experts

    def chain(h, ids, w):
        a2 = tk.token_gemv1(h, ids, w13, preset.activation, b13=weights.b13, w13_layout=W13Layout.CHUNKED)
        return tk.token_gemv2_combine(a2, ids, weights.w2, w, b2=weights.b2, out_dtype=h.dtype)

    chain(*sets[0])  # compile outside the profiled range
    weights.w13[:1].sum(dim=-1, dtype=torch.float32)
    torch.cuda.synchronize()
    order = []
    torch.cuda.profiler.start()
    for index, inputs in enumerate(sets):
        chain(*inputs)
        order += [f"{preset.name} T={num_tokens} round{index} {stage}" for stage in ("gemv1", "gemv2")]
    for label, w in (("w13", weights.w13), ("w2", weights.w2)):
        w[:experts].sum(dim=-1, dtype=torch.float32)
        order.append(f"{preset.name} T={num_tokens} plain-read {label} {w[:experts].nbytes} bytes")
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return order


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["all"], help="preset names or 'all'")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--sweep", action="store_true", help="also time each GEMV kernel over a few configs at each T")
    parser.add_argument("--chain", action="store_true",
                        help="only split the token path into its launches (router, GEMV1, GEMV2, their chains)")
    parser.add_argument("--profile", action="store_true",
                        help="only launch GEMV1 + GEMV2 eagerly for a profiler (ncu --profile-from-start off)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("token_gemv_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if any(t < 1 for t in args.tokens):
        parser.error(f"--tokens: expected ints >= 1, got {args.tokens}")
    names = sorted(PRESETS) if args.models == ["all"] else args.models
    presets = [get_preset(name) for name in names]
    device = torch.device("cuda")
    ceilings = DEFAULT_CEILINGS  # the targets' (measured ones moved by several percent from start to start)
    timing = TimingConfig()
    rows, sweeps, chains = [], [], []
    for preset in presets:
        weights = make_expert_weights(preset, device, seed=args.seed)
        ok, reason = is_supported("triton", torch.empty(1, preset.hidden, dtype=torch.bfloat16, device=device),
                                  weights.w13, weights.w2, routing=preset.routing)
        if not ok:
            print(f"{preset.name}: triton unsupported: {reason}")
            continue
        for num_tokens in args.tokens if args.profile else ():
            for index, entry in enumerate(profile_cell(preset, weights, num_tokens, args.seed + num_tokens)):
                print(f"launch {index}: {entry}", flush=True)
        for num_tokens in args.tokens if args.chain and not args.profile else ():
            chain = chain_cell(preset, weights, num_tokens, timing, args.seed + num_tokens)
            chains.append(chain)
            if "median_us" not in chain:
                err = chain.get("rel_err", float("nan"))
                print(f"{preset.name:16s} T={num_tokens:<5d} layer {chain['check']} ({err:.1e})", flush=True)
                continue
            us = chain["median_us"]
            print(f"{preset.name:16s} T={num_tokens:<5d} " + " ".join(f"{k} {v:7.1f}" for k, v in us.items())
                  + f" | routing adds {us['layer'] - us['gemvs']:5.1f}, gemvs - gemv1 - gemv2 "
                  f"{us['gemvs'] - us['gemv1'] - us['gemv2']:5.1f} us", flush=True)
        for num_tokens in () if args.chain or args.profile else args.tokens:
            row = bench_cell(preset, weights, num_tokens, ceilings, timing, args.seed + num_tokens)
            rows.append(row)
            layers = row["layers"]
            cells = " ".join(f"{name} {v['median_us']:8.1f}" if "median_us" in v
                             else f"{name} {v['check']}({v.get('rel_err', float('nan')):.1e})"
                             for name, v in layers.items())
            ratios = []
            for prefix in ("triton", "packed"):
                g, t = layers.get(f"{prefix}-grouped", {}), layers.get(f"{prefix}-token", {})
                if "median_us" in g and "median_us" in t:
                    ratios.append(f"{prefix} token/grouped {t['median_us'] / g['median_us']:.3f}")
            print(f"{preset.name:16s} T={num_tokens:<5d} floor {row['floor_us']:8.1f} | {cells} | {'; '.join(ratios)}",
                  flush=True)
        for num_tokens in args.tokens if args.sweep and not (args.chain or args.profile) else ():
            for r in sweep_cell(preset, weights, num_tokens, timing, args.seed):
                sweeps.append(r)
                c = r["config"]
                print(f"  sweep {r['model']:16s} T={r['tokens']} {r['stage']} j{c['block_j']} n{c['block_n']} "
                      f"k{c['block_k']} w{c['num_warps']}{' (default)' if r['default'] else ''}: "
                      f"{r['median_us']:.1f} us", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": dataclasses.asdict(ceilings) if dataclasses.is_dataclass(ceilings) else str(ceilings),
                       "cells": rows, "sweep": sweeps, "chain": chains}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
