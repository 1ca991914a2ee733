"""A minimal progress bar on stderr (no dependency).

Shown only when stderr is a TTY, or when forced with ``enabled=True``; redrawn
at most ten times a second so it never dominates a cheap integration.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Fraction of ``[t0, t1]`` done, steps taken and the current step size.

    ``enabled=None`` means "only when the stream is a terminal".
    """

    def __init__(
        self, t0: float, t1: float, *, enabled: bool | None = None, stream: TextIO | None = None, width: int = 30
    ):
        self.t0, self.t1 = t0, t1
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty()) if enabled is None and isatty is not None else bool(enabled)
        self.width = width
        self._last = 0.0
        self._start = time.perf_counter()
        self._drawn = False

    def update(self, t: float, n_steps: int, h: float, *, force: bool = False) -> None:
        """Redraw if enabled and at least 0.1 s passed (or ``force``)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        span = self.t1 - self.t0
        frac = 1.0 if span <= 0 else min(1.0, max(0.0, (t - self.t0) / span))
        filled = round(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = now - self._start
        self.stream.write(f"\r[{bar}] {100 * frac:5.1f}%  t={t:.4g}  steps={n_steps}  h={h:.3g}  {elapsed:.1f}s")
        self.stream.flush()
        self._drawn = True

    def close(self, t: float, n_steps: int, h: float) -> None:
        """Final redraw and newline."""
        if not self.enabled:
            return
        self.update(t, n_steps, h, force=True)
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
