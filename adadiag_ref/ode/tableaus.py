r"""Butcher tableaus as data.

An explicit ``s``-stage Runge-Kutta method is ``(c, A, b)``::

    k_i = f(t + c_i h, y + h sum_{j<i} A_ij k_j),     y_1 = y + h sum_i b_i k_i

An embedded pair adds ``b_err = b - b^`` (``b^`` the companion weights), so that
``y_err = h sum_i b_err_i k_i`` estimates the local error of the lower-order
solution.  ``fsal`` ("first same as last") marks a last stage evaluated at
``y_1``, whose ``k_s = f(t + h, y_1)`` is the next step's ``k_1``.

All numbers are exact rationals written as fractions of integers; the tests
check the order conditions from the rows themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DOPRI5", "DOPRI5_DENSE", "EULER", "RK4", "ROS3P", "TABLEAUS", "ButcherTableau", "RosenbrockTableau"]


@dataclass(frozen=True)
class ButcherTableau:
    """Coefficients of an explicit Runge-Kutta method.

    Attributes:
        name: short name.
        c: nodes ``c_i`` (length s).
        A: strictly lower-triangular rows ``A_i = (A_i1, ..., A_i,i-1)`` (row i has i entries, 0-based).
        b: weights of the propagated solution (order ``order``).
        b_err: ``b - b^`` for the embedded estimate (``None`` for a single method).
        order: classical order of ``b``.
        error_order: order of the embedded companion ``b^`` (``None`` without one).
        fsal: whether the last stage equals ``f(t + h, y_1)``.
        b_dense: weights ``d_i`` of a 4th-order continuous extension of the DOPRI5 form
            (:data:`DOPRI5_DENSE`); ``None``: the solver interpolates by cubic Hermite.
    """

    name: str
    c: tuple[float, ...]
    A: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    b_err: tuple[float, ...] | None
    order: int
    error_order: int | None = None
    fsal: bool = False
    b_dense: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        s = len(self.c)
        if len(self.A) != s or any(len(row) != i for i, row in enumerate(self.A)):
            raise ValueError(f"{self.name}: A must have rows of lengths 0, 1, ..., {s - 1}")
        if any(w is not None and len(w) != s for w in (self.b, self.b_err, self.b_dense)):
            raise ValueError(f"{self.name}: b, b_err and b_dense must have {s} entries")

    @property
    def stages(self) -> int:
        """Number of stages ``s``."""
        return len(self.c)


EULER = ButcherTableau(name="euler", c=(0.0,), A=((),), b=(1.0,), b_err=None, order=1)
"""Explicit Euler: ``y_1 = y + h f(t, y)``."""

RK4 = ButcherTableau(
    name="rk4",
    c=(0.0, 1 / 2, 1 / 2, 1.0),
    A=((), (1 / 2,), (0.0, 1 / 2), (0.0, 0.0, 1.0)),
    b=(1 / 6, 1 / 3, 1 / 3, 1 / 6),
    b_err=None,
    order=4,
)
"""The classical fourth-order Runge-Kutta method."""

_DP_B = (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0)
_DP_B4 = (5179 / 57600, 0.0, 7571 / 16695, 393 / 640, -92097 / 339200, 187 / 2100, 1 / 40)

DOPRI5_DENSE = (
    -12715105075 / 11282082432,
    0.0,
    87487479700 / 32700410799,
    -10690763975 / 1880347072,
    701980252875 / 199316789632,
    -1453857185 / 822651844,
    69997945 / 29380423,
)
"""Weights ``d_i`` of the 4th-order continuous extension of DOPRI5 (Hairer, Norsett & Wanner, II.6).

With ``theta in [0, 1]``, ``y(t + theta h) = y0 + theta (dy + (1 - theta)(e1 + theta (e2 + (1 - theta) e3)))``
where ``dy = y1 - y0``, ``e1 = h k1 - dy``, ``e2 = dy - h k7 - e1`` and ``e3 = h sum_i d_i k_i``.
"""

DOPRI5 = ButcherTableau(
    name="dopri5",
    c=(0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0),
    A=(
        (),
        (1 / 5,),
        (3 / 40, 9 / 40),
        (44 / 45, -56 / 15, 32 / 9),
        (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
        (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
        _DP_B[:6],
    ),
    b=_DP_B,
    b_err=tuple(x - y for x, y in zip(_DP_B, _DP_B4, strict=True)),
    order=5,
    error_order=4,
    fsal=True,
    b_dense=DOPRI5_DENSE,
)
"""Dormand-Prince 5(4) (Dormand & Prince 1980): propagates the 5th-order solution."""

TABLEAUS: dict[str, ButcherTableau] = {t.name: t for t in (EULER, RK4, DOPRI5)}


@dataclass(frozen=True)
class RosenbrockTableau:
    r"""Coefficients of a Rosenbrock method in Hairer and Wanner's form (Solving ODEs II, IV.7, (7.25)).

    With ``J = df/dy(t, y)`` and ``f_t = df/dt(t, y)`` the stages solve linear systems (no Newton iteration)::

        (I / (h gamma) - J) u_i = f(t + alpha_i h, y + sum_{j<i} A_ij u_j) + sum_{j<i} (C_ij / h) u_j + gamma_i h f_t
        y_1 = y + sum_i m_i u_i,        y^_1 = y + sum_i m_hat_i u_i  (the embedded solution)

    Attributes:
        name: short name; order: classical order of ``y_1``; error_order: that of ``y^_1``.
        gamma: the diagonal ``gamma`` (one LU per step); gamma_sum: ``gamma_i`` of the ``f_t`` term.
        alpha: nodes ``alpha_i``; A, C: strictly lower-triangular rows (row i has i entries, 0-based).
        m, m_hat: weights of the solution and of its embedded companion.
    """

    name: str
    order: int
    error_order: int
    gamma: float
    gamma_sum: tuple[float, ...]
    alpha: tuple[float, ...]
    A: tuple[tuple[float, ...], ...]
    C: tuple[tuple[float, ...], ...]
    m: tuple[float, ...]
    m_hat: tuple[float, ...]

    @property
    def stages(self) -> int:
        """Number of stages ``s``."""
        return len(self.m)


_ROOT3 = math.sqrt(3.0)
_G = 0.5 + _ROOT3 / 6.0

ROS3P = RosenbrockTableau(
    name="ros3p",
    order=3,
    error_order=2,
    gamma=_G,
    gamma_sum=(_G, _G - 1.0, -(0.5 + _ROOT3 / 3.0)),
    alpha=(0.0, 1.0, 1.0),
    A=((), (1.0 / _G,), (1.0 / _G, 0.0)),
    C=((), (-1.0 / _G**2,), (-2.0 * _ROOT3, -_ROOT3)),
    m=(2.0, 1.0 / _ROOT3, 1.0 - 1.0 / _ROOT3),
    m_hat=(5.0 - 5.0 / _ROOT3, 1.0, 1.0 - 1.0 / _ROOT3),
)
"""ROS3P (Lang and Verwer, BIT 41, 2001): third order, A-stable, three stages, an embedded second-order
solution; ``gamma = 1/2 + sqrt(3)/6``.  A Rosenbrock method, so it wants the exact Jacobian (the solver forms
it by finite differences to ~1e-8, which keeps order 3 at the step sizes of a 1e-8 tolerance; tested against
:func:`scipy.integrate.solve_ivp`)."""
