"""Scalar schedules and the small shared pieces of the update rules.

All functions take the step ``t`` (1, 2, ...) as a floating array so that they
trace under ``jax.jit``; none converts a device array to a Python number.

**One rule for every step coefficient** (docs/spec.md, "The step's coefficients").  ``beta_hat_t``, ``1 - beta^t``,
Adafactor's ``beta2_t`` and relative step are computed

- from a **host counter** (a Python number, a NumPy array, or a 0-d CPU torch tensor outside a traced graph:
  :func:`host_step`, ``state.count`` on NumPy or on CPU torch) **in float64 by Python's** :mod:`math` (the C
  library's scalar routines, which no SIMD dispatch of NumPy, torch or numba reaches) and rounded **once** to
  ``t``'s dtype, the state dtype.  The same float on every backend, route and processor: on NumPy a 0-d array of
  that dtype, elsewhere a Python float holding that value exactly (a scalar kernel argument);
- from a **device or traced counter** (JAX under ``jit``, a CUDA tensor) by the same expressions in float64 where
  the backend has it (everywhere but JAX without ``jax_enable_x64`` and Apple's MPS), rounded once to the state
  dtype.  The device's ``expm1``/``log`` may differ from the C library's by an ulp of float64, so the result equals
  the host's after the rounding to float32 but only within an ulp in float64; without float64, in the state dtype.

``1 - beta_hat_t`` is computed from the rounded ``beta_hat_t`` (exact in float64, rounded once; exact in the state
dtype too when ``beta_hat_t >= 1/2``), so every route forms the same complement.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat.numpy as compat_numpy
import numpy as np

from .._xp import Array, Namespace, creation_device, sqrt

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
    return np.asarray(count + 1, dtype=np.float64 if dtype == xp.float64 else np.float32)


def _is_numpy(xp: Namespace) -> bool:
    """``array_api_compat.is_numpy_namespace`` as an identity test: it runs several times per step, and on NumPy
    a step of a small parameter costs tens of microseconds."""
    return xp is np or xp is compat_numpy


def _host_value(t: Any) -> float | None:
    """The step ``t`` as a Python float when it is a host counter (module docstring), else ``None``."""
    if isinstance(t, int | float | np.ndarray | np.generic):
        return float(t)
    module = type(t).__module__
    if module.startswith("torch") and t.device.type == "cpu" and t.ndim == 0:
        import torch

        if not torch.compiler.is_compiling():
            try:
                return float(t.detach().numpy())  # read from host memory: no aten dispatch, no synchronisation
            except RuntimeError:  # a tensor with no host memory of its own (a functorch wrapper): the device path
                return None
    return None


def _host_dtype(t: Any) -> Any:
    """The NumPy dtype a host coefficient of ``t`` is rounded to: ``t``'s precision (float64 for a Python number)."""
    if isinstance(t, np.ndarray | np.generic):
        return np.float32 if t.dtype == np.float32 else np.float64
    dtype = getattr(t, "dtype", None)
    return np.float32 if dtype is not None and "float32" in str(dtype) else np.float64


def _host_coefficient(value64: float, t: Any, xp: Namespace) -> Any:
    """A coefficient computed in float64 on the host, rounded once to ``t``'s dtype: a 0-d NumPy array on NumPy,
    else a Python float holding the rounded value exactly."""
    dtype = getattr(t, "dtype", None)
    if type(t).__module__.startswith("torch") and str(dtype) not in ("torch.float32", "torch.float64"):
        import torch  # a half-precision state: NumPy has no bfloat16; torch rounds the float64 value once

        return float(torch.tensor(value64, dtype=dtype))
    rounded = np.asarray(value64, dtype=_host_dtype(t))
    return rounded if _is_numpy(xp) else float(rounded)


def _has_float64(t: Any, xp: Namespace) -> bool:
    """Whether ``t``'s backend computes in float64: not JAX without ``jax_enable_x64``, not torch on MPS."""
    module = type(t).__module__
    if module.startswith("jax"):
        import jax

        return bool(jax.config.read("jax_enable_x64"))
    if module.startswith("torch"):
        return t.device.type != "mps"
    return hasattr(xp, "float64")


def _on_device(t: Any, xp: Namespace, like: Any) -> Any:
    """A host step ``t`` moved beside the array hyperparameter ``like`` (for the arithmetic that mixes them)."""
    if isinstance(t, np.ndarray | np.generic) and not _is_numpy(xp):
        return xp.asarray(float(t), dtype=like.dtype, device=creation_device(like))
    return t


def _in_float64(expression: Any, t: Any, xp: Namespace) -> Any:
    """``expression(t64)`` on the device in float64 where the backend has it, rounded once to ``t``'s dtype."""
    if not _has_float64(t, xp) or t.dtype == xp.float64:
        return expression(t)
    return xp.astype(expression(xp.astype(t, xp.float64)), t.dtype)


