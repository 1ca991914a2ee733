"""Threads for the group kernels over CPU torch tensors (the torch adapter's lanes, the engine's
:class:`~.group_route.NumpyGroup`): a chunk table's rows cut into guided pieces that this thread and persistent
helper threads take as they finish (:func:`split_rows`; the numba kernels release the GIL).

numba's thread pool is never used here: next to torch's OpenMP threads, which spin after each parallel region, it
ran slower than one thread.  Every entry is computed by the same code whatever the cut, so the bits do not depend
on the threads.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from ...blas_threads import Workers

__all__ = ["guided_cuts", "split_rows"]


#: Flat arrays with at least this many entries per thread are split across ``torch.get_num_threads()`` threads.
SPLIT_MIN_SIZE = 1 << 16


_WORKERS = Workers()  # helper threads for _alongside
_COMPILED: set[tuple[Any, Any]] = set()


def _alongside(helpers: Sequence[Callable[[], Any]], own: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """``own()`` on this thread while ``helpers`` run on the helper threads; returns ``own()``'s result and the
    helpers' results, in order.  Waits for every helper before it returns or raises (no thread may still be
    writing then); an error of ``own()`` is raised as it is, before any helper's."""
    pool = _WORKERS.get(len(helpers))
    futures = [pool.submit(job) for job in helpers]
    try:
        mine = own()
    finally:
        concurrent.futures.wait(futures)
    return mine, [future.result() for future in futures]


def guided_cuts(entries: Any, parts: int, least: int) -> list[int]:
    """Row indices cutting a chunk table's rows (``entries[i]`` entries each) into contiguous pieces for ``parts``
    threads, guided: each piece about ``1 / (2 parts)`` of the entries not yet given out, and at least ``least``
    entries (one row at least), so the first pieces are large and the last ones small.  Threads that take the next
    piece as they finish balance themselves when one of them runs slower (a core shared with torch's spinning
    OpenMP workers); the small last pieces bound the wait at the end.  Returns ``[0, ..., len(entries)]``."""
    import numpy

    ends = numpy.cumsum(entries)
    total = int(ends[-1]) if len(ends) else 0
    cuts, given = [0], 0
    while given < total:
        piece = max((total - given) // (2 * parts), least)
        stop = int(numpy.searchsorted(ends, given + piece)) + 1
        stop = min(max(stop, cuts[-1] + 1), len(ends))
        cuts.append(stop)
        given = int(ends[stop - 1])
    return cuts


def split_rows(
    kernel: Any,
    before: tuple[Any, ...],
    rows: Any,
    after: tuple[Any, ...],
    dtype: Any,
    threads: int | None = None,
) -> list[Any]:
    """``kernel(*before, piece, *after)`` over the rows of a chunk table ``rows`` (``(member, lo, hi)``,
    :func:`~.group_route.chunk_table`) on ``threads`` threads (``torch.get_num_threads()`` when ``None``): this one
    and helpers, each taking the next piece of :func:`guided_cuts` as it finishes (pieces of at least ``4 x``
    :data:`SPLIT_MIN_SIZE` entries); returns each call's result, in the pieces' order.  Each entry is computed by
    the same code whatever the cut, so the bits do not depend on the thread count.

    A static cut into one part per thread lost time when a thread shared its core: right after a multi-threaded
    ``torch.mm`` (as after a backward pass), the large lane's VML-root step kernel over LLaMA-60M's 4-block set on 2
    threads took 22.2 and 21.9 ms cut statically, 20.1 and 18.7 ms guided (11 alternated rounds, two runs); back
    to back 15.5/17.9 against 15.6/16.9 ms."""
    import numpy
    import torch

    entries = rows[:, 2] - rows[:, 1]
    total = int(entries.sum())
    parts = min(torch.get_num_threads() if threads is None else threads, total // SPLIT_MIN_SIZE, len(rows))
    key = (kernel, numpy.dtype(dtype))

    def call(piece: Any) -> Any:
        return kernel(*before, piece, *after)

    if parts <= 1 or key not in _COMPILED:  # numba compiles (or loads) a kernel on one thread, at its first call
        _COMPILED.add(key)
        return [call(rows)]
    cuts = guided_cuts(entries, parts, 4 * SPLIT_MIN_SIZE)
    pieces = itertools.count()  # next() is atomic under the GIL: each piece is taken once

    def take() -> list[tuple[int, Any]]:
        done = []
        while (i := next(pieces)) < len(cuts) - 1:
            done.append((i, call(rows[cuts[i] : cuts[i + 1]])))
        return done

    mine, theirs = _alongside([take] * (parts - 1), take)
    done = mine + [pair for pairs in theirs for pair in pairs]
    return [result for _, result in sorted(done, key=lambda pair: pair[0])]
