"""The Hfac family's numba route (NumPy, float32/float64): factored first and second moments.

The same formulas, in the same order, as :mod:`.reference`; the factored second moment and the normalised
gradient are the Adafactor route's (:mod:`adadiag_ref.optim.families.adafactor.numba_route`), and one pass
combines ``0.5 (phi_i + psi_j) + U_ij / divisor``.  Agrees with the reference to rounding (the sums of
``G~^2 + eps`` and ``U^2`` accumulated sequentially; ``tests/test_kernels.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .... import _kernels
from ...._kernels import _fortran, _jit, scalar
from ...._xp import Array, Namespace
from ....config import BaseConfig, HfacConfig
from ...schedules import beta_hats
from ..adafactor.numba_route import clip_divisor, factored, normalised_with_sum
from ..common import Moments, ema

__all__ = ["direction", "hfac_direction"]


@_jit
def _hfac_combine(U, divisor, phi, psi):  # type: ignore[no-untyped-def]
    m, n = U.shape
    for i in range(m):
        for j in range(n):
            U[i, j] = 0.5 * (phi[i] + psi[j]) + U[i, j] / divisor


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
    """Hfac/HfacDiag direction (see :func:`.reference.direction`); returns ``(U, u, v, r, s)``."""
    dt = g.dtype
    m, n = g.shape
    row_mean = np.mean(g, axis=1)
    col_mean = np.mean(g, axis=0)
    u = ema(b1_t, u0, row_mean)
    v = ema(b1_t, v0, col_mean)
    r, s = factored(r0, s0, g, eps, b2_t)
    phi = b1_t * (u - row_mean) / np.sqrt(r / n)
    psi = b1_t * (v - col_mean) / np.sqrt(s / m)
    U, sum_sq = normalised_with_sum(g, r, s)
    divisor = clip_divisor(sum_sq, g.size, clip_threshold, dt)
    if divisor is None:
        divisor = scalar(1.0, dt)
    if _fortran(U):  # entry (i, j) is 0.5 (phi_i + psi_j) + U_ij / divisor either way (addition commutes)
        _hfac_combine(U.T, divisor, psi.astype(dt), phi.astype(dt))
    else:
        _hfac_combine(U, divisor, phi.astype(dt), psi.astype(dt))
    return U, u, v, r, s


def direction(state: Any, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments] | None:
    """``(U~, {"u", "v", "r", "s"})`` of the reference direction by :func:`hfac_direction`; ``None`` unless
    ``cfg.kernels`` selects numba and the arrays are NumPy float32/float64 of one dtype."""
    assert isinstance(cfg, HfacConfig)
    if not _kernels.selected(cfg, xp, g, state.u, state.v, state.r, state.s):
        return None
    b1_t, b2_t = beta_hats(cfg, t, xp)
    U, u, v, r, s = hfac_direction(state.u, state.v, state.r, state.s, g, cfg.eps, b1_t, b2_t, cfg.clip_threshold)
    return U, {"u": u, "v": v, "r": r, "s": s}
