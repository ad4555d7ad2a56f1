"""PNG plots: latency vs T per backend with the floor line, and a time/floor heat map (models x T).

matplotlib is optional (the `bench` extra); without it `write_plots` returns the reason and no files.
"""
from __future__ import annotations

import math
from pathlib import Path

from .runner import BenchResults, CaseStatus

__all__ = ["write_plots"]


def _panels(bench: BenchResults, every_size: bool = False):
    """(title, results) per (model, distribution): the sweep's sizes, or every size measured (trace buckets too)."""
    results = bench.results if every_size or not bench.sweep_results() else bench.sweep_results()
    panels = []
    for preset in bench.config.models:
        for dist in bench.config.distributions:
            rs = [r for r in results if r.model == preset.name and r.distribution == dist.label]
            if rs:
                panels.append((f"{preset.name} ({dist.label})", rs))
    return panels


def _latency_plot(plt, bench: BenchResults, path: Path) -> bool:
    panels = _panels(bench, every_size=True)
    if not panels:
        return False
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (title, rs) in zip(axes.flat, panels):
        floors = sorted({(r.tokens, r.floor_us) for r in rs if r.floor_us == r.floor_us})
        ax.plot([t for t, _ in floors], [f for _, f in floors], "k--", lw=1.5, label="floor")
        for name in bench.config.backends:
            pts = sorted((r.tokens, r.median_us) for r in rs if r.backend == name and r.status is CaseStatus.OK)
            if pts:
                ax.plot([t for t, _ in pts], [u for _, u in pts], "o-", ms=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per call (T)")
        ax.set_ylabel("median latency (us)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _heatmap(plt, bench: BenchResults, path: Path) -> bool:
    import numpy as np

    panels = _panels(bench)
    names = [n for n in bench.config.backends
             if any(r.backend == n and r.status is CaseStatus.OK for _, rs in panels for r in rs)]
    if not names:
        return False
    tokens = sorted({r.tokens for _, rs in panels for r in rs})
    fig, axes = plt.subplots(1, len(names), figsize=(2.5 + 0.8 * len(tokens) * len(names), 1.4 + 0.45 * len(panels)),
                             squeeze=False)
    image = None
    for n, (ax, name) in enumerate(zip(axes.flat, names)):
        grid = np.full((len(panels), len(tokens)), np.nan)
        for i, (_, rs) in enumerate(panels):
            for r in rs:
                if r.backend == name and r.status is CaseStatus.OK and r.ratio:
                    grid[i, tokens.index(r.tokens)] = r.ratio
        image = ax.imshow(np.log2(grid), cmap="RdYlGn_r", vmin=0.0, vmax=2.0, aspect="auto")
        for i in range(len(panels)):
            for j in range(len(tokens)):
                text = "-" if np.isnan(grid[i, j]) else (f"{grid[i, j]:.2f}" if grid[i, j] < 100 else f"{grid[i, j]:.1e}")
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens], fontsize=7, rotation=45)
        ax.set_yticks(range(len(panels)), [title for title, _ in panels] if n == 0 else [""] * len(panels), fontsize=7)
        ax.set_title(f"{name}: time / floor", fontsize=9)
        ax.set_xlabel("T", fontsize=8)
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes.flat), shrink=0.8)
        bar.set_ticks([0, 0.5, 1, 1.5, 2], labels=["1x", "1.41x", "2x", "2.83x", ">=4x"])
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def write_plots(bench: BenchResults, out_dir: Path) -> tuple[dict[str, str], str]:
    """latency.png and heatmap.png into out_dir -> ({name: file name}, message when something was skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return {}, f"plots skipped: matplotlib not importable ({type(exc).__name__}); pip install 'moe2cta[bench]'"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, skipped = {}, []
    for name, draw in (("latency", _latency_plot), ("heatmap", _heatmap)):
        if draw(plt, bench, out_dir / f"{name}.png"):
            written[name] = f"{name}.png"
        else:
            skipped.append(name)
    message = f"plots skipped ({', '.join(skipped)}): no timed results" if skipped else ""
    return written, message
