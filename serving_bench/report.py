"""Results as a terminal table, JSON and a Markdown report (plots are in plots.py)."""
from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path

from .backends import BACKENDS, BackendFamily
from .floors import TARGETS, phase_of
from .runner import BenchResults, CaseResult, CaseStatus, summarize_backend

__all__ = ["terminal_report", "markdown_report", "results_json", "write_reports", "METHOD"]

METHOD = (
    "Each backend is first checked on every rotated input against an fp32 reference of the whole layer on every token "
    "row (or on sampled rows with --check-rows N; tolerance: 2x the error of a same-dtype torch run over the rows, "
    "and for each row 3x the same-dtype run's worst row), into memory filled with NaN; a wrong backend is reported, "
    "not timed; after timing, each rotated input's timed graph replays once more alone and its output is checked the "
    "same way (a backend timed eagerly, whose capture failed, has only the first check). GPU timing: warm-up, one CUDA graph "
    "per rotated input (inputs rotated so they do not sit in L2; every preset's weights exceed L2), replayed "
    "round-robin between CUDA events; median and percentiles over replays. Backends run one after the other "
    "(sequential order, default) or, with the interleaved order, every cell replays all of its backends in the same "
    "rounds (balanced orders; the j-th backend of a round on rotated input (round + j) mod n). Backends that sync with "
    "the host are timed eagerly with events. floor = max((bytes of the experts hit + activations) / bandwidth, "
    "2*T*k*3*H*I / bf16 matmul rate), at the targets' ceilings (4.24 TB/s, 792 TFLOP/s) unless the run says "
    "otherwise; experts hit from the actual routing of the timed inputs: floor_us is the mean "
    "over the rotated inputs, and time / floor the median over the samples of each sample's time over the floor of "
    "the input it ran."
)

_STATUS_CELL = {
    CaseStatus.WRONG: "WRONG",
    CaseStatus.ERROR: "ERROR",
    CaseStatus.UNSUPPORTED: "unsupp.",
    CaseStatus.UNAVAILABLE: "n/a",
    CaseStatus.NOT_RUN: "not run",
}


def _cell(r: CaseResult | None, mark_targets: bool) -> str:
    if r is None:
        return "-"
    if r.status is not CaseStatus.OK:
        return _STATUS_CELL[r.status]
    mark = "*" if mark_targets and r.family == BackendFamily.OURS.value and r.ratio > r.target else ""
    return f"{r.median_us:.1f} ({r.ratio:.2f}x){mark}"


