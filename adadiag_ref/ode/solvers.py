r"""One-step solvers: explicit Runge-Kutta from a tableau, and semi-implicit Euler.

A solver advances ``y(t)`` to ``y(t + h)`` and nothing else: accepting steps and
choosing ``h`` is the controller's job (:mod:`.controllers`), looping and
saving is :func:`~.integrate.integrate`'s.

* :func:`rk_step` is the one pure Runge-Kutta step, for any :class:`~.tableaus.ButcherTableau`.
* :class:`ExplicitRK` wraps it (``Euler``, ``RK4``, ``Dopri5``) with the
  first-same-as-last re-use of ``f(t + h, y_1)`` and a dense interpolant.
* :class:`SemiImplicitEuler` is the discrete optimizer itself (see its docstring).
* :class:`Rosenbrock` (``Ros3p``) is linearly implicit, for stiff settings (Hfac, a large ``a``):
  one Jacobian and one linear solve per stage, no Newton iteration.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._xp import Array, namespace
from .tableaus import DOPRI5, EULER, RK4, ROS3P, ButcherTableau, RosenbrockTableau

__all__ = [
    "SOLVERS",
    "DenseStep",
    "Dopri5",
    "Euler",
    "ExplicitRK",
    "RK4Solver",
    "RKStep",
    "Ros3p",
    "Rosenbrock",
    "SemiImplicitEuler",
    "Solver",
    "StepOutput",
    "interpolate",
    "jacobian",
    "make_solver",
    "rk_step",
]

VectorField = Callable[[float, Array, Any], Array]


class RKStep(NamedTuple):
    """Result of :func:`rk_step`: ``y_1``, the embedded error estimate (or ``None``) and the stages."""

    y1: Array
    y_err: Array | None
    ks: tuple[Array, ...]


def _combine(base: Array, h: float, weights: tuple[float, ...], ks: list[Array]) -> Array:
    """``base + h sum_i w_i k_i``, summed in stage order, zero weights skipped (a row of ``A`` may be shorter)."""
    out = base
    for w, k in zip(weights, ks, strict=False):
        if w != 0.0:
            out = out + (h * w) * k
    return out


def rk_step(
    f: VectorField, t: float, y: Array, h: float, args: Any, tableau: ButcherTableau, k1: Array | None = None
) -> RKStep:
    r"""One explicit Runge-Kutta step (pure)::

        k_i = f(t + c_i h, y + h sum_{j<i} A_ij k_j),   y_1 = y + h sum_i b_i k_i,
        y_err = h sum_i b_err_i k_i

    ``k1 = f(t, y)`` may be supplied (first-same-as-last re-use).  Zero
    coefficients are skipped, so the arithmetic is exactly the tableau's.
    """
    ks: list[Array] = []
    for i, (ci, row) in enumerate(zip(tableau.c, tableau.A, strict=True)):
        if i == 0 and k1 is not None:
            ks.append(k1)
            continue
        ks.append(f(t + ci * h, _combine(y, h, row, ks), args))
    y1 = _combine(y, h, tableau.b, ks)
    y_err = None if tableau.b_err is None else _combine(namespace(y).zeros_like(y), h, tableau.b_err, ks)
    return RKStep(y1, y_err, tuple(ks))


class DenseStep(NamedTuple):
    """Interpolation data of one step on ``[t0, t0 + h]``.

    ``kind`` is ``"linear"`` (coeffs ``y0, y1``), ``"hermite"`` (cubic Hermite,
    coeffs ``y0, y1, h f0, h f1``) or ``"dopri5"`` (the 4th-order continuous
    extension, coeffs ``y0, dy, e1, e2, e3``; see :data:`~.tableaus.DOPRI5_DENSE`).
    """

    kind: str
    t0: float
    h: float
    coeffs: tuple[Array, ...]


def interpolate(dense: DenseStep, t: float) -> Array:
    """``y(t)`` for ``t`` in ``[t0, t0 + h]`` from one step's :class:`DenseStep`."""
    theta = (t - dense.t0) / dense.h if dense.h else 1.0
    if dense.kind == "linear":
        y0, y1 = dense.coeffs
        return y0 + theta * (y1 - y0)
    if dense.kind == "hermite":
        y0, y1, hf0, hf1 = dense.coeffs
        t2, t3 = theta * theta, theta * theta * theta
        return (2 * t3 - 3 * t2 + 1) * y0 + (t3 - 2 * t2 + theta) * hf0 + (3 * t2 - 2 * t3) * y1 + (t3 - t2) * hf1
    y0, dy, e1, e2, e3 = dense.coeffs
    rest = 1.0 - theta
    return y0 + theta * (dy + rest * (e1 + theta * (e2 + rest * e3)))


