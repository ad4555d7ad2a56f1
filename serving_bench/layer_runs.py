"""Combine per-model layer runs into one result: JSON of every cell and a Markdown summary.

    python -m moe2cta.serving_bench.layer_runs --run v15 --json OUT.json --md OUT.md \\
        [--previous serving_bench/results/layer-h200-2026-12-01-v14.json] [--floors targets|recorded] RUN_DIR ...

Each RUN_DIR holds the results.json of one `python -m moe2cta.serving_bench --models MODEL --full` invocation
(device_validate.sh's `layer-full` step writes one per model, so that a partial run keeps what finished). The
combined JSON has one entry per (model, tokens, backend): floor, median, error, status, time / floor and the
phase (decode T <= 512, prefill T >= 2048, as the targets define them). The Markdown gives per backend the
geometric means of time / floor over the decode and prefill cells, the worst cell and how many of its cells were ok (timed and, for the layers, checked),
and per cell the medians,
beside those of a previous combined run when one is given. Only cells whose status is ok count. A prefill cell whose
samples spread (p90 / p10 above SPREAD_MARK) is marked `~`: on the power-capped H200 such a case's samples fell on two
clock levels (the boost clock of the first ~0.1 s after a rest, then the capped one; results/stop44-h200-2026-12-04),
and its median is whichever level had more samples. Decode cells are not marked: their rotated inputs hit different
numbers of experts, so their samples differ by design. Both outputs also say how the runs were timed (settling, sampling
time, backend order, router) and what each backend is, as the per-model results.json files recorded it. Where a run
timed a ceiling (backends.py: `dense-ceiling`, `expert-bmm-ceiling`), the Markdown ends with each layer's time over
the ceiling's, cell by cell, with the SM clock each case's samples ran at.

Floors: `--floors targets` (the default) restates every cell's floor, and its time / floor, with the ceilings the
targets are defined with (4.24 TB/s, 792 TFLOP/s; shared/bench/peers-h200-2026-11-29.md), from what each results.json
recorded: its model's shape, the ceilings its floors used and each rotation's floor (and experts hit, where recorded).
Runs up to stop 51 used the ceilings measured at each start, whose matmul figure moved between 760 and 817 TFLOP/s
from start to start, so their own ratios are not comparable with each other. `--floors recorded` keeps them.
Cells are keyed by (model, routing distribution, tokens, backend); a cell given twice is an error, and where the runs
hold more than one distribution each backend's summary is per distribution.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics

DECODE_MAX_TOKENS = 512
PREFILL_MIN_TOKENS = 2048
SPREAD_MARK = 1.04  # p90 / p10 of a cell's samples above which its median is marked `~`
CEILING_FAMILY = "ceiling"  # backends.BackendFamily.CEILING's value (this module reads JSON only)
TARGET_BANDWIDTH = 4.24e12  # bytes/s: floors.DEFAULT_BANDWIDTH, the peers file's copy bandwidth
TARGET_MATMUL_FLOPS = 792e12  # FLOP/s: floors.DEFAULT_MATMUL_FLOPS, the peers file's bf16 matmul
FLOORS = ("targets", "recorded")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def phase_of(tokens: int) -> str:
    return "decode" if tokens <= DECODE_MAX_TOKENS else "prefill" if tokens >= PREFILL_MIN_TOKENS else "between"


def restated_floor_s(floor_s: float, flops: float, bytes_if_compute_bound: float, recorded: tuple[float, float],
                     target: tuple[float, float] = (TARGET_BANDWIDTH, TARGET_MATMUL_FLOPS)) -> float:
    """A floor recorded under the ceilings `recorded` (bytes/s, FLOP/s), restated under `target`. A floor above its
    compute time was memory-bound: its bytes are floor * bandwidth. Otherwise the bytes are not in the floor, and
    `bytes_if_compute_bound` (weights of the experts hit + activations, from the model and the experts hit) stands
    in."""
    recorded_bw, recorded_flops = recorded
    compute_s = flops / recorded_flops
    moved = floor_s * recorded_bw if floor_s > compute_s * (1 + 1e-9) else bytes_if_compute_bound
    return max(moved / target[0], flops / target[1])


def _restater(run: dict, where: str):
    """cell -> (floor_us, ratio) under the targets' ceilings, for the cells of one results.json."""
    ceilings = run.get("ceilings") or {}
    recorded = (ceilings.get("bandwidth_bytes_per_s"), ceilings.get("matmul_flops_per_s"))
    models = {m["name"]: m for m in run.get("models") or [] if isinstance(m, dict) and "name" in m}
    elem = _DTYPE_BYTES.get(run.get("dtype") or "bfloat16")
    if not all(recorded) or not models or elem is None:
        raise ValueError(f"run_dirs: {where} records no ceilings, model shapes or dtype to restate its floors under "
                         "the targets' ceilings; pass --floors recorded to keep the run's own")

    def restate(r: dict) -> tuple[float | None, float | None]:
        model = models.get(r["model"])
        if model is None:
            raise ValueError(f"run_dirs: {where}: no shape recorded for model {r['model']!r}")
        if not r.get("floor_us"):
            return None, None
        tokens, hidden, inter = int(r["tokens"]), model["hidden"], model["intermediate"]
        flops = 2 * tokens * model["top_k"] * 3 * hidden * inter
        per_expert = (3 * hidden * inter + ((2 * inter + hidden) if model.get("has_bias") else 0)) * elem
        activations = 2 * tokens * hidden * elem
        floors = r.get("rotation_floors_us") or [r["floor_us"]]
        hits = r.get("rotation_experts_hit") or [r.get("experts_hit") or model["num_experts"]] * len(floors)
        new = [restated_floor_s(f * 1e-6, flops, h * per_expert + activations, recorded) * 1e6
               for f, h in zip(floors, hits)]
        samples = r.get("samples_us") or []
        if samples and r.get("rotation_floors_us"):
            first = r.get("first_rotation") or 0  # (interleaved runs from stop 52 on: the backend's own offset)
            ratio = statistics.median(t / new[(first + i) % len(new)] for i, t in enumerate(samples))
        else:
            ratio = r["median_us"] / (sum(new) / len(new)) if r.get("median_us") else None
        return sum(new) / len(new), ratio

    return restate


