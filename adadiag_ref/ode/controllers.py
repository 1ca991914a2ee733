r"""Step-size controllers: a constant step, and a PI controller for embedded pairs.

A controller decides whether an attempted step is accepted and proposes the
next ``h``.  It works on host floats: the only array work is the error norm.

The PI controller (Gustafsson; Soderlind) scales the step by::

    factor = safety * err_n^(-(k_I + k_P) / q) * err_{n-1}^(k_P / q),   clipped to [factor_min, factor_max]

where ``err`` is the weighted RMS norm of the embedded error estimate,
``||y_err / (atol + rtol max(|y_0|, |y_1|))||_RMS``, ``q = error_order + 1`` and a
step is accepted iff ``err <= 1``.  After a rejection the proportional term is
dropped and the factor is capped at 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .._xp import Array, namespace, sqrt

__all__ = [
    "ConstantStepSize",
    "ControllerState",
    "Decision",
    "PIController",
    "Tolerance",
    "initial_step",
    "tolerance_array",
    "weighted_rms",
]


Tolerance = float | tuple[float, ...]
"""A scalar tolerance, or one per component of the flat state (as :func:`scipy.integrate.solve_ivp`'s ``atol``)."""


def tolerance_array(tol: Any, like: Array) -> Any:
    """``tol`` as :func:`weighted_rms` uses it: a float stays a float; a sequence becomes an array in the
    namespace and dtype of ``like``, one entry per component (``ValueError`` for another length)."""
    if isinstance(tol, int | float):
        return float(tol)
    values = np.asarray(tol, dtype=np.float64)
    if values.shape != (like.shape[-1],):
        raise ValueError(
            f"a vector tolerance needs one entry per state component ({like.shape[-1]}), got {values.shape}"
        )
    xp = namespace(like)
    return xp.asarray(values, dtype=like.dtype)


def _as_tolerance(tol: Any) -> Tolerance:
    """A float, or a tuple of floats for an array or sequence (hashable, comparable: the controller is frozen)."""
    values = np.asarray(tol, dtype=np.float64)
    return float(values) if values.ndim == 0 else tuple(float(x) for x in values.reshape(-1))


def weighted_rms(y0: Array, y1: Array, y_err: Array, rtol: Any, atol: Any) -> float:
    """``sqrt(mean((y_err / (atol + rtol max(|y0|, |y1|)))^2))``; ``rtol``, ``atol`` scalars or per component."""
    xp = namespace(y_err)
    rtol, atol = tolerance_array(rtol, y_err), tolerance_array(atol, y_err)
    scale = atol + rtol * xp.maximum(xp.abs(y0), xp.abs(y1))
    ratio = y_err / scale
    return float(sqrt(xp.mean(ratio * ratio), xp))


class ControllerState(NamedTuple):
    """The previous accepted error norm (1 at the start)."""

    prev_err: float = 1.0


class Decision(NamedTuple):
    """``accept``, the next step size, the error norm of this step and the new state."""

    accept: bool
    h_next: float
    err: float
    state: ControllerState


@dataclass(frozen=True)
class ConstantStepSize:
    """Fixed steps of size ``dt`` (``None``: the ``dt0`` given to :func:`~.integrate.integrate`)."""

    dt: float | None = None
    adaptive: bool = False

    def decide(
        self, h: float, y0: Array, y1: Array, y_err: Array | None, error_order: int | None, state: ControllerState
    ) -> Decision:
        """Always accept; keep ``h``."""
        return Decision(True, h, math.nan, state)


@dataclass(frozen=True)
class PIController:
    """Adaptive steps for embedded pairs (``Dopri5``); tolerances ``rtol``, ``atol``.

    Each tolerance is a number or one number per component of the flat state (an array or a sequence, stored
    as a tuple): the factored moments ``r``, ``s`` can fall to 1e-30 while ``W`` is about 1, so an ``atol``
    suited to one is wrong for the other.

    Defaults ``k_P = 0.4``, ``k_I = 0.3`` (divided by ``q = 5`` for DOPRI5: the
    0.14 / 0.08 exponents of Hairer and Wanner's PI variant), ``safety = 0.9``.
    """

    rtol: Tolerance = 1e-6
    atol: Tolerance = 1e-9
    pcoeff: float = 0.4
    icoeff: float = 0.3
    safety: float = 0.9
    factor_min: float = 0.2
    factor_max: float = 10.0
    dt_min: float = 0.0
    dt_max: float = math.inf
    adaptive: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "rtol", _as_tolerance(self.rtol))
        object.__setattr__(self, "atol", _as_tolerance(self.atol))
        rtol, atol = np.asarray(self.rtol), np.asarray(self.atol)
        if rtol.size > 1 and atol.size > 1 and rtol.shape != atol.shape:
            raise ValueError(f"rtol and atol have different lengths ({rtol.size} and {atol.size})")
        if not (np.all(np.isfinite(rtol)) and np.all(np.isfinite(atol))):
            raise ValueError("rtol and atol must be finite")
        if not (np.all(rtol >= 0) and np.all(atol >= 0) and np.all(rtol + atol > 0)):
            raise ValueError("rtol and atol must be >= 0 and not both 0 (in any component)")
        if not 0 < self.factor_min < 1 < self.factor_max:
            raise ValueError("need 0 < factor_min < 1 < factor_max")

    def decide(
        self, h: float, y0: Array, y1: Array, y_err: Array | None, error_order: int | None, state: ControllerState
    ) -> Decision:
        """Accept iff the weighted RMS error is <= 1 and propose the next step."""
        if y_err is None or error_order is None:
            raise ValueError("PIController needs a solver with an embedded error estimate (dopri5)")
        err = weighted_rms(y0, y1, y_err, self.rtol, self.atol)
        q = error_order + 1.0
        if not math.isfinite(err):
            return Decision(False, h * self.factor_min, err, state)
        if err <= 1.0:
            safe = max(err, 1e-10)
            factor = self.safety * safe ** (-(self.icoeff + self.pcoeff) / q) * state.prev_err ** (self.pcoeff / q)
            factor = min(self.factor_max, max(self.factor_min, factor))
            return Decision(True, min(self.dt_max, h * factor), err, ControllerState(safe))
        factor = min(1.0, max(self.factor_min, self.safety * err ** (-1.0 / q)))
        return Decision(False, h * factor, err, state)


def initial_step(
    term: Any, t0: float, y0: Array, args: Any, f0: Array, order: int, rtol: Any, atol: Any
) -> tuple[float, int]:
    r"""Starting step (Hairer, Norsett & Wanner I, II.4) and the evaluations it used.

    ``d0 = ||y0||``, ``d1 = ||f0||``, ``h0 = 0.01 d0 / d1``; one Euler step gives
    ``d2 = ||f(y0 + h0 f0) - f0|| / h0`` and ``h1 = (0.01 / max(d1, d2))^(1/(p+1))``;
    the result is ``min(100 h0, h1)``.  Norms are weighted RMS with ``atol + rtol |y0|``.
    """

    def norm(x: Array) -> float:
        return weighted_rms(y0, y0, x, rtol, atol)  # the scale atol + rtol |y0|

    d0, d1 = norm(y0), norm(f0)
    h0 = 1e-6 if d0 < 1e-5 or d1 < 1e-5 else 0.01 * d0 / d1
    f1 = term.vector_field(t0 + h0, y0 + h0 * f0, args)
    d2 = norm(f1 - f0) / h0
    h1 = max(1e-6, h0 * 1e-3) if max(d1, d2) <= 1e-15 else (0.01 / max(d1, d2)) ** (1.0 / (order + 1))
    return min(100 * h0, h1), 1
