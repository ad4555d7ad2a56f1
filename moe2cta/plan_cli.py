"""`moe2cta plan`: show which grouped GEMM configuration the planner picks, its budget, and why not others.

    moe2cta plan --model qwen3-30b-a3b --tokens 4096 [--arch sm_90a|sm_100a] [--json]
    moe2cta plan --gemm 384,4096,4096 --tile 256x256x64 --stages 3 --pair --arch sm_100a
    moe2cta plan --gemm 384,4096,4096 --arch sm_100a          (search one dense problem)
    moe2cta plan --model qwen3-30b-a3b --buckets [MAX_ROWS]   (one configuration per tokens-per-expert bucket)

With --tile the candidate's budget is printed even when the search would not pick it (and the limit it
breaks, if any). Rows per expert: --counts, else --routing uniform (expected experts hit under uniform
random top-k, rows spread evenly over them; the default) or balanced (spread over all experts).
No GPU is needed; without --arch the local GPU's arch is used when there is one, else sm_90a.
"""
from __future__ import annotations

import argparse
import json
import sys

from .grouped_gemm.budget import Arch, WorkUnit
from . import planner, planner_report, tuning

__all__ = ["main", "build_parser", "format_budget", "format_search"]


def _kib(x: float) -> str:
    return f"{x / planner.KiB:g} KiB"


def format_budget(ev: planner.Evaluation, problem: planner.GemmProblem) -> str:
    """The seed's calculator table for one candidate, plus the model's prediction."""
    c, b, p = ev.candidate, ev.budget, problem
    lines = [
        f"candidate: {c.label()}  arch {c.arch.value}  cluster {c.cluster}  rows/CTA {c.rows_per_cta}",
        f"  problem          {p.name}: N={p.n} K={p.k}, {p.experts_hit}/{p.num_experts} experts hit, "
        f"{p.total_rows} rows ({p.routing})",
        f"  output tiles     {b.work_units} ({b.pair_units} pair + {b.single_units} single; "
        f"{b.cta_tiles} CTA tiles, {b.n_tiles} along N)",
        f"  M/N coverage     {b.coverage:.1%} (M {b.m_coverage:.1%}: {b.useful_rows} of {b.computed_rows} rows; "
        f"N {b.n_coverage:.1%})",
        f"  K segments       {b.k_segments} (BK={c.block_k})",
        f"  waves            {b.waves} on {b.num_sms} SMs (last wave {b.tail_fraction:.0%} full)",
        f"  input per stage  A {_kib(b.a_stage_bytes)} + B {_kib(b.b_stage_bytes)} = {_kib(b.input_stage_bytes)} per CTA"
        + (f" (one 1-CTA tile of {c.rows_per_cta}x{c.block_n}: {_kib(b.single_equivalent_stage_bytes)})"
           if c.unit is WorkUnit.PAIR else ""),
        f"  input buffer     {c.stages} stages x {_kib(b.input_stage_bytes)} = {_kib(b.input_buffer_bytes)} per CTA",
        f"  SMEM per CTA     {b.smem_bytes / planner.KiB:.1f} KiB of {b.smem_limit // planner.KiB} KiB "
        f"(inputs {_kib(b.input_buffer_bytes)} + epilogue {_kib(b.epilogue_bytes)} + barriers/scheduler/metadata "
        f"{_kib(b.bookkeeping_bytes)})",
        f"  per K stage      {b.flop_per_stage:,} FLOP per work unit; SMEM fill {_kib(b.unit_smem_stage_bytes)} "
        f"-> {b.intensity_smem:.1f} FLOP/B (L2 reads {_kib(b.unit_l2_stage_bytes)} -> {b.intensity_l2:.1f} FLOP/B)",
    ]
    if c.unit is WorkUnit.PAIR:
        lines.append(
            f"  vs 1-CTA tiles   two independent CTAs: {_kib(2 * b.single_equivalent_stage_bytes)} per stage, "
            f"{b.single_equivalent_intensity:.1f} FLOP/B; the pair: {_kib(b.unit_smem_stage_bytes)}, "
            f"{b.intensity_smem:.1f} FLOP/B")
    if c.arch is Arch.SM100:
        lines.append(
            f"  TMEM             {c.accumulator_slots} slot(s) x {b.tmem_columns_per_slot} columns = {b.tmem_columns} "
            f"of {b.tmem_limit} (alloc {b.tmem_alloc_columns})")
    else:
        lines.append(
            f"  registers        {b.acc_regs_per_thread} accumulator registers per consumer thread "
            f"(<= {b.reg_limit_per_thread}; {planner.SM90_CONSUMER_REGS}/consumer, {planner.SM90_PRODUCER_REGS}/producer; typical)")
    if ev.prediction:
        pr = ev.prediction
        lines.append(
            f"  predicted        {pr.seconds * 1e6:.1f} us, {pr.bound}-bound (SM {pr.sm_seconds * 1e6:.1f}, "
            f"HBM {pr.hbm_seconds * 1e6:.1f}, L2 {pr.l2_seconds * 1e6:.1f}"
            + (f", power {pr.power_seconds * 1e6:.1f}" if pr.power_seconds else "") + " us"
            + (f"; measured unit rate x{pr.rate_factor:.2f}" if pr.rate_factor != 1.0 else "")
            + f"), {pr.tflops:.0f} useful TFLOP/s, MMA efficiency {pr.mma_efficiency:.2f}")
    if not ev.ok:
        lines.append(f"  REJECTED         {ev.reason}")
    elif ev.kernel_config is not None:
        lines.append(f"  kernel config    {ev.kernel_config!r}")
    if ev.launches:
        lines.append(planner_report.format_launches(ev, format_budget))
    return "\n".join(lines)