def load_cells(run_dirs, floors: str = "targets") -> list[dict]:
    """The ok-or-not cells of every results.json under run_dirs, in the combined format, with floors and time / floor
    under the targets' ceilings (floors="targets") or as each run recorded them ("recorded"). ValueError for a cell
    (model, distribution, tokens, backend) that two runs hold."""
    if floors not in FLOORS:
        raise ValueError(f"floors: expected one of {FLOORS}, got {floors!r}")
    cells, seen = [], {}
    for run_dir in run_dirs:
        path = pathlib.Path(run_dir) / "results.json"
        if not path.is_file():
            raise ValueError(f"run_dirs: {path} does not exist")
        run = json.loads(path.read_text())
        restate = _restater(run, str(path)) if floors == "targets" else None
        for r in run["results"]:
            ratio = r.get("ratio")  # the run's time / floor (per sample over its rotation's floor, from v41 on)
            if not ratio and r.get("median_us") and r.get("floor_us"):
                ratio = r["median_us"] / r["floor_us"]
            floor_us = r.get("floor_us")
            if restate is not None:
                floor_us, ratio = restate(r)
            key = (r["model"], r.get("distribution", "uniform"), int(r["tokens"]), r["backend"])
            if key in seen:
                raise ValueError(f"run_dirs: {path} and {seen[key]} both hold the cell {key}")
            seen[key] = path
            cells.append({"model": r["model"], "distribution": key[1], "tokens": int(r["tokens"]),
                          "backend": r["backend"], "floor_us": floor_us, "median_us": r.get("median_us"),
                          "rel_err": r.get("rel_err"), "status": r["status"], "ratio": ratio,
                          "phase": phase_of(int(r["tokens"])), "p10_us": r.get("p10_us"), "p90_us": r.get("p90_us"),
                          "family": r.get("family"), "sm_mhz": r.get("sm_mhz"), "power_w": r.get("power_w")})
    several = len({c["distribution"] for c in cells}) > 1
    for c in cells:
        c["series"] = f"{c['backend']} [{c['distribution']}]" if several else c["backend"]
    return cells


