"""The numba foundation shared by every family's numba route (the families' own kernels live beside them).

A family's numba route (``adadiag_ref/optim/families/<family>/numba.py``) holds that family's kernels and the
routes that call them; this module holds what they share and what is not a family's:

* when the kernels apply (:func:`usable`, :func:`selected`: numba imported, float32/float64 NumPy arrays of
  one dtype, ``cfg.kernels`` not ``"reference"``; never the environment), how they are compiled
  (:func:`_jit`, :func:`_inline`, :func:`_serial_and_parallel`) and the layout helpers (:func:`alike`,
  :func:`flat`, :func:`rows_in_memory_order`);
* the scalars as the reference rounds them (:func:`scalar`, :func:`ema_coefficients`);
* the entries every family's kernels share, each written once: the EMA ``b m0 + c x``
  (:func:`ema_entry`) and the update's tail ``delta = (-eta)(U + lambda W)`` (:func:`delta_entry`),
  with the tail's flat passes (``apply_*``, ``scale_direction_flat``);
* the read-only finiteness scan (:func:`nonfinite_count`) and the canonical SVD's fast steps (pivoted
  Gram-Schmidt and pivoted Cholesky, for :mod:`adadiag_ref.linalg`).

Thread policy: the callers choose.  A flat kernel that some caller runs on numba's pool exists twice, serial
and ``*_parallel`` (separate compiles and cache entries, :func:`_serial_and_parallel`).  The engine's routes use
the parallel forms for arrays of :data:`PARALLEL_MIN_SIZE` entries or more, between its GEMM phases, and only
under numba's non-spinning ``workqueue`` layer; the torch adapter's group kernels never (torch's OpenMP threads
spin after each parallel region): they cut their rows over ``torch.get_num_threads()`` threads of their own
instead (``optim/families/adam/torch_route.py``).  BLAS owns the cores during GEMMs
(docs/performance.md, "Threads").
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "AVAILABLE",
    "PARALLEL_MIN_SIZE",
    "alike",
    "ema_coefficients",
    "flat",
    "is_host_number",
    "nonfinite_count",
    "one_float_dtype",
    "pivoted_cholesky_columns",
    "pivoted_gram_schmidt",
    "rows_in_memory_order",
    "scalar",
    "selected",
    "usable",
]

#: Arrays with at least this many entries use the parallel kernels (smaller ones: the pool's start-up dominates).
PARALLEL_MIN_SIZE = 1 << 18

try:  # numba is optional
    import numba

    AVAILABLE = True
    prange: Any = numba.prange
except ImportError:  # pragma: no cover - exercised only without numba
    numba = None  # type: ignore[assignment]
    AVAILABLE = False
    prange = range  # type: ignore[misc]


def one_float_dtype(arrays: tuple[Any, ...], is_backend_array: Callable[[Any], bool]) -> bool:
    """True when the arrays (``None`` skipped, at least one left) are all ``is_backend_array`` and of one dtype,
    float32 or float64: the condition every backend's kernels share (numba here, CuPy's in :mod:`.cupy_kernels`)."""
    dtype = None
    for a in arrays:
        if a is None:
            continue
        if not is_backend_array(a) or a.dtype not in (np.float32, np.float64):
            return False
        if dtype is None:
            dtype = a.dtype
        elif a.dtype != dtype:
            return False
    return dtype is not None


def usable(xp: Any, *arrays: Any) -> bool:
    """True when the kernels apply: numba imported, and every array is a float32/float64 NumPy array of one dtype."""
    return AVAILABLE and one_float_dtype(arrays, lambda a: type(a) is np.ndarray)


def selected(cfg: Any, xp: Any, *arrays: Any) -> bool:
    """Whether a step of ``cfg`` on ``arrays`` runs numba kernels: ``cfg.kernels`` is not ``"reference"`` and
    :func:`usable` holds (``None`` entries skipped)."""
    return getattr(cfg, "kernels", "auto") != "reference" and usable(xp, *arrays)


def alike(*arrays: np.ndarray) -> bool:
    """Same shape and strides, and contiguous: entry ``k`` of every ``ravel(order="K")`` view is the same ``(i, j)``."""
    first = arrays[0]
    if not (first.flags.c_contiguous or first.flags.f_contiguous):
        return False
    return all(a.shape == first.shape and a.strides == first.strides for a in arrays[1:])


def flat(a: np.ndarray) -> np.ndarray:
    """The 1-D view of a contiguous array in memory order (no copy)."""
    return a.ravel(order="K")


def pool_does_not_spin() -> bool:
    """Whether numba's thread pool is the ``workqueue`` layer (idle threads sleep, so they never compete with
    OpenBLAS's): the condition for the functional route's parallel kernels."""
    config: Any = numba.config if numba is not None else None
    return config is not None and str(config.THREADING_LAYER) == "workqueue"


def _jit(fn: Any, parallel: bool = False) -> Any:
    if numba is None:  # pragma: no cover
        return fn
    return numba.njit(cache=True, nogil=True, parallel=parallel, fastmath=False, error_model="numpy")(fn)


def _inline(fn: Any) -> Any:
    """A helper compiled into its callers (numba IR inlining), so the loops that call it still vectorise."""
    if numba is None:  # pragma: no cover
        return fn
    return numba.njit(inline="always", error_model="numpy")(fn)


@_inline
def ema_entry(m0, x, b1, c1):  # type: ignore[no-untyped-def]
    """``m = b1 m0 + c1 x``: one entry of ``M_t = EMA_b1[G~]``."""
    return b1 * m0 + c1 * x


@_inline
def delta_entry(u, w, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """One entry of ``delta = (-eta) (U + lambda W)``; ``U + lambda W`` only when ``decay``: the reference adds
    nothing when lambda = 0, so neither do the kernels, and a signed zero stays what the reference makes of it.

    The one place the kernels write the update's last step (every unrotated and rotated delta kernel)."""
    if decay:
        u = u + wd * w
    return neg_lr * u


