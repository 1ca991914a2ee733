r"""The Adafactor family (Adafactor, AdafacDiag, AdafacDiag++): factored second moment ``r`` (m,), ``s`` (n,).

Discrete (Algorithm AdafacDiag, on the rotated gradient ``G~``)::

    r_t = EMA[(G~^2 + eps) 1_n],   s_t = EMA[(G~^2 + eps)^T 1_m],   V_t = r_t s_t^T / (1_m^T r_t)
    U~  = clip(G~ / sqrt(V_t));    with momentum M_t = EMA_b1[U~] and U~ = M_t

Continuous time, with ``rho = (G~^2 + eps) 1_n``, ``sigma = (G~^2 + eps)^T 1_m``,
``S = sqrt(V^)``, ``V^ = r s^T / (1_m^T r)``, ``U = G~ / S`` and ``gamma = 1 / max(1, RMS(U) / d)``::

    r' = b (rho - r),   s' = b (sigma - s)
    gradient form (paper):   M' = a (G~ - M),        U~ = M / S,      H = L + <M / S, M> / (2a)
    update form (Algorithm): M' = a (gamma U - M),   U~ = M,          H = L + <S M, M> / (2a)
    none (no momentum):                              U~ = gamma U,    H = L
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ...._xp import Array, Namespace
from ....config import AdafactorConfig, BaseConfig
from ...schedules import adafactor_beta2, beta_hat, clip_by_rms, first_moment_decay, relative_step, rms
from .. import common
from ..common import Constants, FlowField, Moments

__all__ = ["AdafactorODEState", "AdafactorState", "second_moment_decay"]


class AdafactorState(NamedTuple):
    """Adafactor / AdafacDiag: row sums ``r`` (m,), column sums ``s`` (n,), optional ``M``."""

    count: Array
    P: Array | None
    Q: Array | None
    M: Array | None
    r: Array
    s: Array
    param_shape: Array | None = None  # zero-size, shape (0, *param.shape): see optim.families.State


class AdafactorODEState(NamedTuple):
    """Adafactor family: ``W``, first moment ``M`` (``None`` without momentum), ``r`` (m,), ``s`` (n,)."""

    W: Array
    M: Array | None
    r: Array
    s: Array


# ----------------------------------------------------------------------------- discrete


def second_moment_decay(cfg: AdafactorConfig, t: Array, xp: Namespace) -> Array:
    """``beta2_t``: Adafactor's ``1 - t^(-c)`` (``beta2_schedule="adafactor"``) or the bias-corrected ``beta_hat``."""
    if cfg.beta2_schedule == "adafactor":
        return adafactor_beta2(t, cfg.decay_rate, xp)
    return beta_hat(cfg.betas[1], t, xp, bias_correction=cfg.bias_correction)


