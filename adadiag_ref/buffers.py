"""A pool of large NumPy output buffers for the functional path: resident pages instead of fresh ones.

``ar.update`` is a pure function, so every call returns new arrays: the Adam
family's ``M_t``, ``V_t`` and ``delta``, and with a basis the BLAS products
``G~ = P^T G Q`` and ``P U~ Q^T`` (12 to 20 bytes per float32 parameter, about
700 MB per LLaMA-60M step).  With the C library's defaults each large array is a
fresh ``mmap``, unmapped again when the caller drops it, so every step writes to
pages the process does not hold: each first touch is a page fault and a zeroing
pass, and inside a VM that reports free pages to its hypervisor a hypervisor
fault too (:mod:`adadiag_ref.perf.allocator`).  Measured on LLaMA-60M, the
functional AdamW step spent 3.5-8x its bandwidth bound that way, against 2.6x
with the pages kept.

This module keeps those pages, for the library's own outputs only (nothing
process-wide changes, unlike ``retain_freed_memory``), the way CuPy's memory
pool and torch's caching allocator keep device memory.  :func:`empty` serves an
array of at least :data:`MIN_BYTES` bytes from a block of exactly its size
that an earlier output no longer uses, or allocates a new block.  The block
comes back to the pool when the last array that views it is gone (a weak
reference on the output, which every view of it keeps alive, however it was
sliced, reshaped or transposed: :class:`_Block`), and it is only then lent out
again: an array the caller still holds, or any view of it, is never
overwritten.  At most :func:`limit` bytes of unused blocks are kept (default:
an eighth of the physical memory; :func:`set_limit` changes it, and ``0``
switches the pool off); a block that would exceed it is freed.

Arrays from the pool are ordinary ``numpy.ndarray`` s that do not own their
memory (``flags.owndata`` is ``False``, as for any view); their contents are
uninitialised, as ``numpy.empty``'s are, and every caller overwrites them
entirely.  Values never depend on the pool: a reused block gives the same
bits as a fresh one (tests compare with ``array_equal``).
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["MIN_BYTES", "PoolStats", "empty", "empty_like", "limit", "matmul", "release", "set_limit", "stats"]

#: Arrays smaller than this come from ``numpy.empty`` (the C library's heap serves them from resident memory).
MIN_BYTES = 1 << 18


class PoolStats(NamedTuple):
    """The pool's counters since import: ``idle_bytes`` kept for reuse, ``lent_bytes`` in arrays still alive,
    ``reused`` and ``allocated`` blocks lent out, ``freed`` blocks dropped for the limit."""

    idle_bytes: int
    lent_bytes: int
    reused: int
    allocated: int
    freed: int


class _Block(np.ndarray):
    """The owner of a block's bytes.  A distinct subclass on purpose: NumPy points a view's ``base`` at the first
    array up the chain that owns its memory or whose type differs from the view's, so every view of a lent
    (plain ``ndarray``) output refers to that output, never past it to the block, and the output lives as long
    as any view of it."""


def _default_limit() -> int:
    """An eighth of the physical memory (1 GiB where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 8
    except (AttributeError, OSError, ValueError):  # pragma: no cover - no sysconf (Windows)
        return 1 << 30


class _Pool:
    """The process's pool (module docstring).  Re-entrant lock: a weak-reference callback can run inside a
    locked region when a garbage collection starts there."""

    def __init__(self, limit: int) -> None:
        self.lock = threading.RLock()
        self.limit = limit
        self.idle: dict[int, list[_Block]] = {}  # nbytes -> blocks nobody views
        self.lent: dict[int, tuple[weakref.ref[np.ndarray], _Block]] = {}  # id(ref) -> (ref, block)
        self.idle_bytes = self.lent_bytes = self.reused = self.allocated = self.freed = 0

    def take(self, nbytes: int) -> _Block:
        with self.lock:
            blocks = self.idle.get(nbytes)
            if blocks:
                self.idle_bytes -= nbytes
                self.reused += 1
                return blocks.pop()
            self.allocated += 1
        return np.ndarray.__new__(_Block, (nbytes,), np.uint8)

    def lend(self, out: np.ndarray, block: _Block) -> None:
        ref = weakref.ref(out, self.returned)
        with self.lock:
            self.lent[id(ref)] = (ref, block)
            self.lent_bytes += block.nbytes

    def returned(self, ref: weakref.ref[np.ndarray]) -> None:
        with self.lock:
            _, block = self.lent.pop(id(ref))
            self.lent_bytes -= block.nbytes
            if self.idle_bytes + block.nbytes <= self.limit:
                self.idle.setdefault(block.nbytes, []).append(block)
                self.idle_bytes += block.nbytes
            else:
                self.freed += 1

    def trim(self, target: int) -> None:
        """Drop idle blocks, largest first, until at most ``target`` bytes are idle."""
        with self.lock:
            for nbytes in sorted(self.idle, reverse=True):
                blocks = self.idle[nbytes]
                while blocks and self.idle_bytes > target:
                    blocks.pop()
                    self.idle_bytes -= nbytes
                    self.freed += 1
            self.idle = {k: v for k, v in self.idle.items() if v}

    def reset_after_fork(self) -> None:
        self.lock = threading.RLock()


_POOL = _Pool(_default_limit())
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.reset_after_fork)