def _series(cell: dict) -> str:
    """What a summary row and a table column stand for: the backend, and its distribution where a run has several."""
    return cell.get("series") or cell["backend"]


def load_conditions(run_dirs) -> dict:
    """How the runs under run_dirs were timed and what their backends are, from each results.json: {"settle_seconds",
    "target_seconds", "backend_order", "router": the distinct values, in order; "backends": {name: description}}.
    Entries a results.json lacks (runs older than the field) are left out."""
    timing_keys = ("settle_seconds", "target_seconds")
    out = {key: [] for key in (*timing_keys, "backend_order", "router")}
    out["backends"] = {}
    for run_dir in run_dirs:
        run = json.loads((pathlib.Path(run_dir) / "results.json").read_text())
        values = {key: (run.get("timing") or {}).get(key) for key in timing_keys}
        values.update(backend_order=run.get("backend_order"), router=run.get("router"))
        for key, value in values.items():
            if value is not None and value not in out[key]:
                out[key].append(value)
        for name, spec in (run.get("backends") or {}).items():
            if spec.get("description"):
                out["backends"].setdefault(name, spec["description"])
    return out


def conditions_lines(conditions: dict) -> list[str]:
    """Markdown lines for load_conditions' result (none for what no run recorded)."""
    def values(key, unit=""):
        return " / ".join(f"{v}{unit}" for v in conditions.get(key, []))

    floors = [f"- floors: {conditions['floors']}"] if conditions.get("floors") else []
    timing = [f"{label} {values(key, unit)}" for label, key, unit in (
        ("settle before each case's samples:", "settle_seconds", " s"), ("samples per case:", "target_seconds", " s"),
        ("backend order:", "backend_order", ""), ("router:", "router", "")) if conditions.get(key)]
    lines = floors + ([f"- timing: {'; '.join(timing)}"] if timing else [])
    if conditions.get("backends"):
        lines.append("- backends: " + "; ".join(f"`{n}` = {d}" for n, d in conditions["backends"].items()))
    return lines


def summary(cells: list[dict]) -> dict:
    """{series (the backend, or "backend [distribution]" where the cells hold several): {"decode", "prefill", "all":
    geomean of time / floor; "worst": (ratio, model, tokens)}}."""
    out = {}
    for backend in dict.fromkeys(_series(c) for c in cells):
        ok = [c for c in cells if _series(c) == backend and c["status"] == "ok" and c["ratio"]]
        if not ok:
            continue

        def geomean(rows):
            return math.exp(sum(math.log(c["ratio"]) for c in rows) / len(rows)) if rows else None

        worst = max(ok, key=lambda c: c["ratio"])
        out[backend] = {"cells": (len(ok), sum(_series(c) == backend for c in cells)),
                        "decode": geomean([c for c in ok if c["phase"] == "decode"]),
                        "prefill": geomean([c for c in ok if c["phase"] == "prefill"]),
                        "all": geomean(ok), "worst": (worst["ratio"], worst["model"], worst["tokens"])}
    return out


def spread(cell: dict) -> float | None:
    """p90 / p10 of a cell's samples (None where the run did not record them)."""
    return cell["p90_us"] / cell["p10_us"] if cell.get("p10_us") and cell.get("p90_us") else None