# ----------------------------------------------------------------------------- input checks


@_jit
def _any_nonfinite_flat(x):  # type: ignore[no-untyped-def]
    """``any(~isfinite(x))`` over a 1-D array in one read-only pass, as four interleaved streams (its quarters)
    and the remainder.  One core reads one stream at about half the rate it reads four (the hardware prefetchers
    keep more lines in flight): over 21 M float32 entries, 2.9 ms against 5.9 ms for the one-stream count
    (``benchmarks/nonfinite_scan.py``)."""
    q = x.size // 4
    a, b, c, d = x[:q], x[q : 2 * q], x[2 * q : 3 * q], x[3 * q : 4 * q]
    bad = False
    for i in range(q):
        bad |= not (np.isfinite(a[i]) & np.isfinite(b[i]) & np.isfinite(c[i]) & np.isfinite(d[i]))
    for i in range(4 * q, x.size):
        bad |= not np.isfinite(x[i])
    return bad


@_jit
def _nonfinite_count_flat(x):  # type: ignore[no-untyped-def]
    """``sum(~isfinite(x))`` over a 1-D array, read-only and without a temporary: :func:`_any_nonfinite_flat`'s
    fast scan, then, only when it finds one, a second pass that counts."""
    if not _any_nonfinite_flat(x):
        return 0
    bad = 0
    for i in range(x.size):
        bad += not np.isfinite(x[i])
    return bad


def nonfinite_count(a: Any) -> int | None:
    """The number of NaN or Inf entries of a contiguous float32/float64 NumPy array, or ``None`` when the kernel
    does not apply (numba missing, another type or dtype, a strided view).

    The generic ``all(isfinite(G))`` writes a boolean array of ``G``'s size on every call and reads it back; on
    a step's input check that allocation (fresh pages, freed again) cost more than the scan itself (measured:
    replay on 512 x 1376 float32 spent 19 ms of ~420 in 30 checks, and 56 ms in total with their side effects).
    """
    if not usable(np, a) or not (a.flags.c_contiguous or a.flags.f_contiguous):
        return None
    return int(_nonfinite_count_flat(a.ravel(order="K")))


