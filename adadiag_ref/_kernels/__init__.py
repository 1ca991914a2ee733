"""Optional numba fast paths for the NumPy backend (the reference stays the generic code).

Two layers live here:

* **Functional kernels** (:func:`adam_direction`, :func:`adafactor_direction`,
  :func:`hfac_direction`).  They compute exactly what the generic family
  ``direction`` functions compute (``adadiag_ref.optim.families``) in one or two
  fused passes, writing into freshly allocated outputs (the core is functional,
  so inputs are never mutated).  :mod:`adadiag_ref.optim.dispatch` calls them
  for NumPy arrays when the config's ``kernels`` option allows it (``"auto"``
  with numba installed, or ``"numba"``).  They agree with the generic path to
  rounding (tested at ``rtol = 1e-12`` in float64): the same formulas in the
  same order; only the positive sums ``sum(G~^2 + eps)`` and ``sum(U^2)`` are
  accumulated sequentially instead of pairwise.
* **In-place kernels** (``*_inplace``, ``*_flat``) used by the benchmark's in-place
  "engine" (``adadiag_ref.perf.engine``), the fast embedding path, by ``replay``
  (which owns its state, ``optim.fused.adam_step_owned``), and by
  ``update_in_place`` on CPU torch tensors (the torch adapter, on NumPy views of
  the tensors; there ``sqrt(V_t)`` comes from ``torch.sqrt`` between two passes,
  ``*_root_flat``): they mutate preallocated moment buffers and write the
  direction into a preallocated output, so a whole step moves each array once.

This module only computes; it never decides.  Which path runs is chosen by
configuration (``make_config(..., kernels=...)``), never by the environment.

Thread policy: the callers choose.  A flat kernel that some caller runs on
numba's pool exists twice, serial and ``*_parallel`` (separate compiles and
cache entries, :func:`_serial_and_parallel`).  The functional route and
``replay`` use the parallel forms for arrays of 2^18 entries or more, and only
under numba's non-spinning ``workqueue`` layer (``optim/fused.py``); the
engine between its GEMM phases; the torch CPU route never (torch's OpenMP
threads spin after each parallel region).  BLAS owns the cores during GEMMs
(docs/performance.md, "Threads").
"""

from __future__ import annotations

import math
import types
from typing import Any

import numpy as np

__all__ = [
    "AVAILABLE",
    "adafactor_direction",
    "adam_direction",
    "adamw_inplace",
    "hfac_direction",
    "nonfinite_count",
    "pivoted_cholesky_columns",
    "pivoted_gram_schmidt",
    "usable",
]

try:  # numba is optional
    import numba

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only without numba
    numba = None  # type: ignore[assignment]
    AVAILABLE = False


def usable(xp: Any, *arrays: Any) -> bool:
    """True when the kernels apply: numba imported, and every array is a float32/float64 NumPy array of one dtype."""
    if not AVAILABLE:
        return False
    dtype = None
    for a in arrays:
        if a is None:
            continue
        if type(a) is not np.ndarray or a.dtype not in (np.float32, np.float64):
            return False
        if dtype is None:
            dtype = a.dtype
        elif a.dtype != dtype:
            return False
    return dtype is not None


def pool_does_not_spin() -> bool:
    """Whether numba's thread pool is the ``workqueue`` layer (idle threads sleep, so they never compete with
    OpenBLAS's): the condition for the functional route's parallel kernels."""
    config: Any = numba.config if numba is not None else None
    return config is not None and str(config.THREADING_LAYER) == "workqueue"


def _jit(fn: Any) -> Any:
    if numba is None:  # pragma: no cover
        return fn
    return numba.njit(cache=True, nogil=True, parallel=False, fastmath=False, error_model="numpy")(fn)


def _inline(fn: Any) -> Any:
    """A helper compiled into its callers (numba IR inlining), so the loops that call it still vectorise."""
    if numba is None:  # pragma: no cover
        return fn
    return numba.njit(inline="always", error_model="numpy")(fn)


@_inline
def _first_moment_entry(m0, x, b1, c1):  # type: ignore[no-untyped-def]
    """``m = b1 m0 + c1 x``: one entry of ``M_t = EMA_b1[G~]``."""
    return b1 * m0 + c1 * x


@_inline
def _second_moment_entry(v0, x, b2, c2):  # type: ignore[no-untyped-def]
    """``v = b2 v0 + c2 x^2``: one entry of ``V_t = EMA_b2[G~^2]``."""
    return b2 * v0 + c2 * (x * x)