def _why_slower(ev: planner.Evaluation, best: planner.Evaluation) -> str:
    """Name the first rank-key term where `ev` loses to `best`, with the model's reason for a slower time."""
    pr, bp = ev.prediction, best.prediction
    ka, kb = planner.rank_key(ev), planner.rank_key(best)
    term = next((name for name, x, y in zip(planner.RANK_TERMS, ka, kb) if x != y), "identical")
    if term != "predicted time":
        return f"same time; tie broken by {term}"
    if pr.rate_factor < bp.rate_factor:
        return f"measured unit rate x{pr.rate_factor:.2f} vs x{bp.rate_factor:.2f} (Hardware.pair_rate / single_warpgroup_rate)"
    if ev.budget.coverage < best.budget.coverage - 1e-9:
        return f"coverage {ev.budget.coverage:.1%} vs {best.budget.coverage:.1%}"
    if ev.budget.waves > best.budget.waves and pr.bound == "sm":
        return f"{ev.budget.waves} waves vs {best.budget.waves}"
    if pr.mma_efficiency < bp.mma_efficiency:
        return f"MMA efficiency {pr.mma_efficiency:.2f} vs {bp.mma_efficiency:.2f}"
    if pr.bound == "l2" or pr.l2_bytes > bp.l2_bytes:
        return f"L2 reads {pr.l2_bytes / 2**20:.0f} MiB vs {bp.l2_bytes / 2**20:.0f} MiB"
    if pr.depth_bytes_per_s < bp.depth_bytes_per_s:
        return f"shallower pipeline ({pr.depth_bytes_per_s / 1e9:.0f} vs {bp.depth_bytes_per_s / 1e9:.0f} GB/s per SM)"
    return f"{pr.bound}-bound: SM {pr.sm_seconds * 1e6:.1f} / HBM {pr.hbm_seconds * 1e6:.1f} / L2 {pr.l2_seconds * 1e6:.1f} us"


def _distance(c: planner.Candidate, anchor: planner.Candidate | None) -> tuple:
    if anchor is None:
        return ()
    return (c.unit is not anchor.unit, c.block_m != anchor.block_m, c.block_n != anchor.block_n,
            c.block_k != anchor.block_k, abs(c.stages - anchor.stages), c.accumulator_slots != anchor.accumulator_slots)


def format_search(result: planner.SearchResult, top: int = 5) -> str:
    p = result.problem
    hw = result.hardware
    lines = [f"== {p.name} ({p.kind.value}): N={p.n} K={p.k} on {hw.name} ({hw.arch.value}) =="]
    if not result.ranked:
        lines.append("no candidate fits")
    else:
        best = result.chosen
        lines.append("chosen:")
        lines.append(format_budget(best, p))
        lines.append(f"runners-up (best of each other tile shape; {len(result.ranked)} candidates kept):")
        for ev in planner.best_per_shape(result.ranked)[1:top]:
            pr = ev.prediction
            lines.append(f"  {ev.candidate.label():34s} {pr.seconds * 1e6:8.1f} us  x{pr.seconds / best.prediction.seconds:.2f}"
                         f"  {pr.bound:3s}  {_why_slower(ev, best)}")
    groups = result.rejected_by_reason()
    lines.append(f"rejected: {len(result.rejected)} (count by limit; example: the one closest to the choice)")
    anchor = result.chosen.candidate if result.ranked else None
    for kind, evs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        example = min(evs, key=lambda ev: _distance(ev.candidate, anchor))
        lines.append(f"  {kind:14s} {len(evs):4d}  e.g. {example.candidate.label()}: {example.reason}")
    return "\n".join(lines)