def direction(state: AdafactorState, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """Algorithm AdafacDiag: ``U = clip(G~ / sqrt(V_t))``; with momentum ``M_t = EMA_b1[U]`` and ``U = M_t``."""
    assert isinstance(cfg, AdafactorConfig)
    r, s = common.factored_second_moment(state.r, state.s, g, cfg.eps, second_moment_decay(cfg, t, xp), xp)
    U = clip_by_rms(common.normalise(g, r, s, xp), cfg.clip_threshold, xp)
    M = None
    if cfg.momentum:
        M = common.ema(first_moment_decay(cfg, t, xp), state.M, U)
        U = M
    return U, {"M": M, "r": r, "s": s}


def step_size(cfg: BaseConfig, t: Array, w: Array, lr: Any, xp: Namespace) -> Any:
    """``eta_t = rho_t * scale`` with ``rho_t = min(lr, 1/sqrt(t))`` (relative step) and
    ``scale = max(eps2, RMS(W_t))`` (parameter scaling); ``eta_t = lr`` with both off."""
    assert isinstance(cfg, AdafactorConfig)
    eta = lr
    if cfg.relative_step:
        eta = relative_step(lr, t, xp)
    if cfg.scale_parameter:
        scale = rms(w, xp)
        eta = eta * xp.maximum(scale, xp.full_like(scale, cfg.eps2))
    return eta


# ----------------------------------------------------------------------------- continuous


def fields(c: Constants) -> tuple[str, ...]:
    """``W, M, r, s``; no ``M`` when ``momentum_form="none"``."""
    names: tuple[str, ...] = AdafactorODEState._fields
    return tuple(f for f in names if f != "M") if c.momentum_form == "none" else names


def update_order(c: Constants) -> tuple[tuple[str, ...], ...]:
    """``r, s`` (and the gradient form's ``M``), then the update form's ``M`` (it uses the new ``r, s``), then ``W``."""
    if c.momentum_form == "none":
        return (("r", "s"), ("W",))
    if c.momentum_form == "gradient":
        return (("r", "s", "M"), ("W",))
    return (("r", "s"), ("M",), ("W",))


def vector_field(c: Constants, state: AdafactorODEState, G_rot: Array, xp: Namespace) -> FlowField:
    """The gradient, update or momentum-free form (module docstring)."""
    r, s, M = state.r, state.s, state.M

    def clipped_u() -> Array:
        return common.clipped_normalised(G_rot, r, s, c.clip_threshold, xp)

    rho, sigma = common.factored_sums(G_rot, c.eps, xp)
    moments = {"r": lambda: c.b * (rho - r), "s": lambda: c.b * (sigma - s)}
    if c.momentum_form == "none":
        return FlowField(clipped_u, moments)
    assert M is not None
    if c.momentum_form == "gradient":
        return FlowField(lambda: M / common.factored_scale(r, s, xp), {**moments, "M": lambda: c.a * (G_rot - M)})
    return FlowField(lambda: M, {**moments, "M": lambda: c.a * (clipped_u() - M)})


def hamiltonian(c: Constants, state: AdafactorODEState, loss: Array, xp: Namespace) -> Array:
    """Gradient form ``H = L + <M / S, M> / (2a)`` (the paper's); update form ``L + <S M, M> / (2a)``; none ``L``."""
    if c.momentum_form == "none":
        return loss + xp.zeros((), dtype=state.W.dtype)
    assert state.M is not None
    S = common.factored_scale(state.r, state.s, xp)
    kinetic = state.M * state.M / S if c.momentum_form == "gradient" else S * state.M * state.M
    return loss + xp.sum(kinetic) / (2 * c.a)


def hamiltonian_rate(c: Constants, state: AdafactorODEState, G_rot: Array, xp: Namespace) -> Array:
    r"""``dH/dt`` without weight decay, ``q = b / (4a)``, ``R = 1^T r``.

    * gradient form, with ``Psi = M^2 / S``, row sums ``Psi_r`` and column sums ``Psi_c``::

        -sum Psi (1 - q (1 + 1^T rho / R))  -  q (<Psi_r, rho / r> + <Psi_c, sigma / s>)

    * update form:
      ``-(1 - gamma) <G~, M> - sum S M^2 + q sum S M^2 (rho_i/r_i + sigma_j/s_j - 1^T rho / R - 1)``;
    * no momentum: ``-gamma sum G~^2 / S``.
    """
    q = c.b / (4 * c.a)
    rho, sigma, R, S = common.factored(state, G_rot, c.eps, xp)
    U = G_rot / S
    gamma = common.clip_factor(U, c.clip_threshold, xp)
    if c.momentum_form == "none":
        return -gamma * xp.sum(G_rot * G_rot / S)
    assert state.M is not None
    M2 = state.M * state.M
    if c.momentum_form == "gradient":
        Psi = M2 / S
        total = xp.sum(Psi)
        ratio = xp.sum(rho) / R
        spread = xp.sum(xp.sum(Psi, axis=1) * rho / state.r) + xp.sum(xp.sum(Psi, axis=0) * sigma / state.s)
        return -total * (1.0 - q * (1.0 + ratio)) - q * spread
    growth = rho[:, None] / state.r[:, None] + sigma[None, :] / state.s[None, :] - xp.sum(rho) / R - 1.0
    return -(1.0 - gamma) * xp.sum(G_rot * state.M) - xp.sum(S * M2) + q * xp.sum(S * M2 * growth)


def initial_moments(c: Constants, G0_rot: Array, zero: bool, f: Array, xp: Namespace) -> Moments:
    """``r0 = rho0 + n f``, ``s0 = sigma0 + m f``; ``M0 = G~0`` (gradient form) or ``gamma U0`` (update form)."""
    r0, s0 = common.initial_factored(G0_rot, c.eps, zero, f, xp)
    if c.momentum_form == "none":
        M0 = None
    elif zero:
        M0 = xp.zeros_like(G0_rot)
    elif c.momentum_form == "gradient":
        M0 = G0_rot
    else:
        M0 = common.clipped_normalised(G0_rot, r0, s0, c.clip_threshold, xp)
    return {"M": M0, "r": r0, "s": s0}
