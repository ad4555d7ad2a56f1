"""Text for the planner's multi-launch candidates (sm_100 mixed PAIR: a PAIR launch, then a SINGLE launch).

`moe2cta plan` prints one budget table per candidate (moe2cta/plan_cli.format_budget); a two-launch
candidate adds the summary line and one table per launch:

    lines.append(format_launches(ev, format_budget))   # plan_cli.format_budget, after the candidate table

Pure text, no GPU; the numbers come from planner.evaluate (Evaluation.launches).
"""
from __future__ import annotations

from typing import Callable

from . import planner

__all__ = ["format_launches"]


BudgetFormatter = Callable[[planner.Evaluation, planner.GemmProblem], str]  # plan_cli.format_budget


def format_launches(ev: planner.Evaluation, format_budget: BudgetFormatter) -> str:
    """'' for a one-launch candidate; else the 'N launches: pair kernel ..., single kernel ...' line and each
    launch's own budget table (format_budget(evaluation, problem)), indented under it."""
    if not ev.launches:
        return ""
    lines = [f"  launches         {ev.launch_summary()}"]
    for i, launch in enumerate(ev.launches, 1):
        rows = f">= {launch.rows_lo}" if launch.rows_hi is None else f"< {launch.rows_hi}"
        lines.append(f"  -- launch {i} of {len(ev.launches)}: {launch.evaluation.candidate.unit.value} kernel, "
                     f"experts with {rows} rows --")
        lines += ["  " + line for line in format_budget(launch.evaluation, launch.problem).splitlines()]
    return "\n".join(lines)