def _parse_ints(text: str, what: str, count: int | None = None, sep: str = ",") -> list[int]:
    try:
        values = [int(x) for x in text.lower().split(sep)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: expected integers separated by '{sep}', got {text!r}") from None
    if count is not None and len(values) != count:
        raise argparse.ArgumentTypeError(f"{what}: expected {count} integers, got {text!r}")
    return values


def _gemm(text: str) -> list[int]:
    return _parse_ints(text, "--gemm M,N,K", 3)


def _tile(text: str) -> list[int]:
    return _parse_ints(text, "--tile BMxBNxBK", 3, sep="x")


def _counts(text: str) -> list[int]:
    return _parse_ints(text, "--counts", None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe2cta plan",
        description="Plan grouped GEMM configurations: budget (SMEM, TMEM, tiles, coverage), choice, rejections.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="model preset (moe2cta.presets), e.g. qwen3-30b-a3b, or custom:H,I,E,k[,ACTIVATION[,bias]]")
    what.add_argument("--gemm", type=_gemm, metavar="M,N,K", help="one dense problem")
    p.add_argument("--tokens", type=int, help="tokens in the batch (with --model)")
    p.add_argument("--counts", type=_counts, metavar="C0,C1,...", help="rows per expert (with --model)")
    p.add_argument("--routing", choices=[r.value for r in planner.RoutingAssumption], default="uniform",
                   help="rows per expert when --counts is not given (default uniform)")
    p.add_argument("--arch", choices=[a.value for a in Arch], help="target (default: local GPU, else sm_90a)")
    p.add_argument("--tile", type=_tile, metavar="BMxBNxBK", help="explicit candidate (BM: rows of the whole work unit)")
    p.add_argument("--stages", type=int, help="pipeline stages of the explicit candidate (default 3)")
    unit = p.add_mutually_exclusive_group()
    unit.add_argument("--pair", dest="unit", action="store_const", const=WorkUnit.PAIR, help="2-CTA work unit")
    unit.add_argument("--single", dest="unit", action="store_const", const=WorkUnit.SINGLE, help="1-CTA work unit")
    p.add_argument("--accumulator-slots", type=int, help="accumulator slots of the explicit candidate")
    p.add_argument("--pair-threshold", type=int, default=None,
                   help="PAIR: experts with fewer rows run 1-CTA tiles (default 0; with --tile)")
    p.add_argument("--min-coverage", type=float, default=None,
                   help="drop candidates under this share of the best coverage (default: the hardware model's, "
                        "H200 0.5, B200 0.8)")
    p.add_argument("--top", type=int, default=5, help="shapes to show per search, the chosen one included (default 5)")
    p.add_argument("--buckets", type=int, nargs="?", const=4096, metavar="MAX_ROWS",
                   help="with --model: the chosen configuration per tokens-per-expert bucket up to MAX_ROWS (4096)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _default_arch() -> Arch:
    try:
        import torch

        if torch.cuda.is_available():
            major, _ = torch.cuda.get_device_capability()
            if major >= 10:
                return Arch.SM100
    except Exception:  # no torch / no driver: plan for the default
        pass
    return Arch.SM90


def _problems(args, parser):
    """(problems, header) of a --model or --gemm request."""
    if args.model is not None:
        if args.tokens is None:
            parser.error("--model needs --tokens (or --buckets)")
        from .presets import model_preset

        preset = model_preset(args.model)
        header = {"model": preset.name, "tokens": args.tokens, "hidden": preset.hidden,
                  "intermediate": preset.intermediate, "num_experts": preset.num_experts, "top_k": preset.top_k,
                  "activation": preset.activation.value}
        assumption = planner.RoutingAssumption(args.routing)
        return planner.moe_problems(preset, args.tokens, args.counts, assumption), header
    if args.counts is not None or args.tokens is not None:
        parser.error("--counts and --tokens go with --model; --gemm is one dense matrix")
    m, n, k = args.gemm
    return (planner.dense_problem(m, n, k),), {"gemm": [m, n, k]}


def _bucket_plans(preset, arch: Arch, max_bucket: int, min_coverage: float | None) -> list[dict]:
    """The chosen GEMM1/GEMM2 configuration per tokens-per-expert bucket (what serving compiles)."""
    h, i, e = preset.hidden, preset.intermediate, preset.num_experts
    rows = []
    for bucket in (b for b in tuning.BUCKETS if b <= max_bucket):
        row = {"bucket": bucket}
        g1 = tuning.bucket_problem(planner.GemmKind.GEMM1, e, 2 * i, h, bucket, activation=preset.activation,
                                   has_bias=preset.has_bias)
        g2 = tuning.bucket_problem(planner.GemmKind.GEMM2, e, h, i, bucket, has_bias=preset.has_bias,
                                   has_row_scale=True)
        for problem in (g1, g2):
            chosen = planner.search(problem, arch, min_coverage_ratio=min_coverage).chosen
            row[problem.kind.value] = {"candidate": chosen.candidate.to_dict(), "label": chosen.candidate.label(),
                                       "predicted_us": chosen.prediction.seconds * 1e6,
                                       "bound": chosen.prediction.bound}
        rows.append(row)
    return rows


def _print_bucket_plans(rows: list[dict]) -> None:
    print(f"{'rows/expert':>11}  {'gemm1':34s} {'us':>9}  {'gemm2':34s} {'us':>9}")
    for row in rows:
        g1, g2 = row["gemm1"], row["gemm2"]
        print(f"{row['bucket']:>11}  {g1['label']:34s} {g1['predicted_us']:9.1f}  {g2['label']:34s} {g2['predicted_us']:9.1f}")
    for kind in ("gemm1", "gemm2"):
        distinct = sorted({row[kind]["label"] for row in rows})
        print(f"{kind}: {len(distinct)} distinct kernels over {len(rows)} buckets: {', '.join(distinct)}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    arch = Arch.parse(args.arch) if args.arch else _default_arch()
    explicit = args.tile is not None
    if not explicit and (args.stages is not None or args.unit is not None or args.accumulator_slots is not None
                         or args.pair_threshold is not None):
        parser.error("--stages, --pair/--single, --accumulator-slots and --pair-threshold describe an explicit "
                     "candidate: give --tile too")
    if args.top < 1:
        parser.error(f"--top: expected an int >= 1, got {args.top}")
    if args.min_coverage is not None and not 0.0 <= args.min_coverage <= 1.0:
        parser.error(f"--min-coverage: expected a share in 0..1 of the best coverage, got {args.min_coverage}")
    if args.buckets is not None:
        if args.buckets < 1:
            parser.error(f"--buckets: expected MAX_ROWS >= 1 (rows per expert), got {args.buckets}")
        if args.model is None or explicit or args.tokens is not None or args.counts is not None:
            parser.error("--buckets goes with --model only (no --tokens, --counts or --tile)")
        from .presets import model_preset

        try:
            preset = model_preset(args.model)
        except ValueError as exc:
            parser.error(str(exc))
        try:
            rows = _bucket_plans(preset, arch, args.buckets, args.min_coverage)
        except ValueError as exc:
            parser.error(str(exc))
        if args.json:
            print(json.dumps({"model": preset.name, "arch": arch.value, "buckets": rows}, indent=1))
        else:
            print(f"moe2cta plan: model={preset.name}, arch={arch.value}, one configuration per bucket of rows per "
                  f"expert (every expert holding that many rows)")
            _print_bucket_plans(rows)
        return 0
    try:
        problems, header = _problems(args, parser)
        header["arch"] = arch.value
        if explicit:
            bm, bn, bk = args.tile
            cand = planner.make_candidate(arch, args.unit or WorkUnit.SINGLE, bm, bn, bk,
                                          args.stages if args.stages is not None else 3,
                                          accumulator_slots=args.accumulator_slots,
                                          pair_threshold=args.pair_threshold or 0)
            evals = [planner.evaluate(cand, prob) for prob in problems]
        else:
            results = [planner.search(prob, arch, min_coverage_ratio=args.min_coverage) for prob in problems]
    except ValueError as exc:
        parser.error(str(exc))

    if args.json:
        if explicit:
            body = [ev.to_dict() | {"gemm": prob.name, "routing": prob.routing} for ev, prob in zip(evals, problems)]
        else:
            body = [planner.search_to_dict(r, args.top) for r in results]
        print(json.dumps(header | {"gemms": body}, indent=1))
        return 0
    print("moe2cta plan: " + ", ".join(f"{k}={v}" for k, v in header.items()))
    print(f"routing: {problems[0].routing}")
    if explicit:
        for ev, prob in zip(evals, problems):
            print(f"== {prob.name}: N={prob.n} K={prob.k} ==")
            print(format_budget(ev, prob))
    else:
        for r in results:
            print(format_search(r, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
