r"""The Hfac family (Hfac, HfacDiag): factored first moment ``u`` (m,), ``v`` (n,) and second ``r``, ``s``.

Discrete (Algorithm HfacDiag, read literally, ``docs/spec.md``)::

    u_t = EMA_b1[G~ 1_n / n]            v_t = EMA_b1[G~^T 1_m / m]
    r_t, s_t, V_t as in Adafactor
    phi = b1_hat (u_t 1_n^T - G~ 1_n 1_n^T / n) / sqrt(r_t 1_n^T / n)
    psi = b1_hat (1_m v_t^T - 1_m 1_m^T G~ / m) / sqrt(1_m s_t^T / m)
    U~  = 0.5 (phi + psi) + clip(G~ / sqrt(V_t))

Continuous time, with ``g_r = G~ 1_n / n``, ``g_c = G~^T 1_m / m``,
``phi = (u - g_r) / sqrt(r / kappa_r)`` (m), ``psi = (v - g_c) / sqrt(s / kappa_s)`` (n),
``kappa = 1`` (``normalization="paper"``, the appendix ODE) or ``kappa_r = n, kappa_s = m``
(``"algorithm"``), ``c`` = ``momentum_scale`` (the algorithm's ``beta_1 -> 1``) and ``gamma U``
as in Adafactor::

    U~ = gamma U + (c / 2)(phi 1_n^T + 1_m psi^T)
    u' = a (g_r - u),  v' = a (g_c - v),  r' = b (rho - r),  s' = b (sigma - s)
    H  = L + K_u sum_i u_i^2 / sqrt(r_i) + K_v sum_j v_j^2 / sqrt(s_j),
         K_u = c n sqrt(kappa_r) / (4a),  K_v = c m sqrt(kappa_s) / (4a)

For the paper's ODE (``c = kappa = a = 1``) ``H`` is the appendix's
``L + <u 1_n^T / sqrt(r 1_n^T), u 1_n^T> / 4 + <1_m v^T / sqrt(1_m s^T), 1_m v^T> / 4``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ...._xp import Array, Namespace, sqrt
from ....config import BaseConfig, HfacConfig
from ...schedules import beta_hats, clip_by_rms
from .. import common
from ..common import Constants, FlowField, Moments

__all__ = ["HfacODEState", "HfacState", "normalization_constants"]


class HfacState(NamedTuple):
    """Hfac / HfacDiag: factored first moment ``u`` (m,), ``v`` (n,) and second ``r``, ``s``."""

    count: Array
    P: Array | None
    Q: Array | None
    u: Array
    v: Array
    r: Array
    s: Array
    param_shape: Array | None = None  # zero-size, shape (0, *param.shape): see optim.families.State


class HfacODEState(NamedTuple):
    """Hfac family: ``W``, factored first moment ``u`` (m,), ``v`` (n,), second ``r`` (m,), ``s`` (n,)."""

    W: Array
    u: Array
    v: Array
    r: Array
    s: Array


# ----------------------------------------------------------------------------- discrete


def direction(state: HfacState, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """Algorithm HfacDiag (module docstring)."""
    assert isinstance(cfg, HfacConfig)
    m, n = g.shape[-2:]  # a stack (*B, m, n): every statistic per matrix, over the last two axes
    b1_t, b2_t = beta_hats(cfg, t, xp)
    row_mean = xp.mean(g, axis=-1)
    col_mean = xp.mean(g, axis=-2)
    u = common.ema(b1_t, state.u, row_mean)
    v = common.ema(b1_t, state.v, col_mean)
    r, s = common.factored_second_moment(state.r, state.s, g, cfg.eps, b2_t, xp)
    phi = b1_t * (u - row_mean) / sqrt(r / n, xp)
    psi = b1_t * (v - col_mean) / sqrt(s / m, xp)
    clipped = clip_by_rms(common.normalise(g, r, s, xp), cfg.clip_threshold, xp)
    U = 0.5 * (phi[..., :, None] + psi[..., None, :]) + clipped
    return U, {"u": u, "v": v, "r": r, "s": s}


# ----------------------------------------------------------------------------- continuous


def normalization_constants(c: Constants, m: int, n: int) -> tuple[float, float]:
    """``(kappa_r, kappa_s)``: 1, 1 for the paper's ODE; ``n``, ``m`` for Algorithm HfacDiag."""
    if c.normalization == "algorithm":
        return float(n), float(m)
    return 1.0, 1.0


def fields(c: Constants) -> tuple[str, ...]:
    """``W, u, v, r, s``."""
    return HfacODEState._fields


