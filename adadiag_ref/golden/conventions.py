"""The conventions real code differs from the paper's by, recognised from a port's parameters.

Each :class:`Convention` rebuilds the trajectory the case's config would give under that convention, with the
live core (:func:`adadiag_ref.optim.step`, NumPy, the case's dtype) and one change:

=========================  =====================================================================================
``eps_before_bias``        HF ``correct_bias`` (GaLore): ``eta sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)``,
                           i.e. ``eps_t = eps / sqrt(1 - b2^t)`` against the fixture's ``sqrt(V) + eps``
``decay_after_update``     ``W_{t+1} = (W_t - eta P U~ Q^T)(1 - eta lambda)``: the decay of the updated ``W``
``hf_adamw``               both of the above (HF transformers' and GaLore's ``AdamW``)
``coupled_l2``             ``G_t + lambda W_t`` fed to the moments (Adam's L2), no decoupled decay
``missing_decay``          no decay term: ``got - want = eta lambda W_t`` at the first step
``no_bias_correction``     the raw EMAs in the update (``m / (sqrt(v) + eps)``, no ``1 - beta^t``)
``other_side``             a square matrix rotated on its right side (the work frame's ``Q`` for ``P``)
=========================  =====================================================================================

plus ``no_update_at_step_1`` (``W_2 = W_1``: SOAP's and others' first step only builds the preconditioner),
read off the trajectory directly when no convention above fits.  A convention is named only when the port's
whole trajectory (every step it ran) meets the rebuilt one within 10x the case's tolerances while the rebuilt
one does not meet the fixture: evidence, not a guess.  The check runs on a failing case only (about 1 ms per
convention on a golden case).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from ..config import AdamConfig, BaseConfig
from ..optim import init, step
from .format import GoldenCase

__all__ = ["CONVENTIONS", "Convention", "recognise"]

MATCH_FACTOR = 10.0
"""A port meets a rebuilt trajectory within ``MATCH_FACTOR`` x the case's (per-step) tolerances: the rebuilt one
is the live core's NumPy rounding, a port's is its own (a few ulps apart in float64, one in float32), and the
conventions differ from each other and the fixture by far more (``>= 1e-9`` of the scale, measured in
tests/test_conform.py's planted ports)."""


class Convention(NamedTuple):
    """One convention: its name, what it says to the porter, and when it can apply (``applies(cfg, case)``)."""

    name: str
    message: str
    applies: Callable[[BaseConfig, GoldenCase], bool]
    rebuild: Callable[[BaseConfig, GoldenCase], np.ndarray]


def _run(
    cfg: BaseConfig,
    case: GoldenCase,
    *,
    cfg_at: Callable[[int], BaseConfig] | None = None,
    grad_at: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    after: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """The core's trajectory with a per-step config (``cfg_at(t)``), gradient (``grad_at(W_t, G_t)``) or a map
    of ``W_{t+1}`` (``after``); ``params[t-1] = W_{t+1}``."""
    w = np.array(case.w0, copy=True)
    state = init(w, cfg)
    out = []
    for k in range(case.steps):
        g = np.asarray(case.grads[k])
        g = grad_at(w, g) if grad_at is not None else g
        w, state = step(state, g, cfg_at(k + 1) if cfg_at is not None else cfg, w, check=False)
        w = after(w) if after is not None else w
        out.append(np.asarray(w))
    return np.stack(out, axis=0)


def _hf_conventions(
    cfg: BaseConfig, case: GoldenCase, *, eps_before_bias: bool = False, decay_after_update: bool = False
) -> np.ndarray:
    """HF's conventions, one or both: eps before the bias correction (``eps_t = eps / sqrt(1 - b2^t)``) and the
    decay applied to the updated ``W`` (``W_{t+1} = (W_t - eta U)(1 - eta lambda)``)."""
    b2, shrink = float(cfg.betas[1]), 1.0 - cfg.lr * cfg.weight_decay
    base = dataclasses.replace(cfg, weight_decay=0.0) if decay_after_update else cfg

    def eps_at(t: int) -> BaseConfig:
        return dataclasses.replace(base, eps=cfg.eps / math.sqrt(1.0 - b2**t))

    def decay_after(w: np.ndarray) -> np.ndarray:
        return w * np.asarray(shrink, dtype=w.dtype)

    return _run(
        base, case, cfg_at=eps_at if eps_before_bias else None, after=decay_after if decay_after_update else None
    )


def _coupled_l2(cfg: BaseConfig, case: GoldenCase) -> np.ndarray:
    bare = dataclasses.replace(cfg, weight_decay=0.0)
    wd = cfg.weight_decay
    return _run(bare, case, grad_at=lambda w, g: g + np.asarray(wd, dtype=g.dtype) * w)


def _changed(**changes: Any) -> Callable[[BaseConfig, GoldenCase], np.ndarray]:
    """The rebuild of a convention that is one change of the config for the whole run."""
    return lambda cfg, case: _run(dataclasses.replace(cfg, **changes), case)


def _other_side(cfg: BaseConfig, case: GoldenCase) -> np.ndarray:
    flipped = dataclasses.replace(case, arrays={"w0": case.w0.T, "grads": np.swapaxes(case.grads, 1, 2)})
    return np.swapaxes(_run(cfg, flipped), 1, 2)


def _adam_bias_corrected(cfg: BaseConfig, case: GoldenCase) -> bool:
    return isinstance(cfg, AdamConfig) and cfg.bias_correction and float(cfg.betas[1]) > 0


def _decays(cfg: BaseConfig, case: GoldenCase) -> bool:
    return cfg.weight_decay != 0 and not getattr(cfg, "relative_step", False)


def _square_one_sided(cfg: BaseConfig, case: GoldenCase) -> bool:
    return cfg.sides == 1 and len(case.shape) == 2 and case.shape[0] == case.shape[1]


CONVENTIONS: tuple[Convention, ...] = (
    Convention(
        "eps_before_bias",
        "eps added before the bias correction (HF's correct_bias, GaLore: lr sqrt(1 - b2^t) / (1 - b1^t) and "
        "sqrt(v) + eps); the spec adds eps to sqrt(V) of the bias-corrected V",
        _adam_bias_corrected,
        partial(_hf_conventions, eps_before_bias=True),
    ),
    Convention(
        "decay_after_update",
        "the weight decay applied to the updated W ((W_t - eta U)(1 - eta lambda)); the spec decays W_t: "
        "W_{t+1} = W_t - eta (U + lambda W_t)",
        _decays,
        partial(_hf_conventions, decay_after_update=True),
    ),
    Convention(
        "hf_adamw",
        "HF's AdamW (GaLore's): eps added before the bias correction and the decay applied to the updated W, "
        "(W_t - eta sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps))(1 - eta lambda); the spec: "
        "W_{t+1} = W_t - eta (M / (sqrt(V) + eps) + lambda W_t) with the bias-corrected M, V",
        lambda cfg, case: _adam_bias_corrected(cfg, case) and _decays(cfg, case),
        partial(_hf_conventions, eps_before_bias=True, decay_after_update=True),
    ),
    Convention(
        "coupled_l2",
        "coupled L2 decay (lambda W_t added to the gradient, as Adam's weight_decay); the spec's decay is "
        "decoupled: W_{t+1} = W_t - eta (U + lambda W_t)",
        _decays,
        _coupled_l2,
    ),
    Convention(
        "missing_decay",
        "no weight decay term (got - want = eta lambda W_t at the first step); the spec: "
        "W_{t+1} = W_t - eta (U + lambda W_t)",
        _decays,
        _changed(weight_decay=0.0),
    ),
    Convention(
        "no_bias_correction",
        "the raw EMAs in the update (no 1 - beta^t): the fixture's M, V are bias-corrected",
        lambda cfg, case: bool(cfg.bias_correction) and isinstance(cfg, AdamConfig),
        _changed(bias_correction=False),
    ),
    Convention(
        "other_side",
        "the other side rotated on a square matrix (the right singular vectors for P): the work frame of "
        "docs/spec.md rotates the left side when m <= n",
        _square_one_sided,
        _other_side,
    ),
)
"""The catalogue, tried in this order (the first that fits is the hint)."""


def _meets(got: np.ndarray, want: np.ndarray, rtols: np.ndarray, atols: np.ndarray) -> bool:
    """Every step of ``got`` within ``MATCH_FACTOR`` x the tolerances of ``want`` (finite, same shapes)."""
    n = got.shape[0]
    if n == 0 or got.shape[1:] != want.shape[1:]:
        return False
    x, y = got.astype(np.float64).reshape(n, -1), want[:n].astype(np.float64).reshape(n, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        bound = MATCH_FACTOR * (atols[:n, None] + rtols[:n, None] * np.abs(y))
        return bool(np.all(np.isfinite(x) & (np.abs(x - y) <= bound)))


def recognise(case: GoldenCase, traj: np.ndarray, rtols: np.ndarray, atols: np.ndarray) -> list[str]:
    """The conventions a port's trajectory ``traj`` (``traj[t-1] = W_{t+1}``, the steps it ran) fits, as
    messages ``"<name>: <what it is>"``; ``rtols``, ``atols``: the case's tolerances per step."""
    found = []
    cfg = case.make_config()
    for convention in CONVENTIONS:
        if not convention.applies(cfg, case):
            continue
        try:
            rebuilt = convention.rebuild(cfg, case)
        except (ValueError, ArithmeticError, np.linalg.LinAlgError):  # a convention the core cannot express here
            continue
        if _meets(traj, rebuilt, rtols, atols) and not _meets(rebuilt, case.params, rtols, atols):
            found.append(f"{convention.name}: {convention.message}")
    n = traj.shape[0]
    stalled = n and _meets(traj[:1], case.w0[None], rtols, atols)
    if stalled and not found and not _meets(case.params[:1], case.w0[None], rtols, atols):
        # last: a zero G_1 with a convention above also leaves W_2 = W_1 (up to the decay it drops)
        found.append(
            "no_update_at_step_1: W_2 = W_1 (the first step only built the state); the spec updates W at t = 1"
        )
    return found
