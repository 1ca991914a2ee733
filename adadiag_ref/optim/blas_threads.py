"""The engine's GEMM phase on NumPy: independent products spread over Python threads, BLAS single-threaded.

A rotation phase of :class:`~adadiag_ref.optim.engine.Engine` is many independent matrix products (one per
rotated matrix).  Called one after another, each runs on OpenBLAS's own threads, which split one product and
wait for each other, and then spin for about 0.1 s before they sleep (docs/performance.md, "Threads").  Cut
instead into whole products, one Python thread per core each calling BLAS with one thread (NumPy releases the
GIL in BLAS), the cores stay busy without synchronising inside a product: measured on this project's 2-core
VM over LLaMA-60M's 59.5 GFLOP of one rotation phase, 740-820 ms one after another against 374-503 ms so.

Every product is the same BLAS call either way (one thread computes each output block with the same kernel), so
the results do not depend on the split (``tests/test_optim_engine.py`` compares the bits).  The products are
assigned to threads longest first, each to the least loaded (balanced by their flops).  Used only where it
pays: ``threadpoolctl`` installed (it sets BLAS to one thread for the phase and restores it), more than one
core, and a phase of at least :data:`MIN_FLOPS`; otherwise the products run in order on the calling thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["MIN_FLOPS", "run_balanced", "spreads", "threads"]

MIN_FLOPS = 5e7
"""A phase below this many flops runs in order: too short for the threads' hand-over (tens of microseconds) and
the BLAS thread switch to pay."""

_STATE: dict[str, Any] = {"pool": None, "pid": None, "controller": None}
_LOCK = threading.Lock()


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


def _pool(n: int) -> ThreadPoolExecutor:
    with _LOCK:  # a fork's child makes its own threads
        if _STATE["pool"] is None or _STATE["pid"] != os.getpid() or _STATE["pool"]._max_workers < n:
            _STATE["pool"] = ThreadPoolExecutor(n, thread_name_prefix="adadiag-ref-blas")
            _STATE["pid"] = os.getpid()
        pool: ThreadPoolExecutor = _STATE["pool"]
        return pool


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
    n = min(n, len(tasks))
    shares: list[list[Callable[[], None]]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for cost, job in sorted(tasks, key=lambda task: -task[0]):  # longest first, to the least loaded
        k = loads.index(min(loads))
        shares[k].append(job)
        loads[k] += cost
    with controller.limit(limits=1, user_api="blas"):
        futures = [_pool(n - 1).submit(_run_all, share) for share in shares[1:]]
        try:
            _run_all(shares[0])
        finally:
            for future in futures:
                future.exception()  # wait for every thread before BLAS gets its threads back
        for future in futures:
            future.result()
