"""A dependency-free progress bar: redrawn in place on a terminal, a line every few seconds otherwise."""
from __future__ import annotations

import enum
import sys
import time
from typing import TextIO

__all__ = ["ProgressStyle", "Progress"]


class ProgressStyle(enum.Enum):
    AUTO = "auto"  # BAR on a terminal, LINES otherwise
    BAR = "bar"
    LINES = "lines"
    OFF = "off"


class Progress:
    def __init__(self, total: int, *, stream: TextIO | None = None, style: ProgressStyle = ProgressStyle.AUTO,
                 width: int = 30, line_interval_s: float = 5.0):
        if total < 0:
            raise ValueError(f"total: expected >= 0, got {total}")
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        if style is ProgressStyle.AUTO:
            style = ProgressStyle.BAR if getattr(self.stream, "isatty", lambda: False)() else ProgressStyle.LINES
        self.style = style
        self.width = width
        self.line_interval_s = line_interval_s
        self.started = time.perf_counter()
        self._last_line = 0.0

    def _text(self, label: str) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.started
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:5.0f}s (eta {eta:4.0f}s) {label}"

    def __call__(self, label: str = "") -> None:
        """Mark one more unit of work as started, labelled `label`."""
        self.done = min(self.done + 1, self.total)
        if self.style is ProgressStyle.OFF:
            return
        if self.style is ProgressStyle.BAR:
            self.stream.write("\r" + self._text(label)[:150].ljust(150))
            self.stream.flush()
            return
        now = time.perf_counter()
        if now - self._last_line >= self.line_interval_s or self.done == self.total:
            self._last_line = now
            self.stream.write(self._text(label) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.style is ProgressStyle.BAR:
            self.stream.write("\n")
            self.stream.flush()
