r"""Reference solutions from :func:`scipy.integrate.solve_ivp` and the observed order of a solver.

The reference integrates the same term on the host (NumPy float64) with DOP853
at tight tolerances, piece by piece between basis refreshes, recomputing the
basis from its *own* ``W(t_k)`` at each refresh, exactly as :func:`~.integrate.integrate`
does.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .._xp import Array, namespace, to_numpy
from .controllers import ConstantStepSize
from .integrate import BasisSchedule, SaveAt, _pieces, integrate
from .solvers import Solver

__all__ = ["OrderResult", "ReferenceResult", "StepLimitError", "observed_order", "reference_solution"]


class StepLimitError(RuntimeError):
    """An integration of the order measurement would take more than ``max_steps`` steps."""


class ReferenceResult(NamedTuple):
    """Host ``y(t1)`` of the reference, the method used and its evaluation count."""

    y_final: np.ndarray
    method: str
    n_evals: int


def reference_solution(
    term: Any,
    t0: float,
    t1: float,
    y0: Array,
    args: Any = None,
    *,
    basis_schedule: BasisSchedule | None = None,
    rtol: float = 1e-13,
    atol: float = 1e-13,
    method: str = "DOP853",
    max_steps: int | None = None,
) -> ReferenceResult:
    """``y(t1)`` by ``scipy.integrate.solve_ivp(method=method)``, piecewise between refreshes.

    The term is evaluated in the namespace of ``y0`` (arrays are moved to the host
    and back at every evaluation).  ``max_steps`` bounds the work: more than
    ``12 * max_steps`` evaluations (DOP853 takes 12 per step) raise :class:`StepLimitError`.
    """
    from scipy.integrate import solve_ivp  # here: scipy.integrate costs ~0.2 s to import, most runs never need it

    xp = namespace(y0)
    y = np.asarray(to_numpy(y0), dtype=np.float64)  # solve_ivp works in float64 on the host
    evals = 0
    eval_limit = None if max_steps is None else 12 * max_steps
    for a, b, refresh in _pieces(float(t0), float(t1), basis_schedule):
        if refresh:
            args = term.refresh(a, xp.asarray(y), args)
        piece_args = args

        def fun(t: float, yh: np.ndarray, piece_args: Any = piece_args) -> np.ndarray:
            nonlocal evals
            evals += 1
            if eval_limit is not None and evals > eval_limit:
                raise StepLimitError(f"the reference {method} needs more than {eval_limit} evaluations (max_steps)")
            return np.asarray(to_numpy(term.vector_field(t, xp.asarray(yh), piece_args)), dtype=np.float64)

        out = solve_ivp(fun, (a, b), y, method=method, rtol=rtol, atol=atol)
        if not out.success:
            raise RuntimeError(f"reference {method} failed on [{a}, {b}]: {out.message}")
        y = np.asarray(out.y[:, -1], dtype=np.float64)
    return ReferenceResult(y, method, evals)


class OrderResult(NamedTuple):
    """Errors at ``t1`` against the reference for step sizes ``dts``, and the fitted slope."""

    dts: np.ndarray
    errors: np.ndarray
    slope: float
    reference: str


def observed_order(
    term: Any,
    solver: Solver,
    t0: float,
    t1: float,
    y0: Array,
    args: Any = None,
    *,
    dt0: float,
    n_halvings: int = 4,
    basis_schedule: BasisSchedule | None = None,
    reference: np.ndarray | None = None,
    max_steps: int | None = None,
) -> OrderResult:
    r"""Slope of ``log(error)`` against ``log(h)`` over ``n_halvings`` halvings of ``dt0``.

    ``error(h) = max_i |y_h(t1) - y_ref(t1)|_i`` with fixed steps ``h = dt0 / 2^k``,
    ``k = 0..n_halvings``; the slope is the least-squares fit through all points.
    ``reference`` defaults to :func:`reference_solution` (DOP853, tolerances 1e-13).
    ``max_steps`` bounds every integration: when the finest run needs
    ``ceil((t1 - t0) 2^n_halvings / dt0)`` steps more than that, or the reference
    more than its share, :class:`StepLimitError` is raised before that run starts.
    """
    finest = math.ceil((float(t1) - float(t0)) / (dt0 / 2**n_halvings) - 1e-9)
    if max_steps is not None and finest > max_steps:
        raise StepLimitError(f"its finest fixed-step run needs {finest} steps, more than max_steps = {max_steps}")
    method = "given"
    if reference is None:
        ref = reference_solution(term, t0, t1, y0, args, basis_schedule=basis_schedule, max_steps=max_steps)
        reference, method = ref.y_final, ref.method
    dts, errors = [], []
    for k in range(n_halvings + 1):
        dt = dt0 / 2**k
        sol = integrate(
            term,
            solver,
            t0,
            t1,
            y0,
            args,
            controller=ConstantStepSize(dt),
            saveat=SaveAt(steps=False),
            basis_schedule=basis_schedule,
        )
        dts.append(dt)
        errors.append(float(np.max(np.abs(to_numpy(sol.y_final) - reference))))
    d, e = np.log(np.asarray(dts)), np.log(np.maximum(np.asarray(errors), 1e-300))
    slope = float(np.polyfit(d, e, 1)[0]) if all(math.isfinite(x) for x in e) else math.nan
    return OrderResult(np.asarray(dts), np.asarray(errors), slope, method)
