"""Router stage benchmark: routing + dispatch time on the GPU, Triton kernels against the torch twins.

    python -m moe2cta.serving_bench.router_bench --out results/ [--experts 8 128 256] [--top-k 2 4 8]
        [--tokens 1 32 512 4096 32768] [--warmup-only --shard I/N]
    python -m moe2cta.serving_bench.router_bench --experts 128 --top-k 8 --tokens 1 512 4096 32768 \
        --variants v2 v3 v3,slots=512 v3,bt=32,warps=8 --profile --out results/

--variants compares kernel choices in one run: each is a preset (v2: SCORE_INT64 keys, v3: AUTO keys =
LOGIT_INT32 for these bf16 logits) and/or key=value items: keys=auto|score_int64|logit_int32, bt=tokens per
route program, warps=route num_warps, slots=dispatch slots per program (MULTI_BLOCK, T*k > 512),
groups=auto|per_group (routing_triton.GroupReduce; with --routing-model deepseek-v3). Each is
timed as route (routing_triton.route_variant), dispatch, and route + dispatch in one graph (T <= 16 too:
the variants never take the fused launch); with --profile, per-kernel device times (torch profiler) of
route + dispatch for T >= 4096. Rows go to router_bench.json / .md under --out. --routing-model NAME takes the
routing (scoring, groups, E, k) of that model preset instead of SOFTMAX over --experts / --top-k, with an
N(0, 0.1) correction bias where the preset's scoring uses one.

Triton: route_dispatch (one fused launch for T <= 64, else route + dispatch = 4 launches) and, apart,
route and dispatch, each captured 20 times in one CUDA graph; time = median over 7 rounds of 10 replays,
divided by 20 (so launch gaps inside a graph count, host launch overhead does not). The torch twins use
bincount / sort and cannot be captured: timed eagerly (CUDA events, median). Logits are bf16 randn, scoring
SOFTMAX + renormalize (Qwen3 / Mixtral style), align 128, tile heights (16, 64, 128, 256).
--warmup-only compiles the kernels of shard I of N of the cases (run shards in parallel processes first:
Triton's on-disk cache then serves the timing process).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moe2cta.router import (
    DispatchScheme,
    RoutingConfig,
    combine,
    dispatch,
    dispatch_reference,
    gather,
    route,
    route_dispatch,
    route_reference,
)
from moe2cta.presets import get_preset
from moe2cta.router.routing_triton import GroupReduce, KeyPacking, route_variant

GRAPH_REPEATS = 20


def _graph_time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_REPEATS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(7):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        stop.record()
        stop.synchronize()
        rounds.append(start.elapsed_time(stop) * 1e3 / (10 * GRAPH_REPEATS))
    return statistics.median(rounds)


def _eager_time_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def cases(experts, top_ks, tokens):
    return [(e, k, t) for e in experts for k in top_ks for t in tokens if k <= e]


def run_case(num_experts: int, top_k: int, num_tokens: int, warmup_only: bool = False) -> dict:
    config = RoutingConfig(top_k=top_k)
    gen = torch.Generator(device="cuda").manual_seed(num_experts * 1000 + top_k)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen).to(torch.bfloat16)
    _, ids = route(logits, config, backend="triton")

    def both():
        return route_dispatch(logits, config, backend="triton")

    def route_only():
        return route(logits, config, backend="triton")

    def dispatch_only():
        return dispatch(ids, num_experts, backend="triton")

    def twin():
        _, twin_ids = route_reference(logits, config)
        return dispatch_reference(twin_ids, num_experts)

    if warmup_only:
        both(), route_only(), dispatch_only()
        return {}
    row = {
        "experts": num_experts,
        "top_k": top_k,
        "tokens": num_tokens,
        "fused_launch": num_tokens <= 64,
        "route_dispatch_us": _graph_time_us(both),
        "route_us": _graph_time_us(route_only),
        "dispatch_us": _graph_time_us(dispatch_only),
        "torch_twin_us": _eager_time_us(twin),
    }
    if num_experts == 128 and top_k == 8:  # gather + combine at Qwen3-30B-A3B's H = 2048, bf16
        hidden_size = 2048
        disp = dispatch(ids, num_experts, backend="triton")
        hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
        weights = torch.rand(num_tokens, top_k, device="cuda", generator=gen)
        a1 = gather(hidden, disp, top_k, backend="triton")
        y = torch.randn_like(a1)
        out = torch.empty_like(hidden)
        row["gather_us"] = _graph_time_us(lambda: gather(hidden, disp, top_k, out=a1, backend="triton"))
        row["combine_us"] = _graph_time_us(
            lambda: combine(y, disp, weights, num_tokens, top_k, out=out, backend="triton"))
        row["gather_combine_floor_us"] = 2 * (num_tokens * (top_k + 1) * hidden_size * 2) / 4.24e6  # floors.py's rate
    return row


VARIANT_PRESETS = {"v2": {"keys": "score_int64"}, "v3": {"keys": "auto"}}


def parse_variant(spec: str) -> dict:
    """'v3,slots=512,bt=32,warps=8' -> {'name': spec, 'keys': 'auto', 'slots': 512, 'bt': 32, 'warps': 8}."""
    out = {"name": spec, "keys": "auto", "bt": None, "warps": None, "slots": None, "groups": "auto"}
    for item in spec.split(","):
        item = item.strip()
        if item in VARIANT_PRESETS:
            out.update(VARIANT_PRESETS[item])
            continue
        key, sep, value = item.partition("=")
        if not sep or key not in ("keys", "bt", "warps", "slots", "groups"):
            raise ValueError(f"--variants: expected a preset {list(VARIANT_PRESETS)} or keys=/bt=/warps=/slots=/groups=, "
                             f"got {item!r} in {spec!r}")
        if key == "keys":
            out[key] = KeyPacking.parse(value).value
        elif key == "groups":
            out[key] = GroupReduce.parse(value).value
        else:
            out[key] = int(value)
    return out


def _variant_fns(variant, logits, config, num_experts, ids, bias=None):
    def route_fn():
        return route_variant(logits, config, bias, key_packing=variant["keys"], block_t=variant["bt"],
                             num_warps=variant["warps"], group_reduce=variant["groups"])

    num_slots = ids.numel()
    scheme = DispatchScheme.AUTO if variant["slots"] is None or num_slots <= 512 else DispatchScheme.MULTI_BLOCK
    slots = None if scheme is DispatchScheme.AUTO else variant["slots"]

    def dispatch_fn(topk_ids=ids):
        return dispatch(topk_ids, num_experts, backend="triton", scheme=scheme, block_slots=slots)

    def both_fn():
        return dispatch_fn(route_fn()[1])

    return route_fn, dispatch_fn, both_fn


def profile_fn(fn, reps: int = 20) -> dict:
    """Average device time per call of each CUDA kernel that fn launches, in us."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "cuda_time_total", 0.0)
        if device_us and event.count >= reps:
            times[event.key] = round(device_us / reps, 3)
    return times