def marked(cell: dict) -> bool:
    """A timed prefill cell whose samples spread (module docstring)."""
    return cell["status"] == "ok" and bool(cell["ratio"]) and cell["phase"] == "prefill" and (
        spread(cell) or 1.0) > SPREAD_MARK


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(run: str, cells: list[dict], previous: list[dict] | None = None, conditions: dict | None = None) -> str:
    now = summary(cells)
    before = summary(previous) if previous else {}
    head = conditions_lines(conditions or {})
    lines = [f"# Full layer, run {run}", "", *head, *([""] if head else []),
             "| backend | ok cells / cells | decode T<=512 | prefill T>=2048 | all | worst cell |"
             + (" previous decode / prefill / worst |" if before else ""),
             "|---|---|---|---|---|---|" + ("---|" if before else "")]
    for backend, s in now.items():
        worst = f"{s['worst'][0]:.2f} ({s['worst'][1]} T={s['worst'][2]})"
        row = (f"| {backend} | {s['cells'][0]} / {s['cells'][1]} | {_fmt(s['decode'])} | {_fmt(s['prefill'])} | "
               f"{_fmt(s['all'])} | {worst} |")
        if before:
            b = before.get(backend)
            row += (f" {_fmt(b['decode'])} / {_fmt(b['prefill'])} / {b['worst'][0]:.2f} |" if b else " - |")
        lines.append(row)
    backends = list(now)
    old = {(c["model"], c["tokens"], _series(c)): c for c in previous or []}
    lines += ["", "Cells: median us (time / floor). The floor is the mean over a cell's rotated inputs; time / floor is the "
              "median over the samples of each sample's time over the floor of the input it ran (runs that recorded "
              "it), so at small T it can differ from median / floor.",
              "", "| model | T | floor us | " + " | ".join(backends) + " |" + (" previous " + " / ".join(backends) + " |"
                                                                           if previous else ""),
              "|---|---|---|" + "---|" * len(backends) + ("---|" if previous else "")]
    by_cell = {(c["model"], c["tokens"], _series(c)): c for c in cells}
    for model, tokens in dict.fromkeys((c["model"], c["tokens"]) for c in cells):
        floor = next(c["floor_us"] for c in cells if (c["model"], c["tokens"]) == (model, tokens))
        row = f"| {model} | {tokens} | {_fmt(floor, '.1f')} |"
        for b in backends:
            c = by_cell.get((model, tokens, b))
            ok = c is not None and c["status"] == "ok" and c["ratio"]
            mark = "~" if ok and marked(c) else ""
            row += f" {c['median_us']:.1f} ({c['ratio']:.2f}x){mark} |" if ok else f" {c['status'] if c else '-'} |"
        if previous:
            row += " " + " / ".join(_fmt((old.get((model, tokens, b)) or {}).get("median_us"), ".1f") for b in backends) + " |"
        lines.append(row)
    count = sum(1 for c in cells if marked(c))
    if count:
        lines += ["", f"`~`: {count} prefill cells whose samples spread, p90 / p10 above {SPREAD_MARK} (two clock levels "
                      "in one case: the median is the level with more samples)."]
    lines += ceiling_lines(cells)
    return "\n".join(lines) + "\n"


