"""The Adafactor family's numba route (NumPy, float32/float64): factored second moment, clip, momentum.

The same formulas, in the same order, as :mod:`.reference`, in two fused passes: the row and column sums of
``G~^2 + eps`` (accumulated sequentially in float64, where the reference sums pairwise: the results agree to
rounding, tested at ``rtol = 1e-12`` in float64, ``tests/test_kernels.py``), then ``U = G~ / sqrt(V_t)`` with
``sum(U^2)`` for the clip, then the clip with the momentum EMA.  The Hfac family's route
(:mod:`adadiag_ref.optim.families.hfac.numba_route`) shares the factored pieces.  A tall parameter's
Fortran-ordered work frame is walked in memory order (the per-entry expressions do not change).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .... import _kernels
from ...._kernels import _fortran, _jit, rows_in_memory_order, scalar
from ...._xp import Array, Namespace
from ....config import AdafactorConfig, BaseConfig
from ...schedules import first_moment_decay
from ..common import Moments, ema
from .reference import second_moment_decay

__all__ = ["adafactor_direction", "direction", "factored", "normalised_with_sum"]


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


def factored(r0: np.ndarray, s0: np.ndarray, g: np.ndarray, eps: float, beta2_t: Any) -> tuple:
    dt = g.dtype
    m, n = g.shape
    rows = np.empty(m, dtype=dt)
    cols = np.empty(n, dtype=dt)
    if _fortran(g):  # the rows of G~^T are G~'s columns: the same sums, each accumulated in the same order
        _square_sums(g.T, scalar(eps, dt), cols, rows)
    else:
        _square_sums(g, scalar(eps, dt), rows, cols)
    return ema(beta2_t, r0, rows), ema(beta2_t, s0, cols)


def normalised_with_sum(g: np.ndarray, r: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, float]:
    """``(U, sum(U^2))`` of :func:`_normalise`, ``U`` in ``G~``'s memory order and walked in it (entry ``(i, j)``
    is the same expression either way, since ``sqrt(r_i) sqrt(s_j)`` is a commutative product; only the float64
    total's summation order follows memory)."""
    sqrt_total = scalar(np.sqrt(np.sum(r)), g.dtype)
    U = np.empty_like(g)
    if _fortran(g):
        return U, _normalise(g.T, sqrt_total, np.sqrt(s), np.sqrt(r), U.T)
    return U, _normalise(g, sqrt_total, np.sqrt(r), np.sqrt(s), U)


def clip_divisor(sum_sq: float, size: int, threshold: float | None, dt: Any) -> Any:
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
    r, s = factored(r0, s0, g, eps, beta2_t)
    U, sum_sq = normalised_with_sum(g, r, s)
    divisor = clip_divisor(sum_sq, g.size, clip_threshold, dt)
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


def direction(state: Any, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments] | None:
    """``(U~, {"M", "r", "s"})`` of the reference direction by :func:`adafactor_direction`; ``None`` unless
    ``cfg.kernels`` selects numba and the arrays are NumPy float32/float64 of one dtype."""
    assert isinstance(cfg, AdafactorConfig)
    M0 = state.M if cfg.momentum else None
    if not _kernels.selected(cfg, xp, g, M0, state.r, state.s):
        return None
    b1_t = first_moment_decay(cfg, t, xp) if cfg.momentum else None
    beta2_t = second_moment_decay(cfg, t, xp)
    U, M, r, s = adafactor_direction(state.r, state.s, M0, g, cfg.eps, beta2_t, b1_t, cfg.clip_threshold)
    return U, {"M": M, "r": r, "s": s}