def run_variant_case(num_experts: int, top_k: int, num_tokens: int, variants, profile: bool,
                     config: RoutingConfig | None = None) -> list:
    config = RoutingConfig(top_k=top_k) if config is None else config
    gen = torch.Generator(device="cuda").manual_seed(num_experts * 1000 + top_k)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen).to(torch.bfloat16)
    bias = None
    if config.scoring.value == "sigmoid_grouped":
        bias = torch.randn(num_experts, device="cuda", generator=gen) * 0.1
    want_w, want_ids = route_reference(logits, config, bias)
    want_disp = dispatch_reference(want_ids, num_experts)
    rows = []
    for variant in variants:
        route_fn, dispatch_fn, both_fn = _variant_fns(variant, logits, config, num_experts, want_ids, bias)
        w, i = route_fn()
        d = dispatch_fn()
        ok = bool(torch.equal(i, want_ids) and torch.allclose(w, want_w, rtol=1e-6, atol=0)
                  and all(torch.equal(getattr(d, f), getattr(want_disp, f)) for f in
                          ("counts", "row_offsets", "sorted_slots", "slot_rows")))
        row = {
            "variant": variant["name"], "experts": num_experts, "top_k": top_k, "tokens": num_tokens,
            "keys": KeyPacking.parse(variant["keys"]).value, "bt": variant["bt"], "warps": variant["warps"],
            "slots": variant["slots"], "groups": variant["groups"], "scoring": config.scoring.value,
            "matches_reference": ok,
            "route_dispatch_us": _graph_time_us(both_fn),
            "route_us": _graph_time_us(route_fn),
            "dispatch_us": _graph_time_us(dispatch_fn),
        }
        if profile and num_tokens >= 4096:
            row["kernels_us"] = profile_fn(both_fn)
        rows.append(row)
        print(f"{variant['name']:>28s} E={num_experts} k={top_k} T={num_tokens:6d}  route+dispatch "
              f"{row['route_dispatch_us']:7.2f} us  route {row['route_us']:6.2f}  dispatch {row['dispatch_us']:6.2f}"
              f"  {'ok' if ok else 'MISMATCH'}", flush=True)
        if "kernels_us" in row:
            print("      kernels: " + ", ".join(f"{k[:40]} {v:.2f}" for k, v in row["kernels_us"].items()), flush=True)
    return rows