# ----------------------------------------------------------------------------- scalars and layout


def is_host_number(x: Any) -> bool:
    """Whether ``x`` is a Python ``int`` or ``float`` (not a ``bool``, not an array): a learning rate the kernels
    take as a scalar argument; an array one (a schedule's tensor) keeps the array code."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def scalar(x: Any, dtype: Any) -> Any:
    """``x`` rounded to ``dtype`` as a NumPy scalar: how the generic code's weak Python scalars enter its arithmetic."""
    return np.asarray(x, dtype=dtype)[()]


def ema_coefficients(b1_t: Any, b2_t: Any, dtype: Any) -> tuple[Any, Any, Any, Any]:
    """``(b1, 1 - b1, b2, 1 - b2)`` as ``dtype`` scalars, ``1 - b`` rounded in ``dtype`` as the reference EMA
    ``b * old + (1 - b) * new`` computes it: the coefficients of every two-moment kernel."""
    b1, b2 = np.asarray(b1_t, dtype=dtype), np.asarray(b2_t, dtype=dtype)
    return b1[()], scalar(1.0 - b1, dtype), b2[()], scalar(1.0 - b2, dtype)


def rows_in_memory_order(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The matrices as views whose rows are contiguous: every one transposed when all are Fortran-ordered (the
    work frame of a tall parameter, :func:`~adadiag_ref.optim.layout.to_work`), otherwise as given.

    The row kernels (:func:`adam_moments_inplace`) walk ``j`` innermost; over Fortran-ordered matrices that
    walk strides by a column's length and does not vectorise (measured on 512 x 1376 float32: 29 ms against
    1.1 ms; 0.73 s against 39 ms on 32000 x 512).  Each entry ``(i, j)`` of their outputs depends on entry
    ``(i, j)`` of their inputs only, so transposing every operand changes the walk and nothing else.
    """
    if all(_fortran(a) for a in arrays):
        return tuple(a.T for a in arrays)
    return arrays


def _fortran(a: np.ndarray) -> bool:
    """A Fortran-ordered matrix that is not also C-ordered (a row kernel would walk it against memory)."""
    return a.ndim == 2 and a.flags.f_contiguous and not a.flags.c_contiguous


# ----------------------------------------------------------------------------- the update's tail, in place


def _scale_direction_flat(D, w, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """In place on a fresh unrotated direction ``D = P U~ Q^T``: ``D <- (-eta) (D + lambda W)``."""
    for k in prange(D.shape[0]):
        D[k] = delta_entry(D[k], w[k], neg_lr, wd, decay)


def _apply_direction_flat(W, D, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """In place on flat views: ``W <- W + (-eta) (D + lambda W)`` for an unrotated direction ``D = P U~ Q^T``
    (``W += delta`` of :func:`_scale_direction_flat`'s ``delta``, without writing ``D``)."""
    for k in range(W.shape[0]):
        w = W[k]
        W[k] = w + delta_entry(D[k], w, neg_lr, wd, decay)


def _renamed(fn: Any, suffix: str) -> Any:
    """A copy of ``fn`` (same code, globals and closure) whose ``__qualname__`` ends in ``suffix``.

    numba's on-disk cache names its files after the function's qualified name and keys its index by the type
    signature only, not by the compile options (numba issue 6845): a serial and a parallel compile of one
    function share one cache entry, so whichever was compiled first is loaded for both.  Measured here: the
    serial AdamW kernel loaded as the parallel compile took 11 ms per call on 64 entries (a thread-pool launch)
    against 1.3 us compiled serially, which made the functional path spend ~0.8 s per LLaMA-60M step in
    launches.  Distinct names give each variant its own cache entry.
    """
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    clone.__qualname__ = fn.__qualname__ + suffix
    clone.__doc__, clone.__module__ = fn.__doc__, fn.__module__
    return clone


def _serial_and_parallel(fn: Any) -> tuple[Any, Any]:
    """``fn`` compiled twice, serial and parallel (``prange`` on numba's pool), each with its own cache entry."""
    return _jit(fn), _jit(_renamed(fn, "_parallel"), parallel=True)


scale_direction_flat, scale_direction_flat_parallel = _serial_and_parallel(_scale_direction_flat)
# serial only: the torch adapter's group kernels cut their rows over threads of their own (adam/torch_route.py)
apply_direction_flat = _jit(_apply_direction_flat)


# ----------------------------------------------------------------------------- canonical SVD (fast refresh route)


@_jit
def _project_out(src, v, w, out, norms):  # type: ignore[no-untyped-def]
    """``out = src - v w^T`` and ``norms[j] = sum_i out_ij^2`` in one pass (rows in order, as NumPy's axis-0 sum)."""
    m, n = src.shape
    for j in range(n):
        r = src[0, j] - v[0] * w[j]
        out[0, j] = r
        norms[j] = r * r
    for i in range(1, m):
        vi = v[i]
        for j in range(n):
            r = src[i, j] - vi * w[j]
            out[i, j] = r
            norms[j] += r * r


def pivoted_gram_schmidt(X: np.ndarray, count: int, against: np.ndarray | None, rtol: float) -> np.ndarray:
    """Same vectors as ``adadiag_ref.linalg._pivoted_gram_schmidt`` (NumPy, float32/float64), without its temporaries.

    The reference builds a new residual ``R - v (v^T R)`` and a new ``R * R`` every
    step and re-stacks the chosen vectors; here the residual is updated in place
    by one fused pass that also accumulates the column norms (row by row, the
    order of NumPy's ``sum(axis=0)``), and the chosen vectors live in one
    preallocated ``d x count`` array.  Every other operation (pivot choice,
    normalisations, BLAS products) is the reference's own NumPy expression, so
    the pivots and the vectors agree with the reference to rounding (tested to
    1e-12 in float64 in ``tests/test_fast_refresh.py``; bit for bit in practice).
    """
    d, ncols = X.shape
    dt = X.dtype
    chosen = np.empty((d, count), dtype=dt)
    if count == 0:
        return chosen
    norms = np.sum(X * X, axis=0)
    factor = np.asarray(1.0 - rtol, dtype=dt)
    residual: np.ndarray | None = None
    for k in range(count):
        source = X if residual is None else residual
        vmax = np.max(norms)
        p = int(np.argmax((norms >= vmax * factor).astype(np.int32)))
        v = source[:, p]
        v = v / np.sqrt(np.sum(v * v))
        blocks = ([against] if against is not None else []) + ([chosen[:, :k]] if k else [])
        for B in blocks:  # second pass of Gram-Schmidt: "twice is enough"
            v = v - B @ (B.T @ v)
        v = v / np.sqrt(np.sum(v * v))
        chosen[:, k] = v
        if k + 1 == count:
            break
        w = v @ source
        if residual is None:
            residual = np.empty((d, ncols), dtype=dt)
        _project_out(source, v, w, residual, norms)
    return chosen


@_jit
def _pivoted_cholesky_lower(A, count, rtol, perm, column):  # type: ignore[no-untyped-def]
    """``count`` steps of pivoted Cholesky of the symmetric ``A`` (lower triangle, C order) in place.

    Step k: among the trailing positions ``q >= k`` whose diagonal ``A_qq`` lies within ``rtol`` of the
    largest, the one of lowest original index ``perm[q]`` is swapped to position k (rows and columns of
    the lower triangle, and the rows of the columns already computed, as LAPACK's ``xPSTF2``), then
    ``L_kk = sqrt(A_kk)``, ``L_ik = A_ik / L_kk`` and the trailing block ``A_ij -= L_ik L_jk`` (``i >= j > k``).
    Returns the number of steps done: fewer than ``count`` when the largest trailing diagonal is not
    positive (nothing left to choose).  Inner loops run over slices from index 0, which numba vectorises
    (a loop starting at a variable index keeps its wraparound checks and runs scalar, ~10x slower).
    """
    m = A.shape[0]
    for i in range(m):
        perm[i] = i
    factor = 1.0 - rtol
    for k in range(count):
        vmax = A[k, k]
        for q in range(k + 1, m):
            if A[q, q] > vmax:
                vmax = A[q, q]
        if not vmax > 0.0:
            return k
        threshold = vmax * factor
        best = k
        lowest = m
        for q in range(k, m):
            if A[q, q] >= threshold and perm[q] < lowest:
                best = q
                lowest = perm[q]
        if best != k:
            q = best
            t = A[k, k]
            A[k, k] = A[q, q]
            A[q, q] = t
            for j in range(k):  # the rows of L computed so far
                t = A[k, j]
                A[k, j] = A[q, j]
                A[q, j] = t
            for j in range(k + 1, q):  # A[j, k] (below the diagonal in column k) <-> A[q, j] (row q)
                t = A[j, k]
                A[j, k] = A[q, j]
                A[q, j] = t
            for i in range(q + 1, m):  # columns k and q below row q
                t = A[i, k]
                A[i, k] = A[i, q]
                A[i, q] = t
            p = perm[k]
            perm[k] = perm[q]
            perm[q] = p
        pivot = math.sqrt(A[k, k])
        A[k, k] = pivot
        inverse = 1.0 / pivot
        for i in range(k + 1, m):
            value = A[i, k] * inverse
            A[i, k] = value
            column[i] = value
        tail = column[k + 1 :]
        for i in range(k + 1, m):
            li = column[i]
            row = A[i, k + 1 : i + 1]
            for j in range(i - k):
                row[j] -= li * tail[j]
    return count


def pivoted_cholesky_columns(A: np.ndarray, count: int, rtol: float) -> np.ndarray | None:
    """The first ``count`` columns ``L`` of the pivoted Cholesky factorisation of a projector ``A`` (``m x m``).

    For an orthogonal projector ``A = W W^T`` (``W``: orthonormal columns) the
    diagonal ``A_jj`` is the squared norm of the projection of ``e_j`` onto
    ``span(W)``, and after k steps the Schur complement is the projector onto the
    part of ``span(W)`` orthogonal to the columns already chosen.  Column k of
    ``L`` is therefore ``A_k e_p / sqrt((A_k)_pp)``: the normalised projection of
    the pivot ``e_p``, i.e. the vector that pivoted Gram-Schmidt over the
    projections of ``e_1 .. e_m`` chooses at step k with the same pivot rule
    (``adadiag_ref.linalg``: lowest index within ``rtol`` of the largest).  Rows
    come back in their original order.  Works in ``A``'s dtype; ``A`` is not
    modified.  Returns ``None`` when fewer than ``count`` positive pivots exist
    (the caller takes the Gram-Schmidt loop).
    """
    m = A.shape[0]
    if A.shape != (m, m) or not 0 <= count <= m:
        raise ValueError(f"need a square matrix and 0 <= count <= {m}, got shape {A.shape} and count {count}")
    work = np.array(A, order="C", copy=True)
    perm = np.empty(m, dtype=np.int64)
    done = _pivoted_cholesky_lower(work, count, float(rtol), perm, np.empty(m, dtype=work.dtype))
    if done < count:
        return None
    columns = np.empty((m, count), dtype=work.dtype)
    _unpermute_lower(work, perm, columns)
    return columns


@_jit
def _unpermute_lower(A, perm, out):  # type: ignore[no-untyped-def]
    """``out[perm[i], k] = A[i, k]`` on and below the diagonal, ``0`` above (the factor's rows in original order)."""
    m, count = out.shape
    for i in range(m):
        row = out[perm[i]]
        for k in range(count):
            row[k] = A[i, k] if k <= i else 0.0
