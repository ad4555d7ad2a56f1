"""Expert-parallel step timing: dispatch / expert compute / combine per step (moe2cta.expert_parallel).

Each rank holds T tokens and its shard of a model's routed experts; one step is

    dispatch  route the rank's tokens + send layout + all-to-all of rows and local ids (+ the count
              exchange and its host sync in EXACT_SPLITS mode)
    compute   owner-side dispatch, gather, grouped GEMM1 + GEMM2 over the local experts
    combine   all-to-all of the expert outputs back + fixed-order fp32 combine

Timing: eager (the EXACT_SPLITS path syncs with the host by design), a barrier before each step, a device
synchronize after each phase, perf_counter around each phase. A phase's time on a rank includes waiting for
slower peers inside its collectives, so the table reports, per phase, the median over steps of the slowest
rank. Routing varies between steps (a pool of logits). Also reported: rows each rank sends per step (the
PADDED_CAPACITY buffers move W*C rows whatever the routing) and the bytes that implies.

Launch (2 GPUs, NCCL; not run yet):
    torchrun --nproc-per-node 2 -m moe2cta.serving_bench.ep_bench --model deepseek-v3 --tokens 128,1024
    python -m moe2cta.serving_bench.ep_bench --nprocs 2 --model qwen3-235b-a22b --stages triton
CPU smoke (gloo, 2 processes, tiny shapes, also checks the output against the single-device layer):
    python -m moe2cta.serving_bench.ep_bench --smoke
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import sys
import time

import torch

from moe2cta.expert_parallel import (
    TORCH_STAGES,
    A2AMode,
    ExpertParallelConfig,
    ExpertPlacement,
    RankStages,
    ep_combine,
    ep_dispatch,
    ep_expert_compute,
    shard_experts,
)
from moe2cta.presets import ModelPreset, get_preset

__all__ = ["main", "parse_args", "run_rank", "triton_stages"]

DEFAULT_MODELS = ("deepseek-v3", "qwen3-235b-a22b")
SMOKE_HIDDEN, SMOKE_INTERMEDIATE = 64, 32
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _triton_grouped_experts(a1, w13, w2, disp, activation, b13, b2):
    from moe2cta.grouped_gemm.triton_grouped_gemm import triton_grouped_gemm1, triton_grouped_gemm2

    heights = tuple(disp.tile_heights)
    a2 = triton_grouped_gemm1(
        a1, w13, disp.row_offsets, disp.counts, disp.tile_offsets, activation, b13=b13, tile_heights=heights
    )
    return triton_grouped_gemm2(a2, w2, disp.row_offsets, disp.counts, disp.tile_offsets, b2=b2, tile_heights=heights)


def triton_stages() -> tuple[RankStages, str]:
    """Triton grouped GEMMs, plus the router's Triton kernels when moe2cta.router.api exists -> (stages, note)."""
    try:
        from moe2cta.router import api as router_api
    except Exception as exc:  # noqa: BLE001 - optional module; the twins still work
        return RankStages(grouped_experts=_triton_grouped_experts), f"router twins (router.api: {exc})"
    backend = getattr(getattr(router_api, "RouterBackend", None), "TRITON", "triton")
    stages = RankStages(
        route=functools.partial(router_api.route, backend=backend),
        dispatch=functools.partial(router_api.dispatch, backend=backend),
        gather=functools.partial(router_api.gather, backend=backend),
        combine=functools.partial(router_api.combine, backend=backend),
        grouped_experts=_triton_grouped_experts,
    )
    return stages, "router.api Triton kernels"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ep_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", help=f"preset name (repeatable; default {', '.join(DEFAULT_MODELS)})")
    p.add_argument("--tokens", default="128,512,2048", help="tokens per rank, comma separated")
    p.add_argument("--mode", default="exact_splits", choices=[m.value for m in A2AMode])
    p.add_argument("--capacity", type=int, default=None, help="rows per peer in padded_capacity (default T*k)")
    p.add_argument("--placement", default="contiguous", choices=[m.value for m in ExpertPlacement])
    p.add_argument("--stages", default="torch", choices=["torch", "triton"], help="per-rank stage functions")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nprocs", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="cpu -> gloo, cuda -> nccl")
    p.add_argument("--json", default=None, help="write the results (rank 0) to this file")
    p.add_argument("--smoke", action="store_true", help="CPU gloo, tiny shapes, 2 steps, correctness check")
    args = p.parse_args(argv)
    args.models = tuple(args.model or DEFAULT_MODELS)
    try:
        args.token_counts = tuple(int(t) for t in args.tokens.split(","))
    except ValueError:
        p.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if min(args.token_counts) < 0:
        p.error(f"--tokens: expected counts >= 0, got {args.tokens!r}")
    for name in ("steps", "nprocs"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            p.error(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    for name in args.models:
        try:
            get_preset(name)
        except ValueError as exc:
            p.error(f"--model: {exc}")
    if args.smoke:
        args.device, args.dtype, args.warmup, args.steps = "cpu", "fp32", 1, 2
        args.token_counts = (16,)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible")
    if args.capacity is not None and args.mode != A2AMode.PADDED_CAPACITY.value:
        p.error("--capacity: only with --mode padded_capacity")
    return args


def _shape(preset: ModelPreset, smoke: bool) -> ModelPreset:
    if not smoke:
        return preset
    from dataclasses import replace

    return replace(preset, hidden=SMOKE_HIDDEN, intermediate=SMOKE_INTERMEDIATE)


def _weights(preset, cfg, dtype, device, full: bool, seed: int):
    """(w13_local, w2_local, b13_local, b2_local, full weights or None). Full only for the smoke check."""
    H, I = preset.hidden, preset.intermediate
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if full:
        E = preset.num_experts
        w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype)
        w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
        b13 = (0.1 * torch.randn(E, 2 * I, generator=gen)).to(dtype) if preset.has_bias else None
        b2 = (0.1 * torch.randn(E, H, generator=gen)).to(dtype) if preset.has_bias else None
        local = [shard_experts(w, cfg) for w in (w13, w2, b13, b2)]
        return (*(None if w is None else w.to(device) for w in local), (w13, w2, b13, b2))
    n = cfg.num_local_experts  # real shapes: only this rank's experts are ever allocated
    w13 = torch.randn(n, 2 * I, H, device=device, dtype=dtype) / H**0.5
    w2 = torch.randn(n, H, I, device=device, dtype=dtype) / I**0.5
    b13 = 0.1 * torch.randn(n, 2 * I, device=device, dtype=dtype) if preset.has_bias else None
    b2 = 0.1 * torch.randn(n, H, device=device, dtype=dtype) if preset.has_bias else None
    return w13, w2, b13, b2, None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_case(args, rank, world, device, preset, tokens, stages, group=None) -> dict:
    import torch.distributed as dist

    dtype = _DTYPES[args.dtype]
    cfg = ExpertParallelConfig(
        world, rank, preset.num_experts, ExpertPlacement.parse(args.placement), A2AMode.parse(args.mode), args.capacity
    )
    w13, w2, b13, b2, full = _weights(preset, cfg, dtype, device, full=args.smoke, seed=7)
    gen = torch.Generator(device="cpu").manual_seed(100)
    pool = 4  # routing differs between steps; all ranks draw the same pool and take their own rows
    hidden_all = torch.randn(pool, world * tokens, preset.hidden, generator=gen).to(dtype)
    logits_all = torch.randn(pool, world * tokens, preset.num_experts, generator=gen)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    hidden = hidden_all[:, mine].to(device)
    logits = logits_all[:, mine].to(device)
    times = {"dispatch": [], "compute": [], "combine": []}
    rows_sent = []
    checked = None
    for step in range(args.warmup + args.steps):
        i = step % pool
        dist.barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        weights, ids = stages.route(logits[i], preset.routing, None)
        sent = ep_dispatch(hidden[i], weights, ids, cfg, group, stages=stages)
        _sync(device)
        t1 = time.perf_counter()
        y = ep_expert_compute(sent, w13, w2, activation=preset.activation, b13_local=b13, b2_local=b2, stages=stages)
        _sync(device)
        t2 = time.perf_counter()
        out = ep_combine(y, sent, cfg, group, out_dtype=dtype, stages=stages)
        _sync(device)
        t3 = time.perf_counter()
        if step >= args.warmup:
            for name, dt in (("dispatch", t1 - t0), ("compute", t2 - t1), ("combine", t3 - t2)):
                times[name].append(dt * 1e3)
            rows_sent.append(sum(sent.send_splits) if sent.send_splits is not None else sent.recv_rows.shape[0])
        if full is not None and step == 0:
            checked = _check_against_single_device(out.cpu(), hidden_all[i], logits_all[i], full, preset, mine)
    per_rank = {"times": times, "rows_sent": rows_sent, "checked": checked}  # checked: (equal, err, tol)
    gathered = [None] * world
    dist.all_gather_object(gathered, per_rank, group=group)
    row_bytes = preset.hidden * torch.empty((), dtype=dtype).element_size()
    result = {
        "model": preset.name,
        "hidden": preset.hidden,
        "intermediate": preset.intermediate,
        "experts": preset.num_experts,
        "local_experts": cfg.num_local_experts,
        "top_k": preset.top_k,
        "tokens_per_rank": tokens,
        "world": world,
        "mode": cfg.a2a_mode.value,
        "placement": cfg.placement.value,
        "dtype": args.dtype,
    }
    for name in times:
        slowest = [max(g["times"][name][s] for g in gathered) for s in range(len(times[name]))]
        result[f"{name}_ms_median"] = statistics.median(slowest) if slowest else float("nan")
    sent_rows = [statistics.median(g["rows_sent"]) for g in gathered]
    result["rows_sent_per_rank_median"] = sent_rows
    result["a2a_bytes_per_rank_each_way_max"] = int(max(sent_rows) * row_bytes)
    if args.smoke:
        result["equals_single_device"] = [g["checked"][0] for g in gathered]
        result["max_err_vs_fp64"] = max(g["checked"][1] for g in gathered)
        result["tolerance"] = min(g["checked"][2] for g in gathered)
    return result


def _check_against_single_device(out, hidden_all, logits_all, full, preset, mine) -> tuple[bool, float, float]:
    """(bit-equal to the single-device torch pipeline, max |out - fp64 reference|, tolerance) on CPU.

    Torch stages must be bit-equal; other stages (another GEMM accumulation order) must stay within twice
    the single-device fp32 pipeline's own error against fp64, plus 1e-5.
    """
    from moe2cta.reference import moe_forward_reference, moe_reference
    from moe2cta.router.reference import route_reference

    w13, w2, b13, b2 = full
    single = moe_forward_reference(
        hidden_all, w13, w2, logits_all, preset.routing, activation=preset.activation, b13=b13, b2=b2
    )[mine]
    weights, ids = route_reference(logits_all[mine], preset.routing)
    exact = moe_reference(
        hidden_all[mine], w13, w2, weights, ids, activation=preset.activation, b13=b13, b2=b2, dtype=torch.float64
    )
    tol = 2 * (single.double() - exact).abs().max().item() + 1e-5
    return bool(torch.equal(out, single)), (out.double() - exact).abs().max().item(), tol


def run_rank(rank: int, world: int, init_method: str, args: argparse.Namespace, local_rank: int | None = None):
    import torch.distributed as dist

    if args.device == "cuda":
        device = torch.device("cuda", rank if local_rank is None else local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        stages, note = (TORCH_STAGES, "torch twins") if args.stages == "torch" else triton_stages()
        results = []
        for name in args.models:
            preset = _shape(get_preset(name), args.smoke)
            for tokens in args.token_counts:
                result = _bench_case(args, rank, world, device, preset, tokens, stages)
                result.update(stages=args.stages, stages_note=note, backend=backend)
                results.append(result)
                if rank == 0:
                    _print_row(result)
        if rank == 0 and args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
        if args.smoke:
            exact_expected = args.stages == "torch"
            bad = [
                r for r in results
                if r["max_err_vs_fp64"] > r["tolerance"] or (exact_expected and not all(r["equals_single_device"]))
            ]
            if bad:
                raise RuntimeError(f"smoke: output differs from the single-device layer for {bad}")
    finally:
        dist.destroy_process_group()


def _print_row(r: dict) -> None:
    print(
        f"{r['model']:>16} W={r['world']} T/rank={r['tokens_per_rank']:>5} {r['mode']:>15} "
        f"dispatch {r['dispatch_ms_median']:8.3f} ms  compute {r['compute_ms_median']:8.3f} ms  "
        f"combine {r['combine_ms_median']:8.3f} ms  a2a {r['a2a_bytes_per_rank_each_way_max'] / 1e6:7.2f} MB/rank"
        + (f"  bit-equal={all(r['equals_single_device'])} err={r['max_err_vs_fp64']:.2e}"
           if "equals_single_device" in r else ""),
        flush=True,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    run_rank(rank, world, init_method, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args,
                 local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        return 0
    world = 2 if args.smoke else args.nprocs
    if args.device == "cuda" and world > torch.cuda.device_count():
        print(f"--nprocs: {world} ranks need {world} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(_spawned, args=(world, init_method, args), nprocs=world, join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
