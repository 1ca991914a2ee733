r"""The Adafactor family's CuPy route (CUDA, float32/float64): factored second moment, clip, momentum.

The same formulas, in the same order, as :mod:`.reference` (Algorithm AdafacDiag on the rotated gradient
``G~``, ``m x n``)::

    rho = (G~^2 + eps) 1_n,   sigma = (G~^2 + eps)^T 1_m
    r_t = b2 r_{t-1} + (1 - b2) rho,   s_t = b2 s_{t-1} + (1 - b2) sigma
    U   = G~ sqrt(1_m^T r_t) / (sqrt(r_t) sqrt(s_t)^T)        (= G~ / sqrt(V_t), V_t = r_t s_t^T / 1_m^T r_t)
    U~  = U / max(1, RMS(U) / d);   with momentum M_t = b1 M_{t-1} + (1 - b1) U~ and U~ = M_t

The entrywise ``m x n`` passes are ``cupy.ElementwiseKernel``\ s (:mod:`adadiag_ref._kernels.cupy_kernels`:
``G~^2 + eps``; the normalisation; the clip, fused with the momentum EMA); the row and column sums are
``cupy.sum`` over the same ``G~^2 + eps`` the reference sums (so the same values), ``RMS(U)`` a summation kernel
without the ``U * U`` temporary (agrees to rounding), and the vector pieces (``sqrt(1^T r) / sqrt(s)``,
``sqrt(r)``, the clip's divisor) are the reference's own CuPy expressions.  Five ``m x n`` kernels instead of
about a dozen; the divisor stays on the device (no read-back).

Applies when ``cfg.kernels == "auto"`` and the arrays are CuPy float32/float64 of one dtype; ``None`` otherwise.
"""

from __future__ import annotations

from typing import Any

from ...._kernels import cupy_kernels as ck
from ...._xp import Array, Namespace
from ....config import AdafactorConfig, BaseConfig
from ...schedules import first_moment_decay
from ..common import Moments
from .reference import second_moment_decay

__all__ = ["direction", "ema", "factored", "normalised_rms"]


def _square_plus_eps_kernel() -> Any:
    """``G~ -> G~^2 + eps``."""
    return ck.elementwise("adadiag_square_plus_eps", "T x, T eps", "T y", "y = x * x + eps;")


def _ema_kernel() -> Any:
    """``(old, new) -> b old + c new`` (the reference EMA ``beta_t old + (1 - beta_t) new``)."""
    return ck.elementwise("adadiag_ema", "T old, T x, T b, T c", "T y", "y = b * old + c * x;")


def ema(old: Array, new: Array, coefficients: tuple[Any, Any]) -> Array:
    """``b old + c new`` in one kernel (a new array), ``coefficients = (b, c)`` from
    :func:`~adadiag_ref._kernels.cupy_kernels.ema_coefficients`: the reference's ``beta_t old + (1 - beta_t) new``."""
    import cupy

    return _ema_kernel()(old, new, *coefficients, cupy.empty_like(old))


def _normalise_kernel() -> Any:
    """``U_ij = G~_ij a_j / q_i`` with ``a = sqrt(1^T r) / sqrt(s)`` and ``q = sqrt(r)`` (broadcast vectors), the
    reference's ``g * a[None, :] / q[:, None]`` in its order."""
    return ck.elementwise("adadiag_factored_normalise", "T x, T a, T q", "T u", "u = x * a / q;")


def _clip_kernel() -> Any:
    """``U <- U / divisor`` in place (``divisor`` a 0-d array)."""
    return ck.elementwise("adadiag_clip", "T d", "T u", "u = u / d;")


def _clip_momentum_kernel(clip: bool) -> Any:
    """``M = b1 M0 + c1 (U / divisor)`` (``U`` itself without a clip)."""
    if clip:
        return ck.elementwise(
            "adadiag_clip_momentum", "T m0, T u, T d, T b1, T c1", "T M", "M = b1 * m0 + c1 * (u / d);"
        )
    return ck.elementwise("adadiag_momentum", "T m0, T u, T b1, T c1", "T M", "M = b1 * m0 + c1 * u;")


def factored(r0: Array, s0: Array, g: Array, eps: Any, b2: tuple[Any, Any], xp: Namespace) -> tuple[Array, Array]:
    """``(r_t, s_t)``: ``G~^2 + eps`` in one kernel, its row and column sums by ``cupy.sum`` (as the reference),
    each EMA in one kernel.  ``eps`` and ``b2 = (b, 1 - b)`` are kernel arguments of ``G~``'s dtype."""
    import cupy

    sq = _square_plus_eps_kernel()(g, eps, cupy.empty_like(g))
    rho, sigma = xp.sum(sq, axis=1), xp.sum(sq, axis=0)
    return ema(r0, rho, b2), ema(s0, sigma, b2)


def normalised_rms(g: Array, r: Array, s: Array, threshold: float | None, xp: Namespace) -> tuple[Array, Array | None]:
    """``(U, divisor)``: ``U = G~ sqrt(1^T r) / (sqrt(r) sqrt(s)^T)`` in one kernel (a new array in ``G~``'s memory
    order) and the clip's ``max(RMS(U) / d, 1)`` as a 0-d device array (``None`` when ``d`` is ``None``), by the
    reference's expressions with ``mean(U * U)`` as ``sum(U^2) / size`` over one summation kernel."""
    import cupy

    a = xp.sqrt(xp.sum(r)) / xp.sqrt(s)
    q = xp.sqrt(r)
    U = _normalise_kernel()(g, a[None, :], q[:, None], cupy.empty_like(g))
    if threshold is None:
        return U, None
    ratio = xp.sqrt(ck.sum_of_squares(U) / U.size) / threshold
    return U, xp.maximum(ratio, xp.ones_like(ratio))


def direction(state: Any, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments] | None:
    """``(U~, {"M", "r", "s"})`` of the reference direction by the kernels above; ``None`` unless the CuPy kernels
    are selected (``cfg.kernels == "auto"``, CuPy float32/float64 arrays of one dtype)."""
    assert isinstance(cfg, AdafactorConfig)
    M0 = state.M if cfg.momentum else None
    if not ck.selected(cfg, xp, g, M0, state.r, state.s):
        return None
    dtype = g.dtype
    eps = ck.coefficient(cfg.eps, dtype)
    b2 = ck.ema_coefficients(second_moment_decay(cfg, t, xp), dtype)
    b1 = ck.ema_coefficients(first_moment_decay(cfg, t, xp), dtype) if cfg.momentum else ()
    if eps is None or b2 is None or b1 is None:
        return None
    r, s = factored(state.r, state.s, g, eps, b2, xp)
    U, divisor = normalised_rms(g, r, s, cfg.clip_threshold, xp)
    if M0 is None:
        if divisor is not None:
            _clip_kernel()(divisor, U)
        return U, {"M": None, "r": r, "s": s}
    import cupy

    M = cupy.empty_like(g)
    if divisor is None:
        _clip_momentum_kernel(False)(M0, U, *b1, M)
    else:
        _clip_momentum_kernel(True)(M0, U, divisor, *b1, M)
    return M, {"M": M, "r": r, "s": s}
