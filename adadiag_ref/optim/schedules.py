"""Scalar schedules and the small shared pieces of the update rules.

All functions take the step ``t`` (1, 2, ...) as a floating array so that they
trace under ``jax.jit``; none converts a device array to a Python number.

**Host steps.**  A driver that counts its steps on the host (``count=`` of :func:`~adadiag_ref.step`) passes
``t`` as a NumPy 0-d array in the state's precision (:func:`host_step`).  With arrays of another backend (CuPy,
CUDA torch, ``array_api_strict``) every coefficient is then computed on the host by the same expressions in
the same precision and returned as a Python float holding that value exactly: a scalar kernel argument
instead of a chain of one-element device kernels.  On NumPy the result is what the array code gives (the
same 0-d arrays).
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat.numpy as compat_numpy
import numpy as np

from .._xp import Array, Namespace, creation_device, is_float64, sqrt

__all__ = [
    "adafactor_beta2",
    "beta_hat",
    "beta_hats",
    "clip_by_rms",
    "first_moment_decay",
    "host_step",
    "learning_rate",
    "one_minus_power",
    "relative_step",
    "rms",
]


def host_step(count: int, dtype: Any, xp: Namespace) -> np.ndarray:
    """The step ``t = count + 1`` on the host: a NumPy 0-d array of ``dtype``'s precision (float64 or float32).

    On NumPy it equals ``astype(state.count + 1, dtype)`` (the device counter's ``t``) exactly.
    """
    return np.asarray(count + 1, dtype=np.float64 if is_float64(dtype, xp) else np.float32)


def _is_numpy(xp: Namespace) -> bool:
    """``array_api_compat.is_numpy_namespace`` as an identity test: it runs several times per step, and on NumPy
    a step of a small parameter costs tens of microseconds."""
    return xp is np or xp is compat_numpy


def _host_scalars(t: Any, xp: Namespace, *numbers: Any) -> bool:
    """Whether a coefficient of host step ``t`` is computed on the host (module docstring): ``t`` is NumPy, the
    arrays are not, and every other input is a Python number (an array hyperparameter stays on its device)."""
    if _is_numpy(xp) or not isinstance(t, np.ndarray | np.generic):
        return False
    return all(isinstance(x, int | float) for x in numbers)


def _on_device(t: Any, xp: Namespace, like: Any) -> Any:
    """A host step ``t`` moved beside the array hyperparameter ``like`` (for the arithmetic that mixes them)."""
    if isinstance(t, np.ndarray | np.generic) and not _is_numpy(xp):
        return xp.asarray(float(t), dtype=like.dtype, device=creation_device(like))
    return t


def one_minus_power(beta: float, t: Array, xp: Namespace) -> Array:
    """``1 - beta^t``, computed as ``-expm1(t log beta)`` to avoid cancellation near beta = 1.

    ``beta`` may be a 0-d array (a hyperparameter traced under ``jax.jit``); then
    ``beta = 0`` is selected with ``where`` instead of a Python branch.
    """
    if _host_scalars(t, xp, beta):
        return float(one_minus_power(beta, t, np))
    if not isinstance(beta, int | float):
        t = _on_device(t, xp, beta)
        positive = beta > 0
        safe = xp.where(positive, beta, xp.ones_like(beta))  # log(0) never evaluated
        return xp.where(positive, -xp.expm1(t * xp.log(safe)), one_minus_power(0.0, t, xp))
    if beta == 0.0:
        return xp.where(t > 0, xp.ones_like(t), xp.zeros_like(t))
    return -xp.expm1(t * math.log(beta))


def beta_hat(beta: float, t: Array, xp: Namespace, *, bias_correction: bool = True) -> Array:
    """The paper's bias-corrected EMA coefficient.

    ``beta_hat_t = beta (1 - beta^(t-1)) / (1 - beta^t)``, so that
    ``M_t = beta_hat_t M_{t-1} + (1 - beta_hat_t) X_t`` equals Adam's
    bias-corrected moment ``EMA_beta(X)_t / (1 - beta^t)`` exactly.  At t = 1 it
    is 0.  With ``bias_correction=False`` it is the constant ``beta``.
    """
    if _host_scalars(t, xp, beta):
        return float(beta_hat(beta, t, np, bias_correction=bias_correction))
    if not isinstance(beta, int | float):
        t = _on_device(t, xp, beta)
    if not bias_correction:
        return xp.full_like(t, beta)
    if isinstance(beta, int | float) and beta == 0.0:  # an array beta = 0 gives 0 * 1 / 1 below
        return xp.full_like(t, beta)
    return beta * one_minus_power(beta, t - 1.0, xp) / one_minus_power(beta, t, xp)


def beta_hats(cfg: Any, t: Array, xp: Namespace) -> tuple[Array, Array]:
    """``(beta_hat_1, beta_hat_2)`` of step ``t`` for ``cfg.betas`` (:func:`beta_hat`, ``cfg.bias_correction``)."""
    return first_moment_decay(cfg, t, xp), beta_hat(cfg.betas[1], t, xp, bias_correction=cfg.bias_correction)


def first_moment_decay(cfg: Any, t: Array, xp: Namespace) -> Array:
    """``beta_hat_1`` of step ``t`` (:func:`beta_hat` of ``cfg.betas[0]``, ``cfg.bias_correction``)."""
    return beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction)


def learning_rate(cfg: Any, lr: Any) -> Any:
    """``eta``: the call's ``lr`` when given (a number or an array, e.g. scheduled or traced), else ``cfg.lr``."""
    return cfg.lr if lr is None else lr


def adafactor_beta2(t: Array, decay_rate: float, xp: Namespace) -> Array:
    """Adafactor's increasing decay ``beta2_t = 1 - t^(-c)`` (0 at t = 1), c = ``decay_rate``."""
    if _host_scalars(t, xp, decay_rate):
        return float(adafactor_beta2(t, decay_rate, np))
    if not isinstance(decay_rate, int | float):
        t = _on_device(t, xp, decay_rate)
    return -xp.expm1(-decay_rate * xp.log(t))


def relative_step(lr: Any, t: Array, xp: Namespace) -> Any:
    """Adafactor's relative step size ``rho_t = min(lr, 1 / sqrt(t))``, in ``t``'s dtype."""
    if _host_scalars(t, xp, lr):
        return float(relative_step(lr, t, np))
    if not isinstance(lr, int | float):
        t = _on_device(t, xp, lr)
    return xp.minimum(lr * xp.ones_like(t), 1.0 / sqrt(t, xp))


def rms(x: Array, xp: Namespace) -> Array:
    """Root mean square ``RMS(X) = sqrt(mean(X^2))`` over all entries; of a stack of matrices (``x.ndim > 2``,
    ``batch_dims > 0``) per matrix, shape ``(*B, 1, 1)``."""
    if x.ndim > 2:
        return sqrt(xp.mean(x * x, axis=(-2, -1), keepdims=True), xp)
    return sqrt(xp.mean(x * x), xp)


def clip_by_rms(u: Array, threshold: float | None, xp: Namespace) -> Array:
    """Adafactor's update clipping ``clip(U) = U / max(1, RMS(U) / d)`` (per matrix of a stack, :func:`rms`);
    identity when d is None."""
    if threshold is None:
        return u
    ratio = rms(u, xp) / threshold
    return u / xp.maximum(ratio, xp.ones_like(ratio))
