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

__all__ = ["REFERENCE_TOL", "OrderResult", "ReferenceResult", "StepLimitError", "observed_order", "reference_solution"]


REFERENCE_TOL = 1e-13
"""``rtol`` and ``atol`` of :func:`reference_solution`'s DOP853 by default."""


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
    rtol: float = REFERENCE_TOL,
    atol: float = REFERENCE_TOL,
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
    """Errors at ``t1`` against the reference for step sizes ``dts``, and the fitted slope.

    Attributes:
        dts: every step size tried, largest first; errors: ``max_i |y_h(t1) - y_ref(t1)|_i`` for each (NaN where
            the run blew up or stopped early).
        slope: the least-squares slope over the fitted points (NaN when fewer than two are usable).
        reference: the reference's method (``"given"`` for a supplied one).
        fit_range: ``(largest, smallest)`` step of the fitted points (NaNs when none).
        refused: the steps left out of the fit: blown up (non-finite), or at the rounding floor.
        local_slopes: slopes between consecutive step sizes (the trend the fit summarises).
    """

    dts: np.ndarray
    errors: np.ndarray
    slope: float
    reference: str
    fit_range: tuple[float, float] = (math.nan, math.nan)
    refused: tuple[float, ...] = ()
    local_slopes: np.ndarray = np.zeros(0)


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
    fit_points: int = 3,
    basis_schedule: BasisSchedule | None = None,
    reference: np.ndarray | None = None,
    max_steps: int | None = None,
) -> OrderResult:
    r"""Slope of ``log(error)`` against ``log(h)`` over ``n_halvings`` halvings of ``dt0``.

    ``error(h) = max_i |y_h(t1) - y_ref(t1)|_i`` with fixed steps ``h = dt0 / 2^k``, ``k = 0..n_halvings``.
    The slope is the least-squares fit through the ``fit_points`` finest *usable* points: a run that blew up
    (non-finite, or stopped early) or an error at the reference's accuracy (``<= 100 * 1e-13 max(1, |y_ref|)``)
    is refused (``OrderResult.refused``), and the coarsest points, the least asymptotic, are left out beyond
    ``fit_points``; ``fit_range`` says which steps were fitted.  (DOPRI5 from ``dt0 = 1/10`` on the least-squares
    problem: 5.95 fitted through all five points for Adam, the last one at the reference's accuracy; 5.3 through
    the usable finest three.)  ``reference`` defaults to :func:`reference_solution` (DOP853, tolerances 1e-13).
    ``max_steps`` bounds every integration: when the finest run needs
    ``ceil((t1 - t0) 2^n_halvings / dt0)`` steps more than that, or the reference
    more than its share, :class:`StepLimitError` is raised before that run starts.
    """
    if fit_points < 2:
        raise ValueError(f"fit_points must be >= 2, got {fit_points!r}")
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
        with np.errstate(all="ignore"):  # a blow-up is refused below, not printed
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
            error = float(np.max(np.abs(to_numpy(sol.y_final) - reference)))
        dts.append(dt)
        errors.append(error if sol.success and math.isfinite(error) else math.nan)
    dts_a, errors_a = np.asarray(dts), np.asarray(errors)
    # the reference (DOP853 at 1e-13) is itself off by ~1e-13 - 1e-12: an error 100 times its tolerance is the
    # smallest that measures the solver rather than the reference
    floor = 100.0 * REFERENCE_TOL * max(1.0, float(np.max(np.abs(reference))))
    usable = np.isfinite(errors_a) & (errors_a > floor)
    refused = tuple(float(d) for d in dts_a[~usable])
    fitted = np.nonzero(usable)[0][-fit_points:]
    with np.errstate(all="ignore"):
        log_d, log_e = np.log(dts_a), np.log(errors_a)
        local = np.diff(log_e) / np.diff(log_d)
    slope, fit_range = math.nan, (math.nan, math.nan)
    if fitted.size >= 2:
        slope = float(np.polyfit(log_d[fitted], log_e[fitted], 1)[0])
        fit_range = (float(dts_a[fitted[0]]), float(dts_a[fitted[-1]]))
    return OrderResult(dts_a, errors_a, slope, method, fit_range, refused, local)
