"""Check and time the Triton grouped GEMMs (GEMM1 + SwiGLU, GEMM2 + row scale) against torch._grouped_mm.

For each model preset shape and token count T: random top-k routing (distinct experts per token), the
dispatch metadata in plain torch, bf16 weights. Every Triton config variant is checked against the fp32
torch twin (rel. error of the valid rows) and timed by CUDA-graph replay over R routings in a row (so the
touched experts, and for small T their weights, differ between calls: L2 holds no repeat). The physical
floor beside each time: max(bytes / bandwidth, flops / matrix rate), bytes = each touched expert's weights
once + the valid A rows + the output rows.

    python -m moe2cta.serving_bench.triton_gemm_bench --models qwen3-30b-a3b mixtral-8x7b --tokens 1 32 512 4096

Variants compile in parallel worker processes first (--compile-workers), which fills Triton's on-disk
cache; timing then runs in this process alone. Writes a JSON list of rows (--out) and prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
import time
import traceback

import torch

from moe2cta.grouped_gemm.reference import grouped_gemm1_reference, grouped_gemm2_reference
from moe2cta.grouped_gemm.triton_grouped_gemm import (
    DEFAULT_TILE_HEIGHTS,
    GemmStage,
    GroupedGemmProblem,
    TileLoad,
    TritonGemmConfig,
    can_implement,
    default_config,
    triton_grouped_gemm1,
    triton_grouped_gemm2,
)

# (hidden H, intermediate I, experts E, top_k): kept here so the script needs no other module of the project.
MODEL_SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
ALIGN = 128
BANDWIDTH = 4.24e12  # the targets' copy bandwidth (serving_bench/floors.py DEFAULT_BANDWIDTH; 4.3e12 before stop 52)
MATRIX_RATE = 792e12  # the targets' bf16 matmul rate (floors.py DEFAULT_MATMUL_FLOPS; 790e12 before stop 52)
QUEUE_SLEEP_CYCLES = 200_000  # ~0.1 ms of GPU sleep before each timed replay: the host's launch leaves the window


def _cfg(bm, bn, bk, warps, stages, group_m=8, pps=1, load=TileLoad.POINTER):
    return TritonGemmConfig(bm, bn, bk, warps, stages, group_m, pps, load)


T = TileLoad.TMA


# Candidate variants by bucket; the default config of each problem is always added.
SWEEP = {
    "decode": [_cfg(16, 32, 256, 4, 4, 1, 2), _cfg(16, 64, 256, 4, 3, 1, 2, T), _cfg(16, 32, 256, 4, 3, 1, 2, T),
               _cfg(16, 128, 128, 4, 3, 1, 1), _cfg(16, 64, 128, 4, 4, 1, 2)],
    "small": [_cfg(64, 128, 64, 4, 3, 8, 2, T), _cfg(64, 128, 64, 4, 4, 8, 2), _cfg(64, 128, 64, 4, 4, 8, 2, T)],
    "prefill": [_cfg(128, 128, 64, 8, 4, 8, 1, T), _cfg(128, 128, 64, 8, 3, 8, 1, T), _cfg(128, 128, 64, 8, 3, 8, 1),
                _cfg(128, 256, 64, 8, 3, 8, 1, T), _cfg(128, 256, 64, 8, 4, 8, 1, T), _cfg(64, 128, 64, 4, 4, 8, 2, T)],
}
# --wide: more prefill shapes, rasters and depths (GEMM1 variants over the register bound are dropped by
# can_implement): group_m 4 / 16, 128-deep K steps, 256-row and 64-wide tiles, 64-row tiles 2 per SM.
WIDE_PREFILL = [_cfg(128, 128, 64, 8, 4, 4, 1, T), _cfg(128, 128, 64, 8, 4, 16, 1, T), _cfg(128, 128, 128, 8, 3, 8, 1, T),
                _cfg(256, 128, 64, 8, 3, 8, 1, T), _cfg(256, 128, 64, 8, 4, 8, 1, T), _cfg(128, 64, 64, 4, 4, 8, 1, T),
                _cfg(128, 256, 64, 8, 3, 4, 1, T), _cfg(128, 256, 64, 8, 4, 16, 1, T), _cfg(64, 256, 64, 4, 4, 8, 2, T),
                _cfg(64, 128, 64, 4, 3, 8, 2, T), _cfg(128, 128, 64, 4, 4, 8, 1, T)]
# --ridge: 128-deep K steps (256-byte weight row segments per TMA box row, better DRAM locality) for the
# cells where weight streaming and the MMA rate both bind (~64-256 rows per expert).
RIDGE = [_cfg(128, 64, 128, 4, 3, 8, 1, T), _cfg(128, 64, 128, 8, 3, 8, 1, T), _cfg(128, 128, 128, 8, 2, 8, 1, T),
         _cfg(64, 128, 128, 4, 2, 8, 2, T), _cfg(128, 128, 128, 8, 3, 8, 1, T), _cfg(128, 256, 128, 8, 2, 8, 1, T),
         _cfg(64, 256, 128, 4, 2, 8, 2, T), _cfg(128, 128, 128, 4, 3, 8, 1, T), _cfg(128, 256, 64, 8, 3, 8, 1, T)]


def torch_dispatch(topk_ids: torch.Tensor, num_experts: int, align: int = ALIGN,
                   tile_heights=DEFAULT_TILE_HEIGHTS) -> dict:
    """docs/design.md dispatch metadata in plain torch (stable within an expert)."""
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten().long()
    counts = torch.bincount(flat, minlength=num_experts)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    row_offsets = torch.cat([zero, ((counts + align - 1) // align * align).cumsum(0)])
    token_offsets = torch.cat([zero, counts.cumsum(0)])
    tile_offsets = torch.stack([torch.cat([zero, ((counts + h - 1) // h).cumsum(0)]) for h in tile_heights])
    max_rows = num_tokens * top_k + num_experts * (align - 1)
    order = torch.sort(flat, stable=True).indices
    rank = torch.arange(flat.numel(), device=device) - token_offsets[flat[order]]
    sorted_slots = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
    sorted_slots[row_offsets[flat[order]] + rank] = order.to(torch.int32)
    return {
        "counts": counts.to(torch.int32), "row_offsets": row_offsets.to(torch.int32),
        "token_offsets": token_offsets.to(torch.int32), "tile_offsets": tile_offsets.to(torch.int32).contiguous(),
        "sorted_slots": sorted_slots, "max_rows": max_rows, "order": order,
    }


def bucket_of(config: TritonGemmConfig, problem: GroupedGemmProblem) -> str:
    active = problem.num_experts * (1 - (1 - 1 / problem.num_experts) ** max(1, problem.routed_rows))
    per = round(problem.routed_rows / max(1.0, active), 3)  # the buckets of default_config
    return "decode" if per < 16 else ("small" if per <= 32 else "prefill")


def gather_options(stage: GemmStage, kind: str, config: TritonGemmConfig) -> tuple[bool, ...]:
    """GEMM1 is timed with the fused gather for the default and for every decode variant."""
    if stage is GemmStage.GEMM2:
        return (False,)
    return (False, True) if kind == "default" or config.block_m == 16 else (False,)


def variants(stage: GemmStage, shape, num_tokens: int) -> list[tuple[str, TritonGemmConfig]]:
    hidden, inter, experts, top_k = shape
    n, k = (inter, hidden) if stage is GemmStage.GEMM1 else (hidden, inter)
    problem = GroupedGemmProblem(stage, experts, n, k, num_tokens * top_k)
    default = default_config(problem)
    out = [("default", default)]
    for config in SWEEP[bucket_of(default, problem)]:
        if config != default and can_implement(config, problem)[0]:
            out.append(("sweep", config))
    return out


class Case:
    """Weights, R routings and their metadata for one (model, T)."""

    def __init__(self, model: str, num_tokens: int, routings: int, seed: int = 0):
        hidden, inter, experts, top_k = MODEL_SHAPES[model]
        self.model, self.num_tokens, self.shape = model, num_tokens, MODEL_SHAPES[model]
        gen = torch.Generator(device="cuda").manual_seed(seed)
        dtype = torch.bfloat16
        self.w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(dtype)
        self.w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(dtype)
        self.runs = []
        for _ in range(routings):
            ids = torch.rand(num_tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices
            disp = torch_dispatch(ids.to(torch.int32), experts)
            hid = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(dtype)
            slots = disp["sorted_slots"]
            a_rows = torch.where(slots >= 0, slots // top_k, -1).to(torch.int32)
            a1 = torch.zeros(disp["max_rows"], hidden, dtype=dtype, device="cuda")
            a1[slots >= 0] = hid[a_rows[slots >= 0].long()]
            a2 = (torch.randn(disp["max_rows"], inter, device="cuda", generator=gen) * 0.5).to(dtype)
            scale = torch.rand(disp["max_rows"], device="cuda", generator=gen)
            compact_a1 = hid[(disp["order"] // top_k)]  # expert-sorted compact rows for torch._grouped_mm
            compact_a2 = a2[slots >= 0]
            self.runs.append(dict(disp=disp, hidden=hid, a_rows=a_rows, a1=a1, a2=a2, scale=scale,
                                  compact_a1=compact_a1, compact_a2=compact_a2,
                                  out1=torch.empty(disp["max_rows"], inter, dtype=dtype, device="cuda"),
                                  out2=torch.empty(disp["max_rows"], hidden, dtype=dtype, device="cuda")))

    def call(self, stage: GemmStage, config, run: dict, gather: bool):
        d = run["disp"]
        meta = (d["row_offsets"], d["counts"], d["tile_offsets"])
        if stage is GemmStage.GEMM1:
            if gather:
                return triton_grouped_gemm1(run["hidden"], self.w13, *meta, a_rows=run["a_rows"], out=run["out1"],
                                            config=config)
            return triton_grouped_gemm1(run["a1"], self.w13, *meta, out=run["out1"], config=config)
        return triton_grouped_gemm2(run["a2"], self.w2, *meta, row_scale=run["scale"], out=run["out2"],
                                    config=config)

    def call_torch(self, stage: GemmStage, run: dict):
        offs = run["disp"]["token_offsets"][1:]
        if stage is GemmStage.GEMM1:
            return torch._grouped_mm(run["compact_a1"], self.w13.transpose(1, 2), offs=offs)
        return torch._grouped_mm(run["compact_a2"], self.w2.transpose(1, 2), offs=offs)

    def floor_s(self, stage: GemmStage) -> tuple[float, float]:
        """(floor seconds, flops) averaged over the routings."""
        hidden, inter, experts, top_k = self.shape
        n_w, k_dim, n_out = (2 * inter, hidden, inter) if stage is GemmStage.GEMM1 else (hidden, inter, hidden)
        floors, flops = [], []
        for run in self.runs:
            counts = run["disp"]["counts"]
            rows = int(counts.sum())
            active = int((counts > 0).sum())
            bytes_ = active * n_w * k_dim * 2 + rows * k_dim * 2 + rows * n_out * 2
            f = 2.0 * rows * n_w * k_dim
            floors.append(max(bytes_ / BANDWIDTH, f / MATRIX_RATE))
            flops.append(f)
        return sum(floors) / len(floors), sum(flops) / len(flops)


def time_graph(fn, replays: int = 20) -> float:
    """Median seconds of one fn() from CUDA-graph replays (fn already warmed up), each replay queued behind a short
    GPU sleep so that its events time the GPU, not the host's launch (before stop 52 they included it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(QUEUE_SLEEP_CYCLES)  # the GPU waits while the host launches: GPU time only
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    times.sort()
    return times[len(times) // 2]


def reference(case: Case, stage: GemmStage, run: dict) -> torch.Tensor:
    """fp32 twin output (the twin upcasts each expert's weights itself)."""
    d = run["disp"]
    if stage is GemmStage.GEMM1:
        return grouped_gemm1_reference(run["a1"].float(), case.w13, d["row_offsets"], d["counts"])
    return grouped_gemm2_reference(run["a2"].float(), case.w2, d["row_offsets"], d["counts"], run["scale"])


def valid_rows(disp) -> torch.Tensor:
    return disp["sorted_slots"] >= 0


def _compile_job(job):
    model, num_tokens, stage_name, config_fields, gather = job
    try:
        case = Case(model, max(1, min(num_tokens, 64)), 1)
        case.call(GemmStage(stage_name), TritonGemmConfig(*config_fields), case.runs[0], gather)
        torch.cuda.synchronize()
        return None
    except Exception:  # reported, the timing pass skips nothing on its own
        return f"{job}: {traceback.format_exc(limit=2)}"


def all_jobs(models, tokens):
    jobs = []
    for model in models:
        for num_tokens in tokens:
            for stage in GemmStage:
                for kind, config in variants(stage, MODEL_SHAPES[model], num_tokens):
                    for gather in gather_options(stage, kind, config):
                        job = (model, num_tokens, stage.value, dataclasses.astuple(config), gather)
                        key = (model, stage.value, dataclasses.astuple(config), gather)
                        if key not in {(j[0], j[2], j[3], j[4]) for j in jobs}:
                            jobs.append(job)
    return jobs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"], choices=sorted(MODEL_SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 512, 4096])
    parser.add_argument("--routings", type=int, default=4, help="routings replayed back to back (L2 rotation)")
    parser.add_argument("--compile-workers", type=int, default=12)
    parser.add_argument("--defaults-only", action="store_true", help="time only the default config")
    parser.add_argument("--wide", action="store_true", help="a wider prefill sweep (WIDE_PREFILL), also for 'small'")
    parser.add_argument("--ridge", action="store_true", help="also the RIDGE variants (128-deep K steps) for 'prefill'")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.defaults_only:
        for key in SWEEP:
            SWEEP[key] = []
    if args.ridge:
        SWEEP["prefill"] = SWEEP["prefill"] + [c for c in RIDGE if c not in SWEEP["prefill"]]
    if args.wide:
        SWEEP["prefill"] = SWEEP["prefill"] + WIDE_PREFILL
        SWEEP["small"] = SWEEP["small"] + WIDE_PREFILL

    t0 = time.time()
    jobs = all_jobs(args.models, args.tokens)
    if args.compile_workers > 1:
        with multiprocessing.get_context("spawn").Pool(args.compile_workers) as pool:
            for err in pool.imap_unordered(_compile_job, jobs):
                if err:
                    print("compile failed:", err, flush=True)
    print(f"# compiled {len(jobs)} variants in {time.time() - t0:.1f} s", flush=True)

    rows = []
    for model in args.models:
        for num_tokens in args.tokens:
            case = Case(model, num_tokens, args.routings)
            for stage in GemmStage:
                floor, flops = case.floor_s(stage)
                refs = [reference(case, stage, run) for run in case.runs[:1]]
                try:
                    t_torch = time_graph(lambda: [case.call_torch(stage, run) for run in case.runs]) / len(case.runs)
                except Exception as exc:  # torch._grouped_mm missing or refusing the shape
                    t_torch = float("nan")
                    print(f"torch._grouped_mm failed: {exc!r}"[:200], flush=True)
                for kind, config in variants(stage, case.shape, num_tokens):
                    for gather in gather_options(stage, kind, config):
                        row = dict(model=model, T=num_tokens, stage=stage.value, kind=kind, gather=gather,
                                   config=dict(dataclasses.asdict(config), tile_load=config.tile_load.value),
                                   floor_us=floor * 1e6,
                                   torch_us=t_torch * 1e6)
                        try:
                            run = case.runs[0]
                            out = run["out1" if stage is GemmStage.GEMM1 else "out2"]
                            out.fill_(float("nan"))
                            case.call(stage, config, run, gather)
                            mask = valid_rows(run["disp"])
                            diff = (out[mask].double() - refs[0][mask].double()).norm()
                            row["rel_err"] = (diff / refs[0][mask].double().norm().clamp_min(1e-30)).item()
                            t = time_graph(lambda: [case.call(stage, config, r, gather) for r in case.runs])
                            row["us"] = t / len(case.runs) * 1e6
                            row["tflops"] = flops / (t / len(case.runs)) / 1e12
                        except Exception as exc:
                            row["error"] = repr(exc)[:300]
                        rows.append(row)
                        if args.out:
                            with open(args.out, "w") as f:
                                json.dump(rows, f, indent=1)
            del case
            torch.cuda.empty_cache()

    print(f"# total {time.time() - t0:.1f} s")
    print(f"{'model':14} {'T':>5} {'gemm':5} {'kind':7} {'g':1} {'BMxBNxBK w s gm p L':22} {'err':>8} "
          f"{'us':>8} {'torch':>8} {'floor':>8} {'x floor':>7} {'TF/s':>6}")
    for r in rows:
        c = r["config"]
        cfg = f"{c['block_m']}x{c['block_n']}x{c['block_k']} {c['num_warps']} {c['num_stages']} " \
              f"{c['group_m']} {c['programs_per_sm']} {c['tile_load'][0].upper()}"
        if "error" in r:
            print(f"{r['model']:14} {r['T']:>5} {r['stage']:5} {r['kind']:7} {int(r['gather'])} {cfg:22} "
                  f"ERROR {r['error'][:80]}")
            continue
        print(f"{r['model']:14} {r['T']:>5} {r['stage']:5} {r['kind']:7} {int(r['gather'])} {cfg:22} "
              f"{r['rel_err']:8.1e} {r['us']:8.1f} {r['torch_us']:8.1f} {r['floor_us']:8.1f} "
              f"{r['us'] / r['floor_us']:7.2f} {r['tflops']:6.0f}")
    bad = [r for r in rows if "error" in r or not (r["rel_err"] < 1e-2)]
    print(f"# {len(rows)} rows, {len(bad)} failed or above 1e-2 error")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
