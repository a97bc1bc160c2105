"""A dependency-free progress bar for long jobs (index builds, evaluations) on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress(total, "embedding") as bar: bar.update(n)`` — redraws at most 5
    times a second on a terminal, prints a line every 10% otherwise (logs, CI)."""

    def __init__(self, total: int, label: str, *, unit: str = "docs",
                 stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.unit = unit
        self.stream = stream or sys.stderr
        self.done = 0
        self.t0 = time.monotonic()
        self._last = 0.0
        self._last_decile = -1
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._draw(final=True)

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self._tty and now - self._last >= 0.2:
            self._last = now
            self._draw()
        elif not self._tty and self.done * 10 // self.total > self._last_decile:
            self._last_decile = self.done * 10 // self.total
            self._draw()

    def _draw(self, final: bool = False) -> None:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = self.done / elapsed
        frac = min(self.done / self.total, 1.0)
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        line = (f"{self.label} [{bar}] {self.done:,}/{self.total:,} {self.unit} "
                f"{rate:,.0f}/s " + (f"in {elapsed:.1f}s" if final else f"ETA {eta:.0f}s"))
        if self._tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        elif not final or self._last_decile < 10:
            self.stream.write(line + "\n")
        self.stream.flush()