def _one_minus_power64(beta: float, t: float) -> float:
    """``1 - beta^t = -expm1(t log beta)`` in float64 by :mod:`math` (0 < beta < 1; 1 at beta = 0, t > 0)."""
    if beta == 0.0:
        return 1.0 if t > 0 else 0.0
    return -math.expm1(t * math.log(beta))


def _beta_hat64(beta: float, t: float, bias_correction: bool) -> float:
    """``beta (1 - beta^(t-1)) / (1 - beta^t)`` (or ``beta`` without bias correction) in float64."""
    if not bias_correction or beta == 0.0:
        return float(beta)
    return beta * _one_minus_power64(beta, t - 1.0) / _one_minus_power64(beta, t)


def one_minus_power(beta: float, t: Array, xp: Namespace) -> Array:
    """``1 - beta^t``, computed as ``-expm1(t log beta)`` to avoid cancellation near beta = 1.

    ``beta`` may be a 0-d array (a hyperparameter traced under ``jax.jit``); then
    ``beta = 0`` is selected with ``where`` instead of a Python branch.  Host ``t``: float64, rounded once
    (module docstring).
    """
    host = _host_value(t)
    if host is not None and isinstance(beta, int | float):
        return _host_coefficient(_one_minus_power64(beta, host), t, xp)
    if not isinstance(beta, int | float):
        t = _on_device(t, xp, beta)
        positive = beta > 0
        safe = xp.where(positive, beta, xp.ones_like(beta))  # log(0) never evaluated
        return xp.where(positive, -xp.expm1(t * xp.log(safe)), one_minus_power(0.0, t, xp))
    if beta == 0.0:
        return xp.where(t > 0, xp.ones_like(t), xp.zeros_like(t))
    return _in_float64(lambda s: -xp.expm1(s * math.log(beta)), t, xp)


def beta_hat(beta: float, t: Array, xp: Namespace, *, bias_correction: bool = True) -> Array:
    """The paper's bias-corrected EMA coefficient.

    ``beta_hat_t = beta (1 - beta^(t-1)) / (1 - beta^t)``, so that
    ``M_t = beta_hat_t M_{t-1} + (1 - beta_hat_t) X_t`` equals Adam's
    bias-corrected moment ``EMA_beta(X)_t / (1 - beta^t)`` exactly.  At t = 1 it
    is 0.  With ``bias_correction=False`` it is the constant ``beta``.  Host ``t``: the whole expression in
    float64, rounded once to the state dtype (module docstring).
    """
    host = _host_value(t)
    if host is not None and isinstance(beta, int | float):
        return _host_coefficient(_beta_hat64(beta, host, bias_correction), t, xp)
    if not isinstance(beta, int | float):
        t = _on_device(t, xp, beta)
    if not bias_correction:
        return xp.full_like(t, beta)
    if isinstance(beta, int | float):
        if beta == 0.0:  # an array beta = 0 gives 0 * 1 / 1 below
            return xp.full_like(t, beta)
        log_beta = math.log(beta)
        return _in_float64(lambda s: beta * -xp.expm1((s - 1.0) * log_beta) / -xp.expm1(s * log_beta), t, xp)
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
    """Adafactor's increasing decay ``beta2_t = 1 - t^(-c)`` (0 at t = 1), c = ``decay_rate``; host ``t``: in
    float64, rounded once (module docstring)."""
    host = _host_value(t)
    if host is not None and isinstance(decay_rate, int | float):
        return _host_coefficient(-math.expm1(-decay_rate * math.log(host)), t, xp)
    if not isinstance(decay_rate, int | float):
        t = _on_device(t, xp, decay_rate)
        return -xp.expm1(-decay_rate * xp.log(t))
    return _in_float64(lambda s: -xp.expm1(-decay_rate * xp.log(s)), t, xp)


def relative_step(lr: Any, t: Array, xp: Namespace) -> Any:
    """Adafactor's relative step size ``rho_t = min(lr, 1 / sqrt(t))``, in ``t``'s dtype; host ``t``: in float64
    (``math.sqrt`` is correctly rounded), rounded once (module docstring)."""
    host = _host_value(t)
    if host is not None and isinstance(lr, int | float):
        return _host_coefficient(min(float(lr), 1.0 / math.sqrt(host)), t, xp)
    if not isinstance(lr, int | float):
        t = _on_device(t, xp, lr)
        return xp.minimum(lr * xp.ones_like(t), 1.0 / sqrt(t, xp))
    return _in_float64(lambda s: xp.minimum(lr * xp.ones_like(s), 1.0 / sqrt(s, xp)), t, xp)


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
