"""The engine's GEMM phase on NumPy: independent products spread over Python threads, BLAS single-threaded.

A rotation phase of :class:`~adadiag_ref.optim.engine.Engine` is many independent matrix products (one per
rotated matrix).  Called one after another, each runs on OpenBLAS's own threads, which split one product and
wait for each other, and then spin for about 0.1 s before they sleep (docs/performance.md, "Threads").  Cut
instead into whole products, one Python thread per core each calling BLAS with one thread (NumPy releases the
GIL in BLAS), the cores stay busy without synchronising inside a product: measured on this project's 2-core
VM over LLaMA-60M's 59.5 GFLOP of one rotation phase, 740-820 ms one after another against 374-503 ms so.

Each product is one call of single-threaded BLAS however the products are split, so the results do not depend on
the split: they are those of each product with BLAS on one thread, what ``ar.update`` gives under
``threadpoolctl.threadpool_limits(1)`` (``tests/test_optim_engine.py`` compares the bits).  A call on BLAS's own
threads may round otherwise: OpenBLAS 0.3.31 (``Haswell`` kernels) gave other bits on 2 threads than on 1 for
``A^T B`` of float32 ``n x n`` matrices from ``n = 96`` and of float64 ones at ``n = 300`` (docs/spec.md, "Bits
across processors"), so a phase spread so agrees with ``ar.step`` on BLAS's own threads to rounding only.
The products are assigned to threads longest first, each to the least loaded (balanced by their flops).  Used
only where it pays: ``threadpoolctl`` installed (it sets BLAS to one thread for the phase and restores it), more
than one core, and a phase of at least :data:`MIN_FLOPS`; otherwise the products run in order on the calling
thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["MIN_FLOPS", "Workers", "balanced", "run_balanced", "spreads", "threads"]

T = TypeVar("T")

MIN_FLOPS = 5e7
"""A phase below this many flops runs in order: too short for the threads' hand-over (tens of microseconds) and
the BLAS thread switch to pay."""

_STATE: dict[str, Any] = {"controller": None}


class Workers:
    """Persistent helper threads: created on first use, grown on demand, idle between calls, and made anew in a
    forked child (whose copy of the pool has no threads behind it).  This module's GEMM phases and the torch
    adapter's CPU kernels (``families/adam/torch_route.py``) each keep one."""

    def __init__(self, prefix: str = "adadiag-ref") -> None:
        self.pool: Any = None
        self.size = 0
        self.pid = 0
        self.prefix = prefix
        self.lock = threading.Lock()

    def get(self, n: int) -> ThreadPoolExecutor:
        with self.lock:
            if self.pool is None or self.size < n or self.pid != os.getpid():
                old, self.pool, self.size = self.pool, ThreadPoolExecutor(n, thread_name_prefix=self.prefix), n
                if old is not None and self.pid == os.getpid():
                    old.shutdown(wait=False)
                self.pid = os.getpid()
            pool: ThreadPoolExecutor = self.pool
            return pool


_WORKERS = Workers("adadiag-ref-blas")


def threads() -> int:
    """The cores this process may run on (its CPU affinity where the platform says it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def _controller() -> Any:
    """threadpoolctl's controller (made once: it scans the loaded libraries), or ``None`` without threadpoolctl."""
    if _STATE["controller"] is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _STATE["controller"] = False
        else:
            _STATE["controller"] = ThreadpoolController()
    return _STATE["controller"] or None


def balanced(items: Sequence[T], weight: Callable[[T], float], k: int) -> list[list[T]]:
    """``items`` in at most ``k`` groups of near-equal total ``weight``: the heaviest first, each to the lightest
    group so far (longest processing time first); the empty groups left out."""
    groups: list[list[T]] = [[] for _ in range(k)]
    loads = [0.0] * k
    for item in sorted(items, key=lambda it: -weight(it)):
        j = loads.index(min(loads))
        groups[j].append(item)
        loads[j] += weight(item)
    return [g for g in groups if g]


def _run_all(jobs: Sequence[Callable[[], None]]) -> None:
    for job in jobs:
        job()


def spreads(flops: float, n_threads: int | None = None) -> bool:
    """Whether :func:`run_balanced` would spread a phase of ``flops`` over threads (so that a caller with little
    work hands over a few large jobs instead of one per product: each job costs microseconds of Python)."""
    n = threads() if n_threads is None else n_threads
    return n > 1 and flops >= MIN_FLOPS and _controller() is not None


def run_balanced(tasks: Sequence[tuple[float, Callable[[], None]]], n_threads: int | None = None) -> None:
    """Run every ``(flops, job)`` of ``tasks``: spread over ``n_threads`` (default :func:`threads`) threads with BLAS
    single-threaded where that pays (module docstring), else in order here.  Jobs must be independent; the first
    error a job raises is raised here once every thread is done."""
    n = threads() if n_threads is None else n_threads
    if len(tasks) < 2 or not spreads(sum(cost for cost, _ in tasks), n):
        _run_all([job for _, job in tasks])
        return
    controller = _controller()
    shares = [[job for _, job in share] for share in balanced(tasks, lambda task: task[0], min(n, len(tasks)))]
    with controller.limit(limits=1, user_api="blas"):
        futures = [_WORKERS.get(len(shares) - 1).submit(_run_all, share) for share in shares[1:]]
        try:
            _run_all(shares[0])
        finally:
            for future in futures:
                future.exception()  # wait for every thread before BLAS gets its threads back
        for future in futures:
            future.result()