def variants_markdown(rows) -> str:
    lines = ["| variant | E | k | T | route+dispatch us | route us | dispatch us | matches reference | kernels us |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernels = "; ".join(f"{k[:32]} {v:.1f}" for k, v in r.get("kernels_us", {}).items())
        lines.append(f"| {r['variant']} | {r['experts']} | {r['top_k']} | {r['tokens']} | "
                     f"{r['route_dispatch_us']:.2f} | {r['route_us']:.2f} | {r['dispatch_us']:.2f} | "
                     f"{'yes' if r['matches_reference'] else 'NO'} | {kernels} |")
    return "\n".join(lines)


def profile_kernels(num_experts: int, top_k: int, num_tokens: int) -> str:
    """Per-kernel device time of route_dispatch (torch profiler), to see which launch dominates."""
    config = RoutingConfig(top_k=top_k)
    logits = torch.randn(num_tokens, num_experts, device="cuda").to(torch.bfloat16)
    route_dispatch(logits, config, backend="triton")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            route_dispatch(logits, config, backend="triton")
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)


def markdown(rows) -> str:
    lines = [
        "| E | k | T | route+dispatch us | (one launch) | route us | dispatch us | torch twin us (eager) | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['experts']} | {r['top_k']} | {r['tokens']} | {r['route_dispatch_us']:.2f} | "
            f"{'yes' if r['fused_launch'] else 'no'} | {r['route_us']:.2f} | {r['dispatch_us']:.2f} | "
            f"{r['torch_twin_us']:.1f} | {r['torch_twin_us'] / r['route_dispatch_us']:.1f}x |"
        )
    permute = [r for r in rows if "gather_us" in r]
    if permute:
        lines += ["", "Gather / combine, E=128, k=8, H=2048 bf16 (floor: bytes read + written at 4.24 TB/s):", "",
                  "| T | gather us | combine us | floor each us |", "|---|---|---|---|"]
        for r in permute:
            lines.append(f"| {r['tokens']} | {r['gather_us']:.2f} | {r['combine_us']:.2f} | "
                         f"{r['gather_combine_floor_us'] / 2:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 128, 256])
    parser.add_argument("--top-k", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512, 4096, 32768])
    parser.add_argument("--out", default=None, help="folder for router_bench.json / router_bench.md")
    parser.add_argument("--warmup-only", action="store_true")
    parser.add_argument("--shard", default="0/1", help="I/N: this process takes cases I, I+N, ...")
    parser.add_argument("--profile", action="store_true", help="per-kernel times for E=128, k=8, T=4096, 32768")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="compare kernel choices: presets v2 / v3 and keys=, bt=, warps=, slots=, groups= items")
    parser.add_argument("--routing-model", default=None,
                        help="with --variants: the routing, E and k of this model preset (e.g. deepseek-v3)")
    args = parser.parse_args(argv)
    variants = [parse_variant(v) for v in args.variants] if args.variants else None
    if not torch.cuda.is_available():
        print("router_bench: needs a CUDA GPU")
        return 2
    if variants:
        return _main_variants(args, variants)
    index, count = (int(x) for x in args.shard.split("/"))
    todo = cases(args.experts, args.top_k, args.tokens)[index::count]
    rows = []
    started = time.time()
    for e, k, t in todo:
        row = run_case(e, k, t, warmup_only=args.warmup_only)
        if row:
            rows.append(row)
            print(f"E={e:4d} k={k} T={t:6d}  route+dispatch {row['route_dispatch_us']:7.2f} us  "
                  f"route {row['route_us']:6.2f}  dispatch {row['dispatch_us']:6.2f}  twin {row['torch_twin_us']:8.1f}",
                  flush=True)
    if args.warmup_only:
        print(f"warm-up shard {args.shard}: {len(todo)} cases in {time.time() - started:.1f} s")
        return 0
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "graph_repeats": GRAPH_REPEATS}
    table = markdown(rows)
    if args.profile:
        for t in (4096, 32768):
            print(f"kernels of route_dispatch, E=128 k=8 T={t}:\n{profile_kernels(128, 8, t)}")
    print(table)
    if args.out:
        import os

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "router_bench.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "router_bench.md"), "w") as f:
            f.write(f"{meta}\n\n{table}\n")
    return 0


def _write(out_dir, meta, rows, table):
    import os

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "router_bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "router_bench.md"), "w") as f:
        f.write(f"{meta}\n\n{table}\n")


def _main_variants(args, variants) -> int:
    started = time.time()
    rows = []
    config, experts, top_k = None, args.experts, args.top_k
    if args.routing_model:
        preset = get_preset(args.routing_model)
        config, experts, top_k = preset.routing, [preset.num_experts], [preset.routing.top_k]
    for e, k, t in cases(experts, top_k, args.tokens):
        rows += run_variant_case(e, k, t, variants, args.profile, config)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "graph_repeats": GRAPH_REPEATS,
            "variants": [v["name"] for v in variants], "seconds": round(time.time() - started, 1)}
    table = variants_markdown(rows)
    print(table)
    if args.out:
        _write(args.out, meta, rows, table)
    return 0 if all(r["matches_reference"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