def _fmt(x, spec=".2f", none="-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _groups(bench: BenchResults, results: list[CaseResult]):
    """[(preset, dist label, [tokens...], {(T, backend): result})] in run order."""
    out = []
    for preset in bench.config.models:
        for dist in bench.config.distributions:
            cells = {(r.tokens, r.backend): r for r in results if r.model == preset.name and r.distribution == dist.label}
            tokens = sorted({t for t, _ in cells})
            if tokens:
                out.append((preset, dist, tokens, cells))
    return out


def _model_line(preset) -> str:
    r = preset.routing
    extra = f", groups {r.num_expert_group}/{r.topk_group}" if r.num_expert_group else ""
    bias = ", biases" if preset.has_bias else ""
    return (
        f"{preset.name} (H={preset.hidden}, I={preset.intermediate}, E={preset.num_experts}, k={preset.top_k}; "
        f"{r.scoring.value}{extra}, {preset.activation.value}{bias})"
    )


def _rows(bench: BenchResults, preset, dist, tokens, cells):
    header = ["T", "phase", "hit", "busiest", "floor us", "bound", "target"] + list(bench.config.backends)
    rows = []
    for t in tokens:
        any_r = next(iter(cells[(t, b)] for b in bench.config.backends if (t, b) in cells))
        load = bench.loads.get((preset.name, dist.label, t))
        rows.append(
            [
                str(t),
                phase_of(t).value,
                _fmt(any_r.experts_hit, ".1f"),
                f"{load.imbalance:.2f}x" if load else "-",
                _fmt(any_r.floor_us, ".1f"),
                any_r.floor_bound or "-",
                f"{TARGETS.for_tokens(t):.2f}x",
            ]
            + [_cell(cells.get((t, b)), bench.config.device.type == "cuda") for b in bench.config.backends]
        )
    return header, rows


def _text_table(header, rows) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _md_table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _reasons(bench: BenchResults, results: list[CaseResult]) -> list[str]:
    seen, lines = set(), []
    for r in results:
        if r.build_note and not r.build_note.endswith("requested") and (r.backend, r.build_note) not in seen:
            seen.add((r.backend, r.build_note))
            lines.append(f"[{r.backend}] {r.model}: {r.build_note}")
        if r.status is CaseStatus.OK:
            if r.timing_note and (r.backend, r.timing_note) not in seen:
                seen.add((r.backend, r.timing_note))
                lines.append(f"[{r.backend}] note: {r.timing_note}")
            continue
        key = (r.backend, r.status, r.reason)
        if key not in seen:
            seen.add(key)
            where = f"{r.model} T={r.tokens} {r.distribution}: " if r.status in (CaseStatus.WRONG, CaseStatus.ERROR) else ""
            lines.append(f"[{r.backend}] {r.status.value}: {where}{r.reason}")
    return lines


def _summary_rows(bench: BenchResults, results: list[CaseResult]):
    header = ["backend", "kind", "cells ok", "geomean decode", "geomean prefill", "geomean all", "worst", "worst cell", "meets targets"]
    rows = []
    for name in bench.config.backends:
        s = summarize_backend([r for r in results if r.backend == name])
        ours = BACKENDS[name].family is BackendFamily.OURS
        on_gpu = bench.config.device.type == "cuda"
        meets = ("yes" if s.get("meets_targets") else "no") if ours and on_gpu and "meets_targets" in s else "-"
        rows.append(
            [
                name,
                BACKENDS[name].family.value,
                f"{s['cells_ok']}/{s['cells']}",
                _fmt(s["geomean_decode"]),
                _fmt(s["geomean_prefill"]),
                _fmt(s["geomean_all"]),
                _fmt(s["worst"]),
                s["worst_cell"] or "-",
                meets,
            ]
        )
    return header, rows


def _trace_rows(bench: BenchResults, model: str, dist: str):
    header = ["backend", "p50 us", "p90 us", "p99 us", "mean us", "tokens/s", "time/floor"]
    rows = []
    for tr in bench.trace_results:
        if tr.model != model or tr.distribution != dist:
            continue
        if tr.latency is None:
            rows.append([tr.backend] + [_STATUS_CELL.get(tr.status, tr.status.value)] * 6)
            continue
        lat = tr.latency
        rows.append([tr.backend, f"{lat.p50_us:.1f}", f"{lat.p90_us:.1f}", f"{lat.p99_us:.1f}", f"{lat.mean_us:.1f}",
                     f"{lat.tokens_per_s:,.0f}", f"{lat.time_over_floor:.2f}x"])
    return header, rows


def _header_lines(bench: BenchResults) -> list[str]:
    env = bench.environment
    cfg = bench.config
    lines = [
        f"device: {env.get('gpu')} ({env.get('capability', env['device'])}), torch {env['torch']}; "
        f"weights and activations {str(cfg.dtype).replace('torch.', '')}",
        f"floor ceilings: {cfg.ceilings.describe()}"
        + (f"; measured at start: {cfg.measured_ceilings.describe()}" if cfg.measured_ceilings else ""),
        f"targets (moe2cta triton / cute / auto): {TARGETS.describe()}; '*' marks such a cell above its target",
        "routing distributions: " + "; ".join(f"{d.label} = {d.describe()}" for d in cfg.distributions),
        f"router: {cfg.router.describe()}",
        f"backend order: {cfg.order.describe()}",
    ]
    if cfg.timing.settle_seconds > 0:
        lines.append(f"settle: each case replays untimed for {cfg.timing.settle_seconds:g} s before its samples "
                     "(the clock of a sustained load)")
    if cfg.device.type != "cuda":
        lines.insert(0, "NOTE: no CUDA GPU: CPU run of the torch backends; times are CPU times and the floors are "
                        "those of an H200, so time/floor says nothing about GPU kernels.")
    return lines


def terminal_report(bench: BenchResults) -> str:
    out = _header_lines(bench)
    sweep = bench.sweep_results()
    for preset, dist, tokens, cells in _groups(bench, sweep):
        out += ["", f"{_model_line(preset)} -- routing: {dist.label}", "cells: median us (time/floor)"]
        out.append(_text_table(*_rows(bench, preset, dist, tokens, cells)))
    if sweep:
        out += ["", "summary (time/floor over the cells above)", _text_table(*_summary_rows(bench, sweep))]
    if bench.trace_stats is not None:
        out += ["", f"serving trace: {_trace_line(bench)}", _trace_stats_line(bench)]
        for preset in bench.config.models:
            for dist in bench.config.distributions:
                out += [f"{preset.name} -- routing: {dist.label}", _text_table(*_trace_rows(bench, preset.name, dist.label))]
    notes = _reasons(bench, bench.results)
    if notes:
        out += ["", "notes:"] + [f"  {n}" for n in notes]
    out.append(f"\nwall time {bench.wall_seconds:.0f} s")
    return "\n".join(out)


def _trace_line(bench: BenchResults) -> str:
    return bench.config.trace.describe() if bench.config.trace else ""


def _trace_stats_line(bench: BenchResults) -> str:
    s = bench.trace_stats
    return (
        f"{s.num_steps} steps over {s.duration_s:.1f} s simulated; {s.total_tokens} tokens ({s.decode_tokens} decode, "
        f"{s.prefill_tokens} prefill); mean {s.mean_step_tokens:.0f}, max {s.max_step_tokens} tokens/step; "
        f"buckets {list(s.buckets)}"
    )


def markdown_report(bench: BenchResults, plots: dict[str, str] | None = None) -> str:
    out = ["# moe2cta serving benchmark", ""]
    out += [f"- {line}" for line in _header_lines(bench)]
    out += [f"- method: {METHOD}", f"- backends: " + "; ".join(f"`{n}` = {BACKENDS[n].description}" for n in bench.config.backends)]
    sweep = bench.sweep_results()
    if sweep:
        out += ["", "## Summary (time / floor)", "", _md_table(*_summary_rows(bench, sweep))]
    for preset, dist, tokens, cells in _groups(bench, sweep):
        out += ["", f"## {_model_line(preset)}, routing {dist.label}", "", "Cells: median us (time/floor).", ""]
        out.append(_md_table(*_rows(bench, preset, dist, tokens, cells)))
    if bench.trace_stats is not None:
        out += ["", "## Serving trace", "", f"- {_trace_line(bench)}", f"- {_trace_stats_line(bench)}",
                "- per-step MoE latency of this one layer; each step runs at its bucket size and draws one timing sample"]
        for preset in bench.config.models:
            for dist in bench.config.distributions:
                out += ["", f"### {preset.name}, routing {dist.label}", "", _md_table(*_trace_rows(bench, preset.name, dist.label))]
    if plots:
        out += ["", "## Plots", ""] + [f"![{name}]({path})" for name, path in plots.items()]
    notes = _reasons(bench, bench.results)
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    out += ["", f"Wall time {bench.wall_seconds:.0f} s.", ""]
    return "\n".join(out)


def _jsonable(x):
    if isinstance(x, enum.Enum):
        return x.value
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if hasattr(x, "type") and x.__class__.__name__ == "device":
        return str(x)
    return x


def _json_summary(bench: BenchResults, name: str) -> dict:
    summary = summarize_backend([r for r in bench.sweep_results() if r.backend == name])
    if BACKENDS[name].family is not BackendFamily.OURS or bench.config.device.type != "cuda":
        summary.pop("meets_targets", None)  # targets are for moe2cta's GPU backends
    return summary


def _ceilings_json(ceilings) -> dict | None:
    if ceilings is None:
        return None
    return {"bandwidth_bytes_per_s": ceilings.bandwidth, "matmul_flops_per_s": ceilings.matmul_flops,
            "source": ceilings.source.value}


def results_json(bench: BenchResults) -> dict:
    cfg = bench.config
    results = []
    for r in bench.results:
        d = _jsonable(r)
        d["ratio"] = _jsonable(r.ratio)
        d["target"] = r.target
        d["phase"] = phase_of(r.tokens).value
        d["samples_us"] = [round(s, 3) for s in r.samples_us]
        results.append(d)
    return {
        "environment": bench.environment,
        "ceilings": _ceilings_json(cfg.ceilings),  # what the floors use
        "measured_ceilings": _ceilings_json(cfg.measured_ceilings),  # the card's at start (None: not measured)
        "targets": _jsonable(TARGETS),
        "method": METHOD,
        "models": [_jsonable(p) | {"top_k": p.top_k} for p in cfg.models],
        "sweep_tokens": list(cfg.sweep_tokens),
        "distributions": [{"label": d.label, "description": d.describe()} for d in cfg.distributions],
        "backends": {n: {"available": bench.availability[n][0], "reason": bench.availability[n][1],
                         "kind": BACKENDS[n].family.value, "description": BACKENDS[n].description} for n in cfg.backends},
        "timing": _jsonable(cfg.timing),
        "backend_order": cfg.order.value,
        "router": cfg.router.value,
        "loads": [{"model": m, "distribution": d, "tokens": t} | _jsonable(load) | {"imbalance": load.imbalance}
                  for (m, d, t), load in bench.loads.items()],
        "results": results,
        "dtype": str(cfg.dtype).replace("torch.", ""),
        "summary": {n: _json_summary(bench, n) for n in cfg.backends},
        "trace": None if bench.trace_stats is None else {
            "config": _jsonable(cfg.trace),
            "stats": _jsonable(bench.trace_stats),
            "step_tokens": [s.num_tokens for s in bench.trace_steps],
            "results": _jsonable(bench.trace_results),
        },
        "wall_seconds": bench.wall_seconds,
    }


def write_reports(bench: BenchResults, out_dir: Path, plots: dict[str, str] | None = None) -> dict[str, Path]:
    """results.json and report.md into out_dir (created); returns {kind: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(results_json(bench), indent=1, default=str))
    paths["markdown"].write_text(markdown_report(bench, plots))
    return paths