def empty(shape: Sequence[int], dtype: Any, order: str = "C") -> np.ndarray:
    """An uninitialised ``numpy.ndarray`` of ``shape``, ``dtype`` and memory ``order`` (``"C"`` or ``"F"``), like
    ``numpy.empty``; arrays of at least :data:`MIN_BYTES` bytes are served by the pool (module docstring)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or _POOL.limit == 0:
        return np.empty(shape, dtype=dtype, order=order)  # type: ignore[call-overload, no-any-return]
    block = _POOL.take(nbytes)
    out: np.ndarray = block.view(dtype).reshape(shape, order=order).view(np.ndarray)  # type: ignore[call-overload]
    _POOL.lend(out, block)
    return out


def empty_like(a: np.ndarray) -> np.ndarray:
    """:func:`empty` with ``a``'s shape and dtype, in ``a``'s memory order (Fortran order when ``a`` is
    Fortran-contiguous only, else C order): ``numpy.empty_like(a, order="K")`` for contiguous ``a``."""
    fortran = a.flags.f_contiguous and not a.flags.c_contiguous
    return empty(a.shape, a.dtype, order="F" if fortran else "C")


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for two 2-D float NumPy arrays, the product written into a pool array: the same BLAS call as
    ``a @ b`` (``numpy.matmul`` with ``out``), so the same bits."""
    out = empty((a.shape[0], b.shape[1]), np.result_type(a, b))
    return np.matmul(a, b, out=out)  # type: ignore[no-any-return]


def limit() -> int:
    """The most bytes of unused blocks the pool keeps (``0``: the pool is off)."""
    return _POOL.limit


def set_limit(nbytes: int) -> int:
    """Keep at most ``nbytes`` of unused blocks (``0`` switches the pool off and frees its idle blocks); returns the
    previous limit.  Arrays already lent out are not affected; their blocks return under the new limit."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"the pool limit must be a non-negative int number of bytes, got {nbytes!r}")
    with _POOL.lock:
        previous, _POOL.limit = _POOL.limit, nbytes
        _POOL.trim(nbytes)
    return previous


def release() -> None:
    """Free every unused block now (the limit stays; the pool fills again as outputs are dropped)."""
    _POOL.trim(0)


def stats() -> PoolStats:
    """The pool's counters (:class:`PoolStats`)."""
    p = _POOL
    with p.lock:
        return PoolStats(p.idle_bytes, p.lent_bytes, p.reused, p.allocated, p.freed)