def update_order(c: Constants) -> tuple[tuple[str, ...], ...]:
    """``(u, v, r, s)``, then ``W``."""
    return (("u", "v", "r", "s"), ("W",))


def vector_field(c: Constants, state: HfacODEState, G_rot: Array, xp: Namespace) -> FlowField:
    """``U~ = gamma U + (c/2)(phi 1_n^T + 1_m psi^T)`` and the moments' rates (module docstring)."""
    m, n = G_rot.shape
    kr, ks = normalization_constants(c, m, n)
    rho, sigma = common.factored_sums(G_rot, c.eps, xp)
    g_r, g_c = xp.mean(G_rot, axis=1), xp.mean(G_rot, axis=0)
    u, v, r, s = state.u, state.v, state.r, state.s

    def direction() -> Array:
        phi = (u - g_r) / sqrt(r / kr, xp)
        psi = (v - g_c) / sqrt(s / ks, xp)
        return common.clipped_normalised(G_rot, r, s, c.clip_threshold, xp) + (0.5 * c.momentum_scale) * (
            phi[:, None] + psi[None, :]
        )

    return FlowField(
        direction,
        {
            "u": lambda: c.a * (g_r - u),
            "v": lambda: c.a * (g_c - v),
            "r": lambda: c.b * (rho - r),
            "s": lambda: c.b * (sigma - s),
        },
    )


def hamiltonian(c: Constants, state: HfacODEState, loss: Array, xp: Namespace) -> Array:
    """``H = L + K_u sum_i u_i^2 / sqrt(r_i) + K_v sum_j v_j^2 / sqrt(s_j)`` (module docstring)."""
    m, n = state.W.shape
    kr, ks = normalization_constants(c, m, n)
    K_u = c.momentum_scale * n * math.sqrt(kr) / (4 * c.a)
    K_v = c.momentum_scale * m * math.sqrt(ks) / (4 * c.a)
    return (
        loss + K_u * xp.sum(state.u * state.u / sqrt(state.r, xp)) + K_v * xp.sum(state.v * state.v / sqrt(state.s, xp))
    )


def hamiltonian_rate(c: Constants, state: HfacODEState, G_rot: Array, xp: Namespace) -> Array:
    r"""``dH/dt`` (no decay), ``q = b / (4a)``, ``C_u = c n sqrt(kappa_r) / 2``, ``C_v = c m sqrt(kappa_s) / 2``::

        -gamma sum G~^2 / S
        + C_u sum_i (g_r,i^2 - (1 - q) u_i^2) / sqrt(r_i) - C_u q sum_i u_i^2 rho_i / r_i^(3/2)
        + C_v sum_j (g_c,j^2 - (1 - q) v_j^2) / sqrt(s_j) - C_v q sum_j v_j^2 sigma_j / s_j^(3/2)

    The ``+g^2`` terms are where the paper's claim can fail.
    """
    m, n = G_rot.shape
    kr, ks = normalization_constants(c, m, n)
    q = c.b / (4 * c.a)
    rho, sigma, _, S = common.factored(state, G_rot, c.eps, xp)
    U = G_rot / S
    gamma = common.clip_factor(U, c.clip_threshold, xp)
    g_r, g_c = xp.mean(G_rot, axis=1), xp.mean(G_rot, axis=0)
    cu = 0.5 * c.momentum_scale * n * math.sqrt(kr)
    cv = 0.5 * c.momentum_scale * m * math.sqrt(ks)
    sr, ss = sqrt(state.r, xp), sqrt(state.s, xp)
    u2, v2 = state.u * state.u, state.v * state.v
    row = cu * xp.sum((g_r * g_r - (1.0 - q) * u2) / sr) - cu * q * xp.sum(u2 * rho / (state.r * sr))
    col = cv * xp.sum((g_c * g_c - (1.0 - q) * v2) / ss) - cv * q * xp.sum(v2 * sigma / (state.s * ss))
    return -gamma * xp.sum(G_rot * G_rot / S) + row + col


def initial_moments(c: Constants, G0_rot: Array, zero: bool, f: Array, xp: Namespace) -> Moments:
    """``u0 = g_r``, ``v0 = g_c``, ``r0 = rho0 + n f``, ``s0 = sigma0 + m f``; or zero first moments."""
    m, n = G0_rot.shape
    r0, s0 = common.initial_factored(G0_rot, c.eps, zero, f, xp)
    if zero:
        return {"u": xp.zeros((m,), dtype=G0_rot.dtype), "v": xp.zeros((n,), dtype=G0_rot.dtype), "r": r0, "s": s0}
    return {"u": xp.mean(G0_rot, axis=1), "v": xp.mean(G0_rot, axis=0), "r": r0, "s": s0}
