r"""The Hfac family's CuPy route (CUDA, float32/float64): factored first and second moments.

The same formulas, in the same order, as :mod:`.reference` (Algorithm HfacDiag on the rotated gradient ``G~``,
``m x n``, ``b1``, ``b2`` the step's beta-hats)::

    u_t = b1 u_{t-1} + (1 - b1) G~ 1_n / n,   v_t = b1 v_{t-1} + (1 - b1) G~^T 1_m / m
    r_t, s_t and U = G~ / sqrt(V_t) as in Adafactor
    phi = b1 (u_t - G~ 1_n / n) / sqrt(r_t / n),   psi = b1 (v_t - G~^T 1_m / m) / sqrt(s_t / m)
    U~  = 0.5 (phi 1_n^T + 1_m psi^T) + U / max(1, RMS(U) / d)

The factored second moment and the normalisation are the Adafactor route's kernels
(:mod:`adadiag_ref.optim.families.adafactor.cupy_route`); the row and column means are ``cupy.mean`` and the
vector pieces (``phi``, ``psi``, the clip's divisor) the reference's own CuPy expressions; one more kernel
combines ``0.5 (phi_i + psi_j) + U_ij / divisor`` over ``U`` in place.  Agrees with the reference to rounding.

Applies when ``cfg.kernels == "auto"`` and the arrays are CuPy float32/float64 of one dtype; ``None`` otherwise.
"""

from __future__ import annotations

from typing import Any

from ...._kernels import cupy_kernels as ck
from ...._xp import Array, Namespace
from ....config import BaseConfig, HfacConfig
from ...schedules import beta_hats
from ..adafactor.cupy_route import ema, factored, normalised_rms
from ..common import Moments

__all__ = ["direction"]


def _combine_kernel(clip: bool) -> Any:
    """``U <- 0.5 (phi_i + psi_j) + U / divisor`` in place (``U`` itself without a clip)."""
    if clip:
        return ck.elementwise(
            "adadiag_hfac_combine_clip", "T phi, T psi, T d", "T u", "u = (T)0.5 * (phi + psi) + u / d;"
        )
    return ck.elementwise("adadiag_hfac_combine", "T phi, T psi", "T u", "u = (T)0.5 * (phi + psi) + u;")


def direction(state: Any, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments] | None:
    """``(U~, {"u", "v", "r", "s"})`` of the reference direction by the kernels above; ``None`` unless the CuPy
    kernels are selected (``cfg.kernels == "auto"``, CuPy float32/float64 arrays of one dtype)."""
    assert isinstance(cfg, HfacConfig)
    if not ck.selected(cfg, xp, g, state.u, state.v, state.r, state.s):
        return None
    dtype = g.dtype
    m, n = g.shape
    b1_t, b2_t = beta_hats(cfg, t, xp)
    b1, b2, eps = ck.ema_coefficients(b1_t, dtype), ck.ema_coefficients(b2_t, dtype), ck.coefficient(cfg.eps, dtype)
    if b1 is None or b2 is None or eps is None:
        return None
    row_mean = xp.mean(g, axis=1)
    col_mean = xp.mean(g, axis=0)
    u, v = ema(state.u, row_mean, b1), ema(state.v, col_mean, b1)
    r, s = factored(state.r, state.s, g, eps, b2, xp)
    phi = b1_t * (u - row_mean) / xp.sqrt(r / n)
    psi = b1_t * (v - col_mean) / xp.sqrt(s / m)
    U, divisor = normalised_rms(g, r, s, cfg.clip_threshold, xp)
    if divisor is None:
        _combine_kernel(False)(phi[:, None], psi[None, :], U)
    else:
        _combine_kernel(True)(phi[:, None], psi[None, :], divisor, U)
    return U, {"u": u, "v": v, "r": r, "s": s}