class StepOutput(NamedTuple):
    """One attempted step.

    ``carry`` is for the next step from ``y1`` if this one is accepted, ``retry_carry``
    for another attempt from the same ``y`` if it is rejected (``f(t, y)`` is not recomputed).
    """

    y1: Array
    y_err: Array | None
    dense: DenseStep
    carry: Any
    n_evals: int
    retry_carry: Any = None


class Solver:
    """Interface of a one-step method.

    ``init(term, t0, y0, args)`` returns the carry for the first step (``None``
    works for every solver here); ``step(term, t, y, h, args, carry)`` returns a
    :class:`StepOutput`.  ``carry`` must be re-initialised after ``args``
    change (a basis refresh).  ``order`` is the global order, ``error_order``
    that of an embedded estimate (``None`` when there is none).
    """

    name: str = "solver"
    order: int = 0
    error_order: int | None = None

    def init(self, term: Any, t0: float, y0: Array, args: Any) -> Any:
        """Carry for the first step."""
        return None

    def step(self, term: Any, t: float, y: Array, h: float, args: Any, carry: Any) -> StepOutput:
        """Advance from ``(t, y)`` by ``h``."""
        raise NotImplementedError


class TableauSolver(Solver):
    """A solver defined by a tableau held as data (``self.tableau``): its name and orders are the tableau's."""

    tableau: Any

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.tableau.name

    @property
    def order(self) -> int:  # type: ignore[override]
        return self.tableau.order

    @property
    def error_order(self) -> int | None:  # type: ignore[override]
        return self.tableau.error_order


@dataclass(frozen=True)
class ExplicitRK(TableauSolver):
    """An explicit Runge-Kutta method given by its tableau.

    The carry is ``f(t, y)`` at the current point: after an accepted step it is
    ``f(t + h, y_1)``, the last stage for a first-same-as-last tableau, else one
    extra evaluation, which also gives the cubic Hermite interpolant its end slope.
    So ``n`` fixed steps of an ``s``-stage non-FSAL method cost ``s n + 1`` evaluations.
    """

    tableau: ButcherTableau

    def step(self, term: Any, t: float, y: Array, h: float, args: Any, carry: Any) -> StepOutput:
        """``rk_step`` plus ``f(t + h, y_1)`` for the next step and the interpolant."""
        k1 = carry
        evals = self.tableau.stages - (1 if k1 is not None else 0)
        out = rk_step(term.vector_field, t, y, h, args, self.tableau, k1)
        if self.tableau.fsal:
            f1 = out.ks[-1]
        else:
            f1 = term.vector_field(t + h, out.y1, args)
            evals += 1
        if self.tableau.b_dense is not None:
            dy = out.y1 - y
            e1 = h * out.ks[0] - dy
            e2 = dy - h * f1 - e1
            e3 = _combine(namespace(y).zeros_like(y), h, self.tableau.b_dense, list(out.ks))
            dense = DenseStep("dopri5", t, h, (y, dy, e1, e2, e3))
        else:
            dense = DenseStep("hermite", t, h, (y, out.y1, h * out.ks[0], h * f1))
        return StepOutput(out.y1, out.y_err, dense, f1, evals, out.ks[0])


