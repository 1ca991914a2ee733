"""The three moment families, each as two small pure functions.

A family supplies ``init_moments`` (zeros of fixed shapes) and ``direction``:
given the rotated gradient ``G~`` (``m x n``, work frame) and the step ``t`` it
returns the preconditioned direction ``U`` in the rotated space together with
the new moment arrays.  Everything else (rotation, unrotation, weight decay,
learning rate, basis refresh) is shared by :mod:`adadiag_ref.optim.core`, so a
baseline is the same code with the identity basis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .._xp import Array, Namespace
from ..config import AdafactorConfig, BaseConfig, HfacConfig
from ..state import AdafactorState, AdamState, HfacState
from .schedules import adafactor_beta2, beta_hat, clip_by_rms, rms

__all__ = ["FAMILIES", "Family"]

Moments = dict[str, Array | None]


class Family(NamedTuple):
    state_type: type
    moment_fields: tuple[str, ...]
    init_moments: Callable[[int, int, Any, Any, BaseConfig, Namespace], Moments]
    direction: Callable[[Any, Array, Array, BaseConfig, Namespace], tuple[Array, Moments]]
    step_size: Callable[[BaseConfig, Array, Array, Any, Namespace], Any]


def _constant_step_size(cfg: BaseConfig, t: Array, w: Array, lr: Any, xp: Namespace) -> Any:
    """``eta_t = eta``."""
    return lr


def _ema(beta_t: Array, old: Array, new: Array) -> Array:
    """``beta_t * old + (1 - beta_t) * new``."""
    return beta_t * old + (1.0 - beta_t) * new


def _factored_second_moment(
    r: Array, s: Array, g: Array, eps: float, beta2_t: Array, xp: Namespace
) -> tuple[Array, Array]:
    """Adafactor's factored second moment of the rotated gradient.

    ``r_t = EMA[(G~^2 + eps) 1_n]`` and ``s_t = EMA[(G~^2 + eps)^T 1_m]``; the
    implied ``V_t = r_t s_t^T / (1_m^T r_t)`` is never formed (see :func:`_normalise`).
    """
    sq = g * g + eps
    return _ema(beta2_t, r, xp.sum(sq, axis=1)), _ema(beta2_t, s, xp.sum(sq, axis=0))


def _normalise(g: Array, r: Array, s: Array, xp: Namespace) -> Array:
    """``G~ / sqrt(V_t)`` with ``V_t = r s^T / (1_m^T r)``, as ``G~ sqrt(1^T r) / (sqrt(r) sqrt(s)^T)``.

    The factored form avoids the product ``r_i s_j``, which underflows in float32
    when both are of the order of eps = 1e-30 (a zero row and a zero column).
    """
    # vectors broadcast against G~ (no m x n temporary of its own) keep G~'s memory order
    return g * (xp.sqrt(xp.sum(r)) / xp.sqrt(s))[None, :] / xp.sqrt(r)[:, None]


# ----------------------------------------------------------------------------- Adam


def _adam_init(m: int, n: int, dtype: Any, device: Any, cfg: BaseConfig, xp: Namespace) -> Moments:
    return {"M": xp.zeros((m, n), dtype=dtype, device=device), "V": xp.zeros((m, n), dtype=dtype, device=device)}


def _adam_direction(state: AdamState, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """Algorithm 1: ``M_t = EMA_b1[G~]``, ``V_t = EMA_b2[G~^2]``, ``U = M_t / (sqrt(V_t) + eps)``."""
    b1, b2 = cfg.betas
    b1_t = beta_hat(b1, t, xp, bias_correction=cfg.bias_correction)
    b2_t = beta_hat(b2, t, xp, bias_correction=cfg.bias_correction)
    M = _ema(b1_t, state.M, g)
    V = _ema(b2_t, state.V, g * g)
    return M / (xp.sqrt(V) + cfg.eps), {"M": M, "V": V}


# ----------------------------------------------------------------------------- Adafactor


def _adafactor_init(m: int, n: int, dtype: Any, device: Any, cfg: BaseConfig, xp: Namespace) -> Moments:
    assert isinstance(cfg, AdafactorConfig)
    M = xp.zeros((m, n), dtype=dtype, device=device) if cfg.momentum else None
    return {"M": M, "r": xp.zeros((m,), dtype=dtype, device=device), "s": xp.zeros((n,), dtype=dtype, device=device)}


def _adafactor_beta2(cfg: AdafactorConfig, t: Array, xp: Namespace) -> Array:
    if cfg.beta2_schedule == "adafactor":
        return adafactor_beta2(t, cfg.decay_rate, xp)
    return beta_hat(cfg.betas[1], t, xp, bias_correction=cfg.bias_correction)


def _adafactor_direction(
    state: AdafactorState, g: Array, t: Array, cfg: BaseConfig, xp: Namespace
) -> tuple[Array, Moments]:
    """Algorithm AdafacDiag: ``U = clip(G~ / sqrt(V_t))``; with momentum ``M_t = EMA_b1[U]`` and ``U = M_t``."""
    assert isinstance(cfg, AdafactorConfig)
    r, s = _factored_second_moment(state.r, state.s, g, cfg.eps, _adafactor_beta2(cfg, t, xp), xp)
    U = clip_by_rms(_normalise(g, r, s, xp), cfg.clip_threshold, xp)
    M = None
    if cfg.momentum:
        M = _ema(beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction), state.M, U)
        U = M
    return U, {"M": M, "r": r, "s": s}


def _adafactor_step_size(cfg: BaseConfig, t: Array, w: Array, lr: Any, xp: Namespace) -> Any:
    """``eta_t = rho_t * scale`` with ``rho_t = min(lr, 1/sqrt(t))`` (relative step) and
    ``scale = max(eps2, RMS(W_t))`` (parameter scaling); ``eta_t = lr`` with both off."""
    assert isinstance(cfg, AdafactorConfig)
    eta = lr
    if cfg.relative_step:
        lr_t = lr * xp.ones_like(t)
        eta = xp.minimum(lr_t, 1.0 / xp.sqrt(t))
    if cfg.scale_parameter:
        scale = rms(w, xp)
        eta = eta * xp.maximum(scale, xp.full_like(scale, cfg.eps2))
    return eta


# ----------------------------------------------------------------------------- Hfac


def _hfac_init(m: int, n: int, dtype: Any, device: Any, cfg: BaseConfig, xp: Namespace) -> Moments:
    def zeros(k: int) -> Array:
        return xp.zeros((k,), dtype=dtype, device=device)

    return {"u": zeros(m), "v": zeros(n), "r": zeros(m), "s": zeros(n)}


def _hfac_direction(state: HfacState, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """Algorithm HfacDiag, read literally (``docs/spec.md``)::

    u_t = EMA_b1[G~ 1_n / n]            v_t = EMA_b1[G~^T 1_m / m]
    r_t, s_t, V_t as in Adafactor
    phi = b1_hat (u_t 1_n^T - G~ 1_n 1_n^T / n) / sqrt(r_t 1_n^T / n)
    psi = b1_hat (1_m v_t^T - 1_m 1_m^T G~ / m) / sqrt(1_m s_t^T / m)
    U   = 0.5 (phi + psi) + clip(G~ / sqrt(V_t))
    """
    assert isinstance(cfg, HfacConfig)
    m, n = g.shape
    b1_t = beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction)
    b2_t = beta_hat(cfg.betas[1], t, xp, bias_correction=cfg.bias_correction)
    row_mean = xp.mean(g, axis=1)
    col_mean = xp.mean(g, axis=0)
    u = _ema(b1_t, state.u, row_mean)
    v = _ema(b1_t, state.v, col_mean)
    r, s = _factored_second_moment(state.r, state.s, g, cfg.eps, b2_t, xp)
    phi = b1_t * (u - row_mean) / xp.sqrt(r / n)
    psi = b1_t * (v - col_mean) / xp.sqrt(s / m)
    U = 0.5 * (phi[:, None] + psi[None, :]) + clip_by_rms(_normalise(g, r, s, xp), cfg.clip_threshold, xp)
    return U, {"u": u, "v": v, "r": r, "s": s}


FAMILIES: dict[str, Family] = {
    "adam": Family(AdamState, ("M", "V"), _adam_init, _adam_direction, _constant_step_size),
    "adafactor": Family(AdafactorState, ("M", "r", "s"), _adafactor_init, _adafactor_direction, _adafactor_step_size),
    "hfac": Family(HfacState, ("u", "v", "r", "s"), _hfac_init, _hfac_direction, _constant_step_size),
}