def ceiling_lines(cells: list[dict]) -> list[str]:
    """Markdown, one table per ceiling backend of the run (backends.py: `dense-ceiling`, `expert-bmm-ceiling`): each
    layer's time over the ceiling's in every cell where both were timed, with the SM clock each case's samples ran at,
    and the geomeans; [] without a ceiling in the run."""
    ok = {(c["model"], c["tokens"], c["backend"]): c for c in cells if c["status"] == "ok" and c["median_us"]}
    order = list(dict.fromkeys(c["backend"] for c in cells))
    ceiling_names = [b for b in order if any(c.get("family") == CEILING_FAMILY for c in cells if c["backend"] == b)]
    layers = [b for b in order if b not in ceiling_names]

    def mhz(c):
        return "-" if c is None or c.get("sm_mhz") is None else f"{c['sm_mhz']:.0f}"

    lines = []
    for name in ceiling_names:
        ceilings = [c for c in ok.values() if c["backend"] == name]
        if not ceilings:
            continue
        lines += ["", f"Against `{name}` (same run, the cells where it was timed): each layer's time over the "
                      "ceiling's, and the median SM clock in MHz while each case's samples ran.", "",
                  f"| model | T | {name} us (x floor) @ MHz | " + " | ".join(f"{b} / ceiling @ MHz" for b in layers)
                  + " |", "|---|---|---|" + "---|" * len(layers)]
        logs = {b: [] for b in layers}
        for ceil in ceilings:
            row = f"| {ceil['model']} | {ceil['tokens']} | {ceil['median_us']:.1f} ({ceil['ratio']:.2f}x) @ {mhz(ceil)} |"
            for b in layers:
                c = ok.get((ceil["model"], ceil["tokens"], b))
                if c is None:
                    row += " - |"
                    continue
                over = c["median_us"] / ceil["median_us"]
                logs[b].append(math.log(over))
                row += f" {over:.3f} @ {mhz(c)} |"
            lines.append(row)
        lines.append(f"| geomean | {len(ceilings)} cells | {_fmt(_geomean_ratio(ceilings))}x floor | "
                     + " | ".join(_fmt(math.exp(sum(v) / len(v)) if v else None) for v in logs.values()) + " |")
    return lines


def _geomean_ratio(cells: list[dict]) -> float | None:
    ratios = [c["ratio"] for c in cells if c.get("ratio")]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", help="directories holding one results.json each")
    parser.add_argument("--run", required=True, help="the run's name, e.g. v15")
    parser.add_argument("--json", required=True, help="combined JSON to write")
    parser.add_argument("--md", required=True, help="Markdown summary to write")
    parser.add_argument("--previous", default=None, help="a combined JSON of an earlier run, shown beside")
    parser.add_argument("--device", default="NVIDIA H200")
    parser.add_argument("--floors", choices=FLOORS, default="targets",
                        help="targets (default): every floor restated with the targets' ceilings, 4.24 TB/s and 792 "
                             "TFLOP/s; recorded: the floors each run recorded (before stop 52: the ceilings measured "
                             "at its start)")
    args = parser.parse_args(argv)
    try:
        for name in ("json", "md"):  # before the work: a bad output path is named, not a traceback after it
            path = pathlib.Path(getattr(args, name))
            if path.is_dir():
                raise ValueError(f"--{name}: {path} is a directory, expected a file path")
            path.parent.mkdir(parents=True, exist_ok=True)
        cells = load_cells(args.run_dirs, args.floors)
        conditions = load_conditions(args.run_dirs)
        conditions["floors"] = (f"the targets' ceilings ({TARGET_BANDWIDTH / 1e12:.2f} TB/s, "
                                f"{TARGET_MATMUL_FLOPS / 1e12:.0f} TFLOP/s)" if args.floors == "targets"
                                else "as each run recorded them")
        previous = json.loads(pathlib.Path(args.previous).read_text())["results"] if args.previous else None
    except ValueError as exc:  # (json.JSONDecodeError too)
        parser.error(str(exc))
    except (OSError, KeyError, TypeError) as exc:
        parser.error(f"cannot read the runs: {type(exc).__name__}: {exc}")
    if not cells:
        parser.error("run_dirs: no cells in these results")
    pathlib.Path(args.json).write_text(json.dumps({"run": args.run, "device": args.device, "conditions": conditions,
                                                   "results": cells}, indent=1))
    pathlib.Path(args.md).write_text(markdown(args.run, cells, previous, conditions))
    for backend, s in summary(cells).items():
        print(f"{backend:12s} decode {_fmt(s['decode'])} prefill {_fmt(s['prefill'])} worst {s['worst'][0]:.2f} "
              f"({s['worst'][1]} T={s['worst'][2]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