def Euler() -> ExplicitRK:
    """Explicit Euler, ``y_1 = y + h f(t, y)`` (order 1)."""
    return ExplicitRK(EULER)


def RK4Solver() -> ExplicitRK:
    """The classical Runge-Kutta method (order 4)."""
    return ExplicitRK(RK4)


def Dopri5() -> ExplicitRK:
    """Dormand-Prince 5(4) with its 4th-order dense output; use with a :class:`~.controllers.PIController`."""
    return ExplicitRK(DOPRI5)


@dataclass(frozen=True)
class SemiImplicitEuler(Solver):
    r"""Semi-implicit (symplectic-style, Gauss-Seidel) Euler over the system's blocks.

    With ``G_k = grad L(W_k)`` evaluated once, the blocks of
    :func:`~.systems.update_order` are advanced in turn, each by explicit Euler
    with the newest values of the blocks before it::

        V_{k+1} = V_k + h b (G~_k^2 - V_k)          = beta_2 V_k + (1 - beta_2) G~_k^2
        M_{k+1} = M_k + h a (G~_k - M_k)            = beta_1 M_k + (1 - beta_1) G~_k
        W_{k+1} = W_k - h (P M_{k+1} / (sqrt(V_{k+1}) + eps) + lambda W_k)

    which is the discrete optimizer with ``eta = h``, ``beta_1 = 1 - a h``,
    ``beta_2 = 1 - b h`` and no bias correction, to rounding.  First order.
    Needs a :class:`~.terms.SystemTerm` (it uses the system's block structure).
    """

    name: str = "semi_implicit_euler"
    order: int = 1
    error_order: int | None = None

    def init(self, term: Any, t0: float, y0: Array, args: Any) -> Any:
        """The blocks of ``term``, in update order."""
        if not hasattr(term, "blocks"):
            raise TypeError("SemiImplicitEuler needs a SystemTerm (a system with an update order)")
        return term.blocks()

    def step(self, term: Any, t: float, y: Array, h: float, args: Any, carry: Any) -> StepOutput:
        """One discrete optimizer update: one gradient, then the blocks in order."""
        blocks = carry if carry is not None else self.init(term, t, y, args)
        grads = term.gradients(t, y, args)
        y0 = y
        for block in blocks:
            y = y + h * term.field_given_gradients(t, y, grads, args, block)
        return StepOutput(y, None, DenseStep("linear", t, h, (y0, y)), blocks, 1, blocks)


_SQRT_EPS = math.sqrt(2.0**-52)


def jacobian(term: Any, t: float, y: Array, args: Any, f0: Array) -> tuple[Array, int]:
    r"""``J = df/dy`` at ``(t, y)`` and the evaluations used: ``term.jacobian(t, y, args)`` when the term has one
    (0 evaluations), else forward differences, column ``j`` from ``y + d_j e_j`` with
    ``d_j = sqrt(eps) max(|y_j|, 1e-8 ||y||_inf)`` (relative to the entry, so a moment of size 1e-30 next to a
    parameter of size 1 is differenced at its own scale; the floor for an entry at 0)."""
    exact = getattr(term, "jacobian", None)
    if exact is not None:
        return exact(t, y, args), 0
    xp = namespace(y)
    n = y.shape[0]
    floor = 1e-8 * float(xp.max(xp.abs(y)))
    eye = xp.eye(n, dtype=y.dtype)
    columns = []
    for j in range(n):
        d = _SQRT_EPS * max(abs(float(y[j])), floor, 1e-300)
        columns.append((term.vector_field(t, y + d * eye[j], args) - f0) / d)
    return xp.stack(columns, axis=1), n


