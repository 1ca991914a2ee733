"""The NaN/Inf scan that guards every step, against the one-stream count it replaced (issue 31's CPU targets).

Every step reads all its gradients once before any write (``adadiag_ref._kernels.nonfinite_count``, and the torch
adapter's large lane through ``group_route.nonfinite_at``).  A core reading one stream is limited by how many lines
its prefetchers keep in flight; ``_any_nonfinite_flat`` reads the array's four quarters side by side.  This script
times, over LLaMA-60M's entry count (4 blocks, 8000-token embedding and head: about 21 M), float32 and float64:

* ``one stream``: the former kernel, ``sum(~isfinite(x))`` in one loop (kept here as the baseline);
* ``four streams``: ``_kernels._nonfinite_count_flat`` (the four-stream scan; it counts only after a hit);
* ``eight streams``: the same test over the array's eighths (kept here: does a ninth to sixteenth prefetch stream
  still help?);
* ``in 2^16 chunks``: the same over the chunk table the group kernels walk, one thread.

Rounds alternate the contenders; the table gives median milliseconds, the median of per-round ratios to the
one-stream count and the rate in GB/s.  ``--evict`` writes a 256 MiB buffer before every call, so each scan reads
its array from memory (a training step's gradients are not in the cache either); a small ``--entries`` without it
(262144: 1 MiB in float32) keeps the array in the core's cache and measures the scan's arithmetic instead.  Run:
``python benchmarks/nonfinite_scan.py [--rounds 15] [--entries 21000000] [--evict]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from adadiag_ref import _kernels
from adadiag_ref.optim.families.adam import group_route


@numba.njit(cache=False, nogil=True)
def one_stream_count(x: Any) -> Any:
    bad = 0
    for i in range(x.size):
        bad += not np.isfinite(x[i])
    return bad


@numba.njit(cache=False, nogil=True)
def eight_stream_any(x: Any) -> Any:
    q = x.size // 8
    a, b, c, d = x[:q], x[q : 2 * q], x[2 * q : 3 * q], x[3 * q : 4 * q]
    e, f, g, h = x[4 * q : 5 * q], x[5 * q : 6 * q], x[6 * q : 7 * q], x[7 * q : 8 * q]
    bad = False
    for i in range(q):
        first = np.isfinite(a[i]) & np.isfinite(b[i]) & np.isfinite(c[i]) & np.isfinite(d[i])
        bad |= not (first & np.isfinite(e[i]) & np.isfinite(f[i]) & np.isfinite(g[i]) & np.isfinite(h[i]))
    for i in range(8 * q, x.size):
        bad |= not np.isfinite(x[i])
    return bad


def contenders(x: np.ndarray) -> dict[str, Callable[[], Any]]:
    rows = group_route.chunk_table([x.size])
    at = np.array([x.ctypes.data], dtype=np.int64)
    return {
        "one stream": lambda: one_stream_count(x),
        "four streams": lambda: _kernels._nonfinite_count_flat(x),
        "eight streams": lambda: int(eight_stream_any(x)),
        "in 2^16 chunks": lambda: group_route.nonfinite_at(at, rows, x),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--entries", type=int, default=21_000_000)
    parser.add_argument("--evict", action="store_true", help="write 256 MiB before every call (cold cache)")
    args = parser.parse_args(argv)
    evictor = np.zeros(64 * 2**20, dtype=np.float32) if args.evict else None
    print("| median ms (ratio to one stream; GB/s) | " + " | ".join(["float32", "float64"]) + " |")
    print("|---|---|---|")
    cells: dict[str, list[str]] = {}
    for dtype in (np.float32, np.float64):
        x = np.random.default_rng(0).standard_normal(args.entries).astype(dtype)
        fns = contenders(x)
        for fn in fns.values():
            assert fn() == 0  # compiled, and all agree on a finite array
        times: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(args.rounds):
            for name in list(fns) if r % 2 == 0 else list(reversed(fns)):
                if evictor is not None:
                    evictor += 1.0
                start = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - start)
        base = times["one stream"]
        for name, t in times.items():
            ratio = statistics.median(a / b for a, b in zip(t, base, strict=True))
            rate = x.nbytes / statistics.median(t) / 1e9
            cells.setdefault(name, []).append(f"{statistics.median(t) * 1e3:.2f} ({ratio:.2f}; {rate:.0f})")
    for name, row in cells.items():
        print(f"| {name} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
