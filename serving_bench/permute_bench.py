"""Launch parameters of the gather and combine kernels (router/permute_triton.py) at the layer's prefill shapes.

    python -m moe2cta.serving_bench.permute_bench [--cells qwen3-30b-a3b:2048 deepseek-v3:8192 ...] [--json F]

For each cell (a model preset's H, top-k and experts at T tokens, uniform random routing dispatched by the
Triton router) it times, as the layer calls them:
- combine: out[t] = sum_j y[slot_rows[t*k + j]] (no weights: GEMM2 applied them), y [max_rows, H] random;
- gather: hidden rows into expert order with GEMM2's row weights and GatherPadding.TOKEN_ROW (the sm90 prefill
  path of the gathered copy),
over a grid of (tokens or slots per program, BLOCK_H, num_warps), the current default first (a grid point equal
to it is not timed twice). Each launch is
captured 20 times in one CUDA graph (router_bench's timing: median of 7 rounds of 10 replays / 20). The outputs
of every launch configuration are compared with the default's bit for bit (the order of the k additions is
fixed, so any difference is a bug). Floors: bytes read + written at 4.24 TB/s.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from moe2cta.presets import get_preset
from moe2cta.router import api as router_api
from moe2cta.router import dispatch, route
from moe2cta.router.config import RoutingConfig
from moe2cta.router.permute_triton import (
    COMBINE_TOKENS_PER_PROGRAM,
    GATHER_SLOTS_PER_PROGRAM,
    jit_functions,
    permute_launch_params,
)

from .router_bench import _graph_time_us

HBM_BYTES_PER_US = 4.24e6
DEFAULT_CELLS = ("qwen3-30b-a3b:2048", "qwen3-30b-a3b:8192", "qwen3-235b-a22b:2048", "deepseek-v3:8192",
                 "gpt-oss-120b:8192", "mixtral-8x7b:8192")
COMBINE_GRID = {"block_t": (1, 2, 4, 8), "block_h": (512, 1024, 2048), "num_warps": (4, 8)}
GATHER_GRID = {"block_s": (2, 4, 8), "block_h": (1024, 2048), "num_warps": (4, 8)}


def _grid(grid: dict, hidden_size: int):
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values))
        if point["block_h"] <= max(16, 1 << (hidden_size - 1).bit_length()):
            yield point


def _combine(y, disp, out, num_tokens, top_k, block_t, block_h, num_warps):
    hidden_size = y.shape[1]
    grid = (-(-num_tokens // block_t), -(-hidden_size // block_h))
    jit_functions().combine_kernel[grid](
        y, disp.slot_rows, disp.slot_rows, out, num_tokens, hidden_size, y.stride(0), out.stride(0),
        TOP_K=top_k, HAS_WEIGHTS=False, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps)


def _gather(hidden, disp, a1, slot_weights, row_weights, top_k, block_s, block_h, num_warps):
    num_slots, hidden_size = hidden.shape[0] * top_k, hidden.shape[1]
    slot_programs = -(-num_slots // block_s)
    pad_programs = -(-a1.shape[0] // router_api.GATHER_PAD_BLOCK)
    grid = (slot_programs + pad_programs, -(-hidden_size // block_h))
    jit_functions().gather_kernel[grid](
        hidden, disp.slot_rows, disp.slot_rows, a1, slot_weights, row_weights, num_slots, hidden_size,
        hidden.stride(0), a1.stride(0), disp.sorted_slots, disp.row_offsets, disp.row_offsets.numel() - 1,
        slot_programs, TOP_K=top_k, HAS_SCALE=False, BLOCK_S=block_s, BLOCK_H=block_h, ROW_WEIGHTS=True,
        PAD_TOKEN_ROW=True, BLOCK_P=router_api.GATHER_PAD_BLOCK, num_warps=num_warps)


def run_cell(model: str, tokens: int, gen: torch.Generator) -> list[dict]:
    preset = get_preset(model)
    h, k, e = preset.hidden, preset.top_k, preset.num_experts
    dev = torch.device("cuda")
    logits = torch.randn(tokens, e, device=dev, generator=gen).to(torch.bfloat16)
    weights, ids = route(logits, RoutingConfig(top_k=k), backend="triton")
    disp = dispatch(ids, e, backend="triton")
    max_rows = disp.sorted_slots.numel()
    hidden = torch.randn(tokens, h, device=dev, generator=gen).to(torch.bfloat16)
    y = torch.randn(max_rows, h, device=dev, generator=gen).to(torch.bfloat16)
    default_h, default_warps = permute_launch_params(h, 2)
    results = []
    # combine
    out_ref = torch.empty(tokens, h, device=dev, dtype=torch.bfloat16)
    _combine(y, disp, out_ref, tokens, k, COMBINE_TOKENS_PER_PROGRAM, default_h, default_warps)
    floor = (tokens * k + tokens) * h * 2 / HBM_BYTES_PER_US
    points = [{"block_t": COMBINE_TOKENS_PER_PROGRAM, "block_h": default_h, "num_warps": default_warps}]
    points += [p for p in _grid(COMBINE_GRID, h) if p != points[0]]
    for p in points:
        out = torch.full_like(out_ref, float("nan"))
        us = _graph_time_us(lambda: _combine(y, disp, out, tokens, k, **p))
        results.append({"model": model, "tokens": tokens, "kernel": "combine", **p, "us": us, "floor_us": floor,
                        "default": p is points[0], "identical": bool(torch.equal(out, out_ref))})
    # gather (row weights, TOKEN_ROW padding)
    a1_ref = torch.empty(max_rows, h, device=dev, dtype=torch.bfloat16)
    rw_ref = torch.zeros(max_rows, device=dev)
    slot_weights = weights.contiguous()
    _gather(hidden, disp, a1_ref, slot_weights, rw_ref, k, GATHER_SLOTS_PER_PROGRAM, default_h, default_warps)
    used = int(disp.row_offsets[-1])
    floor = (tokens * h + used * h) * 2 / HBM_BYTES_PER_US
    points = [{"block_s": GATHER_SLOTS_PER_PROGRAM, "block_h": default_h, "num_warps": default_warps}]
    points += [p for p in _grid(GATHER_GRID, h) if p != points[0]]
    for p in points:
        a1 = torch.full_like(a1_ref, float("nan"))
        rw = torch.zeros_like(rw_ref)
        us = _graph_time_us(lambda: _gather(hidden, disp, a1, slot_weights, rw, k, **p))
        same = bool(torch.equal(a1[:used], a1_ref[:used]) and torch.equal(rw, rw_ref))
        results.append({"model": model, "tokens": tokens, "kernel": "gather", **p, "us": us, "floor_us": floor,
                        "default": p is points[0], "identical": same})
    return results


def parse_cell(text: str) -> tuple[str, int]:
    """'MODEL:T' (a preset name and a positive token count) -> (model, T); argparse reports a bad one."""
    model, sep, tokens = text.partition(":")
    if not sep or not tokens.isdigit() or int(tokens) < 1:
        raise argparse.ArgumentTypeError(f"expected MODEL:T with T a positive integer, got {text!r}")
    try:
        get_preset(model)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return model, int(tokens)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", type=parse_cell, default=[parse_cell(c) for c in DEFAULT_CELLS],
                        metavar="MODEL:T")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("permute_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(7)
    results = []
    for model, tokens in args.cells:
        cell = f"{model}:{tokens}"
        rows = run_cell(model, tokens, gen)
        results += rows
        for kernel in ("combine", "gather"):
            mine = [r for r in rows if r["kernel"] == kernel]
            base = next(r for r in mine if r["default"])
            best = min(mine, key=lambda r: r["us"])
            params = {key: best[key] for key in best if key.startswith("block") or key == "num_warps"}
            print(f"{cell:22s} {kernel:7s} default {base['us']:8.1f} us  best {best['us']:8.1f} us {params}  "
                  f"floor {base['floor_us']:7.1f} us  all identical {all(r['identical'] for r in mine)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