@dataclass(frozen=True)
class Rosenbrock(TableauSolver):
    r"""A Rosenbrock method (:class:`~.tableaus.RosenbrockTableau`): linearly implicit, for stiff systems.

    Per step: ``J`` (:func:`jacobian`: ``dim`` evaluations by finite differences), ``f_t`` by a forward
    difference in ``t`` unless ``term.autonomous`` (1), one evaluation per stage after the first (the
    first is the carried ``f(t, y)``) and ``f(t + h, y_1)`` for the cubic Hermite interpolant and the next step
    (1).  A rejected step is retried with the same ``J`` and ``f_t``.  ``y_err = y_1 - y^_1``, so a
    :class:`~.controllers.PIController` adapts the step.  A-stable: the step follows the accuracy, not the
    stiffness (Hfac to T = 20: 28,853 DOPRI5 steps, 2,747 ROS3P steps; docs/ode.md).
    """

    tableau: RosenbrockTableau

    def step(self, term: Any, t: float, y: Array, h: float, args: Any, carry: Any) -> StepOutput:
        """One step of the tableau from ``(t, y)``; ``carry`` is ``f(t, y)`` or ``(f(t, y), J, f_t)``."""
        xp = namespace(y)
        tab = self.tableau
        evals = 0
        if isinstance(carry, tuple):
            f0, J, f_t = carry
        else:
            f0 = carry
            if f0 is None:
                f0 = term.vector_field(t, y, args)
                evals += 1
            J, used = jacobian(term, t, y, args, f0)
            evals += used
            if getattr(term, "autonomous", False):
                f_t = xp.zeros_like(y)
            else:
                dt = _SQRT_EPS * max(abs(t), 1.0)
                f_t = (term.vector_field(t + dt, y, args) - f0) / dt
                evals += 1
        G = xp.eye(y.shape[0], dtype=y.dtype) / (h * tab.gamma) - J
        us: list[Array] = []
        for i in range(tab.stages):
            if i == 0:
                fi = f0
            else:
                fi = term.vector_field(t + tab.alpha[i] * h, _combine(y, 1.0, tab.A[i], us), args)
                evals += 1
            rhs = fi + _combine(xp.zeros_like(y), 1.0 / h, tab.C[i], us) + (tab.gamma_sum[i] * h) * f_t
            us.append(xp.linalg.solve(G, rhs))
        y1 = _combine(y, 1.0, tab.m, us)
        y_err = _combine(xp.zeros_like(y), 1.0, tuple(a - b for a, b in zip(tab.m, tab.m_hat, strict=True)), us)
        f1 = term.vector_field(t + h, y1, args)
        evals += 1
        dense = DenseStep("hermite", t, h, (y, y1, h * f0, h * f1))
        return StepOutput(y1, y_err, dense, f1, evals, (f0, J, f_t))


def Ros3p() -> Rosenbrock:
    """ROS3P, third order with an embedded second-order estimate (:data:`~.tableaus.ROS3P`); use with a
    :class:`~.controllers.PIController` on stiff systems."""
    return Rosenbrock(ROS3P)


SOLVERS: dict[str, Callable[[], Solver]] = {
    "euler": Euler,
    "semi_implicit_euler": SemiImplicitEuler,
    "rk4": RK4Solver,
    "dopri5": Dopri5,
    "ros3p": Ros3p,
}

_SOLVER_ALIASES = {
    "sie": "semi_implicit_euler",
    "semi-implicit-euler": "semi_implicit_euler",
    "dp5": "dopri5",
    "dopri": "dopri5",
}


def make_solver(name: str) -> Solver:
    """The solver called ``name``: ``euler``, ``semi_implicit_euler`` (``sie``), ``rk4``, ``dopri5`` (``dp5``),
    ``ros3p`` (implicit, for stiff systems)."""
    key = _SOLVER_ALIASES.get(name, name)
    if key not in SOLVERS:
        raise ValueError(f"unknown integrator {name!r}; choose one of {', '.join(SOLVERS)}")
    return SOLVERS[key]()