@_inline
def _adam_entry(m0, v0, x, b1, c1, b2, c2, eps):  # type: ignore[no-untyped-def]
    """One entry of the Adam direction: ``m = b1 m0 + c1 x``, ``v = b2 v0 + c2 x^2``, ``u = m / (sqrt(v) + eps)``.

    The one place the kernels write the formula (same operations, same order as the family function); the
    moments come from the two helpers above, which the torch route's block kernels share."""
    m = _first_moment_entry(m0, x, b1, c1)
    v = _second_moment_entry(v0, x, b2, c2)
    return m, v, m / (math.sqrt(v) + eps)


@_inline
def _delta_entry(u, w, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """One entry of ``delta = (-eta) (U + lambda W)``; ``U + lambda W`` only when ``decay``: the reference adds
    nothing when lambda = 0, so neither do the kernels, and a signed zero stays what the reference makes of it.

    The one place the kernels write the update's last step (every unrotated and rotated delta kernel)."""
    if decay:
        u = u + wd * w
    return neg_lr * u


# ----------------------------------------------------------------------------- input checks


@_jit
def _nonfinite_count_flat(x):  # type: ignore[no-untyped-def]
    """``sum(~isfinite(x))`` over a 1-D array in one read-only pass (vectorised, no temporary)."""
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


# ----------------------------------------------------------------------------- functional kernels


def scalar(x: Any, dtype: Any) -> Any:
    """``x`` rounded to ``dtype`` as a NumPy scalar: how the generic code's weak Python scalars enter its arithmetic."""
    return np.asarray(x, dtype=dtype)[()]


def adam_coefficients(b1_t: Any, b2_t: Any, dtype: Any) -> tuple[Any, Any, Any, Any]:
    """``(b1, 1 - b1, b2, 1 - b2)`` as ``dtype`` scalars, ``1 - b`` rounded in ``dtype`` as the generic EMA
    ``b * old + (1 - b) * new`` computes it: the coefficients every Adam kernel takes."""
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


def adam_direction(M0: np.ndarray, V0: np.ndarray, g: np.ndarray, b1_t: Any, b2_t: Any, eps: float) -> tuple:
    """``M = b1 M0 + (1 - b1) G~``, ``V = b2 V0 + (1 - b2) G~^2``, ``U = M / (sqrt(V) + eps)`` in one pass.

    The outputs keep ``G~``'s memory order (like the state, which keeps the parameter's)."""
    dt = g.dtype
    M, V, U = np.empty_like(g), np.empty_like(g), np.empty_like(g)
    M0, V0, g_rows, M_rows, V_rows, U_rows = rows_in_memory_order(M0, V0, g, M, V, U)
    adam_moments_inplace(M0, V0, g_rows, *adam_coefficients(b1_t, b2_t, dt), scalar(eps, dt), M_rows, V_rows, U_rows)
    return M, V, U


@_jit
def _square_sums(g, eps, rows, cols):  # type: ignore[no-untyped-def]
    """rows[i] = sum_j (g_ij^2 + eps), cols[j] = sum_i (g_ij^2 + eps), accumulated in float64."""
    m, n = g.shape
    acc_c = np.zeros(n, dtype=np.float64)
    for i in range(m):
        acc = 0.0
        for j in range(n):
            x = g[i, j]
            sq = x * x + eps
            acc += sq
            acc_c[j] += sq
        rows[i] = acc
    for j in range(n):
        cols[j] = acc_c[j]


@_jit
def _normalise(g, sqrt_total, sqrt_r, sqrt_s, U):  # type: ignore[no-untyped-def]
    """U = G~ sqrt(1^T r) / (sqrt(r) sqrt(s)^T) (= G~ / sqrt(V), factored form); returns sum(U^2) in float64."""
    m, n = g.shape
    acc = 0.0
    for i in range(m):
        sri = sqrt_r[i]
        for j in range(n):
            u = g[i, j] * sqrt_total / (sri * sqrt_s[j])
            U[i, j] = u
            acc += float(u) * float(u)
    return acc


@_jit
def _clip_momentum(U, divisor, M0, b1, c1, M):  # type: ignore[no-untyped-def]
    m, n = U.shape
    for i in range(m):
        for j in range(n):
            M[i, j] = b1 * M0[i, j] + c1 * (U[i, j] / divisor)


@_jit
def _clip(U, divisor):  # type: ignore[no-untyped-def]
    m, n = U.shape
    for i in range(m):
        for j in range(n):
            U[i, j] = U[i, j] / divisor


@_jit
def _hfac_combine(U, divisor, phi, psi):  # type: ignore[no-untyped-def]
    m, n = U.shape
    for i in range(m):
        for j in range(n):
            U[i, j] = 0.5 * (phi[i] + psi[j]) + U[i, j] / divisor


def _ema(beta_t: Any, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    return beta_t * old + (1.0 - beta_t) * new  # type: ignore[no-any-return]


def _factored(r0: np.ndarray, s0: np.ndarray, g: np.ndarray, eps: float, beta2_t: Any) -> tuple:
    dt = g.dtype
    m, n = g.shape
    rows = np.empty(m, dtype=dt)
    cols = np.empty(n, dtype=dt)
    if _fortran(g):  # the rows of G~^T are G~'s columns: the same sums, each accumulated in the same order
        _square_sums(g.T, scalar(eps, dt), cols, rows)
    else:
        _square_sums(g, scalar(eps, dt), rows, cols)
    r = _ema(beta2_t, r0, rows)
    s = _ema(beta2_t, s0, cols)
    return r, s


def _normalised(g: np.ndarray, r: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, float]:
    """``(U, sum(U^2))`` of :func:`_normalise`, ``U`` in ``G~``'s memory order and walked in it (entry ``(i, j)``
    is the same expression either way, since ``sqrt(r_i) sqrt(s_j)`` is a commutative product; only the float64
    total's summation order follows memory)."""
    sqrt_total = scalar(np.sqrt(np.sum(r)), g.dtype)
    U = np.empty_like(g)
    if _fortran(g):
        return U, _normalise(g.T, sqrt_total, np.sqrt(s), np.sqrt(r), U.T)
    return U, _normalise(g, sqrt_total, np.sqrt(r), np.sqrt(s), U)


def _clip_divisor(sum_sq: float, size: int, threshold: float | None, dt: Any) -> Any:
    if threshold is None:
        return None
    rms = np.sqrt(np.asarray(sum_sq / size, dtype=dt))
    ratio = rms / threshold
    return scalar(np.maximum(ratio, np.ones_like(ratio)), dt)


def adafactor_direction(
    r0: np.ndarray,
    s0: np.ndarray,
    M0: np.ndarray | None,
    g: np.ndarray,
    eps: float,
    beta2_t: Any,
    b1_t: Any,
    clip_threshold: float | None,
) -> tuple:
    """Adafactor/AdafacDiag direction: factored ``V``, ``U = clip(G~ / sqrt(V))``, optional momentum.

    Returns ``(U, M, r, s)`` (``M`` is ``None`` without momentum; then ``U`` is the clipped direction).
    """
    dt = g.dtype
    r, s = _factored(r0, s0, g, eps, beta2_t)
    U, sum_sq = _normalised(g, r, s)
    divisor = _clip_divisor(sum_sq, g.size, clip_threshold, dt)
    if M0 is None:
        if divisor is not None:
            _clip(*rows_in_memory_order(U), divisor)
        return U, None, r, s
    b1 = scalar(b1_t, dt)
    c1 = scalar(1.0 - np.asarray(b1_t, dtype=dt), dt)
    M = np.empty_like(g)
    U_rows, M0_rows, M_rows = rows_in_memory_order(U, M0, M)
    _clip_momentum(U_rows, divisor if divisor is not None else scalar(1.0, dt), M0_rows, b1, c1, M_rows)
    return M, M, r, s


def hfac_direction(
    u0: np.ndarray,
    v0: np.ndarray,
    r0: np.ndarray,
    s0: np.ndarray,
    g: np.ndarray,
    eps: float,
    b1_t: Any,
    b2_t: Any,
    clip_threshold: float | None,
) -> tuple:
    """Hfac/HfacDiag direction (see ``families._hfac_direction``); returns ``(U, u, v, r, s)``."""
    dt = g.dtype
    m, n = g.shape
    row_mean = np.mean(g, axis=1)
    col_mean = np.mean(g, axis=0)
    u = _ema(b1_t, u0, row_mean)
    v = _ema(b1_t, v0, col_mean)
    r, s = _factored(r0, s0, g, eps, b2_t)
    phi = b1_t * (u - row_mean) / np.sqrt(r / n)
    psi = b1_t * (v - col_mean) / np.sqrt(s / m)
    U, sum_sq = _normalised(g, r, s)
    divisor = _clip_divisor(sum_sq, g.size, clip_threshold, dt)
    if divisor is None:
        divisor = scalar(1.0, dt)
    if _fortran(U):  # entry (i, j) is 0.5 (phi_i + psi_j) + U_ij / divisor either way (addition commutes)
        _hfac_combine(U.T, divisor, psi.astype(dt), phi.astype(dt))
    else:
        _hfac_combine(U, divisor, phi.astype(dt), psi.astype(dt))
    return U, u, v, r, s


# ----------------------------------------------------------------------------- in-place kernels (engine)


def _adam_moments_rows(M0, V0, g, b1, c1, b2, c2, eps, M, V, out):  # type: ignore[no-untyped-def]
    """``M = b1 M0 + c1 G~``, ``V = b2 V0 + c2 G~^2``, ``out = M / (sqrt(V) + eps)`` in one pass.

    Every entry is read before it is written, so ``M`` may alias ``M0``, ``V`` alias
    ``V0`` (in place) and ``out`` alias ``g``.
    """
    m, n = g.shape
    for i in numba.prange(m):
        for j in range(n):
            M[i, j], V[i, j], out[i, j] = _adam_entry(M0[i, j], V0[i, j], g[i, j], b1, c1, b2, c2, eps)


def _apply_update_flat(W, D, lr, wd):  # type: ignore[no-untyped-def]
    """In place: ``W -= lr (D + wd W)`` (flat 1-D views)."""
    for k in numba.prange(W.shape[0]):
        w = W[k]
        W[k] = w - lr * (D[k] + wd * w)


def _adamw_flat(W, g, M, V, b1, c1, b2, c2, eps, lr, wd):  # type: ignore[no-untyped-def]
    for k in numba.prange(W.shape[0]):
        w = W[k]
        M[k], V[k], u = _adam_entry(M[k], V[k], g[k], b1, c1, b2, c2, eps)
        W[k] = w - lr * (u + wd * w)


def _adam_moments_over_flat(M0, V0, GU, b1, c1, b2, c2, eps, M, V):  # type: ignore[no-untyped-def]
    """Flat views: ``M = b1 M0 + c1 G~``, ``V = b2 V0 + c2 G~^2`` into new arrays, and ``U = M / (sqrt(V) + eps)``
    over ``G~`` itself (``GU`` is read, then overwritten).

    One argument for ``G~`` and ``U``, not two aliased ones: with two pointers to the same memory LLVM's runtime
    overlap check fails and the loop runs unvectorised (several times slower)."""
    for k in numba.prange(GU.shape[0]):
        M[k], V[k], GU[k] = _adam_entry(M0[k], V0[k], GU[k], b1, c1, b2, c2, eps)


def _adam_moments_own_flat(M, V, GU, b1, c1, b2, c2, eps):  # type: ignore[no-untyped-def]
    """In place on flat views (the engine): ``M <- b1 M + c1 G~``, ``V <- b2 V + c2 G~^2``,
    ``GU <- M / (sqrt(V) + eps)``; each array is one argument (no aliased pointers, see above)."""
    for k in numba.prange(GU.shape[0]):
        M[k], V[k], GU[k] = _adam_entry(M[k], V[k], GU[k], b1, c1, b2, c2, eps)


def _adam_moments_own_counted_flat(M, V, GU, b1, c1, b2, c2, eps):  # type: ignore[no-untyped-def]
    """:func:`_adam_moments_own_flat` that also returns the number of NaN or Inf entries of ``G~`` it read.

    For ``replay``, whose gradient check then needs no pass of its own: a NaN or Inf anywhere in ``G`` makes at
    least one entry of ``G~ = P^T G Q`` non-finite (its column times a nonzero row of the orthogonal ``P``, and
    ``0 x Inf`` is NaN), so a count of zero proves ``G`` finite; a positive count sends the caller to the exact
    check of ``G`` (``G~`` may also overflow from a finite ``G``)."""
    bad = 0
    for k in numba.prange(GU.shape[0]):
        x = GU[k]
        bad += not np.isfinite(x)
        M[k], V[k], GU[k] = _adam_entry(M[k], V[k], x, b1, c1, b2, c2, eps)
    return bad


def _adam_delta_flat(M0, V0, g, w, b1, c1, b2, c2, eps, neg_lr, wd, decay, M, V, D):  # type: ignore[no-untyped-def]
    """The whole unrotated Adam update in one pass over flat views: ``M``, ``V`` and
    ``D = (-eta) (U + lambda W)`` (:func:`_delta_entry`)."""
    for k in numba.prange(g.shape[0]):
        M[k], V[k], u = _adam_entry(M0[k], V0[k], g[k], b1, c1, b2, c2, eps)
        D[k] = _delta_entry(u, w[k], neg_lr, wd, decay)


def _scale_direction_flat(D, w, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """In place on a fresh unrotated direction ``D = P U~ Q^T``: ``D <- (-eta) (D + lambda W)``."""
    for k in numba.prange(D.shape[0]):
        D[k] = _delta_entry(D[k], w[k], neg_lr, wd, decay)


def _adam_second_moment_flat(V0, g, b2, c2, V):  # type: ignore[no-untyped-def]
    """``V = b2 V0 + c2 G~^2`` on flat views (the torch CPU route: its ``sqrt`` is torch's own)."""
    for k in range(g.shape[0]):
        V[k] = _second_moment_entry(V0[k], g[k], b2, c2)


def _adam_apply_root_flat(W, g, M, V, v, root, b1, c1, eps, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """The unrotated Adam step in place on flat views, given ``v = V_t`` and ``root = sqrt(V_t)`` (computed by the
    caller's backend): ``M <- b1 M + c1 G``, ``V <- v``, ``W <- W + (-eta) (M / (root + eps) [+ lambda W])``."""
    for k in range(g.shape[0]):
        w = W[k]
        m = _first_moment_entry(M[k], g[k], b1, c1)
        M[k] = m
        V[k] = v[k]
        W[k] = w + _delta_entry(m / (root[k] + eps), w, neg_lr, wd, decay)


def _adam_direction_root_flat(M0, GU, MR, b1, c1, eps):  # type: ignore[no-untyped-def]
    """Flat views, given ``MR = sqrt(V_t)`` (computed by the caller's backend into the new ``M``'s memory):
    ``MR <- M_t = b1 M0 + c1 G~`` and ``U~ = M_t / (sqrt(V_t) + eps)`` over ``G~`` itself; each entry of ``GU``
    and ``MR`` is read before it is written, one argument per array (no aliased pointers)."""
    for k in range(GU.shape[0]):
        m = _first_moment_entry(M0[k], GU[k], b1, c1)
        GU[k] = m / (MR[k] + eps)
        MR[k] = m


def _apply_direction_flat(W, D, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """In place on flat views: ``W <- W + (-eta) (D + lambda W)`` for an unrotated direction ``D = P U~ Q^T``
    (``W += delta`` of :func:`_scale_direction_flat`'s ``delta``, without writing ``D``)."""
    for k in range(W.shape[0]):
        w = W[k]
        W[k] = w + _delta_entry(D[k], w, neg_lr, wd, decay)


def _apply_direction_into_flat(W, D, neg_lr, wd, decay, out):  # type: ignore[no-untyped-def]
    """On flat views: ``out = W + (-eta) (D + lambda W)`` for an unrotated direction ``D = P U~ Q^T`` (``W_{t+1}``
    written into a separate array; ``replay``'s trajectory).  ``out`` must not overlap ``W`` or ``D``."""
    for k in numba.prange(W.shape[0]):
        w = W[k]
        out[k] = w + _delta_entry(D[k], w, neg_lr, wd, decay)


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
    if numba is None:  # pragma: no cover
        return fn, fn
    return (
        numba.njit(cache=True, nogil=True, parallel=False, fastmath=False, error_model="numpy")(fn),
        numba.njit(cache=True, nogil=True, parallel=True, fastmath=False, error_model="numpy")(
            _renamed(fn, "_parallel")
        ),
    )


adamw_inplace, adamw_inplace_parallel = _serial_and_parallel(_adamw_flat)
adam_moments_inplace, adam_moments_inplace_parallel = _serial_and_parallel(_adam_moments_rows)
apply_update_inplace, apply_update_inplace_parallel = _serial_and_parallel(_apply_update_flat)
adam_moments_over_flat, adam_moments_over_flat_parallel = _serial_and_parallel(_adam_moments_over_flat)
adam_moments_own_flat, adam_moments_own_flat_parallel = _serial_and_parallel(_adam_moments_own_flat)
adam_moments_own_counted_flat, adam_moments_own_counted_flat_parallel = _serial_and_parallel(
    _adam_moments_own_counted_flat
)
adam_delta_flat, adam_delta_flat_parallel = _serial_and_parallel(_adam_delta_flat)
scale_direction_flat, scale_direction_flat_parallel = _serial_and_parallel(_scale_direction_flat)
apply_direction_into_flat, apply_direction_into_flat_parallel = _serial_and_parallel(_apply_direction_into_flat)
# the torch CPU route's passes are serial only: optim/inplace.py::_adam_torch_cpu says why
apply_direction_flat = _jit(_apply_direction_flat)
adam_second_moment_flat = _jit(_adam_second_moment_flat)
adam_apply_root_flat = _jit(_adam_apply_root_flat)
adam_direction_root_flat = _jit(_adam_direction_root_flat)


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
