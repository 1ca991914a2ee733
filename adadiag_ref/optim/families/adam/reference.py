r"""The Adam family (AdamW, AdaDiag, AdaDiag++): both moments full ``m x n`` matrices.

Discrete (Algorithm 1, on the rotated gradient ``G~``)::

    M_t = EMA_b1[G~],   V_t = EMA_b2[G~^2],   U~ = M_t / (sqrt(V_t) + eps)

Continuous time (the paper's Adam-ODE with rates ``a``, ``b``; ``D = sqrt(V) + eps``)::

    W' = -P (M / D) Q^T - lambda W,   M' = a (G~ - M),   V' = b (G~^2 - V)
    H  = L(W) + <M / D, M> / (2a)
"""

from __future__ import annotations

from typing import NamedTuple

from ...._xp import Array, Namespace, sqrt
from ....config import BaseConfig
from ...schedules import beta_hats
from ..common import Constants, FlowField, Moments, ema

__all__ = ["AdamODEState", "AdamState"]


class AdamState(NamedTuple):
    """AdamW / AdaDiag / AdaDiag++: ``M`` and ``V`` are ``m x n`` rotated moments."""

    count: Array
    P: Array | None
    Q: Array | None
    M: Array
    V: Array
    param_shape: Array | None = None  # zero-size, shape (0, *param.shape): see optim.families.State


class AdamODEState(NamedTuple):
    """Adam, AdaDiag, AdaDiag++: ``W`` and the rotated moments ``M``, ``V`` (``m x n``)."""

    W: Array
    M: Array
    V: Array


# ----------------------------------------------------------------------------- discrete


def direction(state: AdamState, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """Algorithm 1: ``M_t = EMA_b1[G~]``, ``V_t = EMA_b2[G~^2]``, ``U = M_t / (sqrt(V_t) + eps)``."""
    b1_t, b2_t = beta_hats(cfg, t, xp)
    M = ema(b1_t, state.M, g)
    V = ema(b2_t, state.V, g * g)
    return M / (sqrt(V, xp) + cfg.eps), {"M": M, "V": V}


# ----------------------------------------------------------------------------- continuous


def fields(c: Constants) -> tuple[str, ...]:
    """``W, M, V``."""
    return AdamODEState._fields


def update_order(c: Constants) -> tuple[tuple[str, ...], ...]:
    """``(M, V)``, then ``W``."""
    return (("M", "V"), ("W",))


def vector_field(c: Constants, state: AdamODEState, G_rot: Array, xp: Namespace) -> FlowField:
    """``U~ = M / (sqrt(V) + eps)``, ``M' = a (G~ - M)``, ``V' = b (G~^2 - V)``."""
    M, V = state.M, state.V
    return FlowField(
        direction=lambda: M / (sqrt(V, xp) + c.eps),
        moments={"M": lambda: c.a * (G_rot - M), "V": lambda: c.b * (G_rot * G_rot - V)},
    )


def hamiltonian(c: Constants, state: AdamODEState, loss: Array, xp: Namespace) -> Array:
    """``H = L + <M / (sqrt(V) + eps), M> / (2a)`` (the paper's, with ``1/(2a)``)."""
    return loss + xp.sum(state.M * state.M / (sqrt(state.V, xp) + c.eps)) / (2 * c.a)


def hamiltonian_rate(c: Constants, state: AdamODEState, G_rot: Array, xp: Namespace) -> Array:
    r"""``dH/dt`` without weight decay, ``q = b / (4a)``, ``D = sqrt(V) + eps``::

        -sum M^2 / D  +  q sum M^2 sqrt(V) / D^2  -  q sum M^2 G~^2 / (sqrt(V) D^2)

    The middle term (from the ``-V`` in ``V'``) is positive; it is dominated by the
    first iff ``q sqrt(V)/D <= 1``, which holds for every state iff ``b <= 4a``.
    """
    q = c.b / (4 * c.a)
    M2 = state.M * state.M
    sqrtV = sqrt(state.V, xp)
    D = sqrtV + c.eps
    num = M2 * G_rot * G_rot
    zero = xp.zeros_like(num)
    # The term M^2 G~^2 / (sqrt(V) D^2) is -dH/dV * V'-part; at V = 0 it is +inf where M G~ != 0.
    positive_v = state.V > 0
    safe_sqrtV = xp.where(positive_v, sqrtV, xp.ones_like(sqrtV))
    gradient_term = xp.where(positive_v, num / (safe_sqrtV * D * D), xp.where(num > 0, zero + xp.inf, zero))
    return -xp.sum(M2 / D) + q * xp.sum(M2 * sqrtV / (D * D)) - q * xp.sum(gradient_term)


def initial_moments(c: Constants, G0_rot: Array, zero: bool, f: Array, xp: Namespace) -> Moments:
    """``M0 = G~0``, ``V0 = G~0^2 + f`` (the discrete optimizer after its first step); or zeros."""
    if zero:
        return {"M": xp.zeros_like(G0_rot), "V": xp.zeros_like(G0_rot)}
    return {"M": G0_rot, "V": G0_rot * G0_rot + f}
