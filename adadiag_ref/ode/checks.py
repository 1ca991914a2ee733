r"""``check(...) -> CheckResult``: integrate one system on one problem and judge the Hamiltonian claims.

What is measured (``t`` runs over the accepted steps ``t_0 < t_1 < ... < t_N = T``):

* **largest increase of H**: ``max_k (H(y_{k+1}) - H(y_k))`` (absolute and relative
  to ``|H(0)|``), compared with the *local error estimate* of ``H`` on that step.
  The estimate is Richardson's ``|H(y_h) - H(y_{h/2,h/2})| 2^p / (2^p - 1)`` (the
  step redone as two half steps), or the embedded one ``|H(y_1) - H(y_1 - y_err)|``
  when larger.  An increase within a few estimates (plus rounding) is discretisation
  error, not a property of the ODE.
* **closed-form dH/dt** along the saved states: ``max dH/dt > 0`` means the ODE
  itself increases ``H`` there, i.e. the claim ``dH/dt <= 0`` fails on this trajectory.
* **energy balance** ``H(0) - H(T) = int_0^T -dH/dt dt``, the integral by Simpson's
  rule on every step (midpoints from the dense output), each step with the basis in
  force on it.  Its relative residual enters the verdict: above
  :data:`ENERGY_TOLERANCE` the run is ``unresolved`` (or, with the next check, ``rate_mismatch``).
* **the closed form against finite differences**: at up to :data:`FD_SAMPLES` saved states, the
  Richardson-extrapolated central difference of ``H`` along the field ``f`` (under the basis in force;
  :func:`rate_fd_error`) against the closed-form ``dH/dt``; ``rate_fd_error`` is the largest relative gap
  beyond the differences' own uncertainty, and above :data:`FD_TOLERANCE` the verdict is ``rate_mismatch``.
* **gradient**: ``||grad L||`` at the start, at the end and its largest value on the
  tail (the last 10 % of ``[0, T]``).
* **invariants**: ``min V``, ``min r``, ``min s`` (they must stay >= 0; positive for ``H``).
* **observed order** (optional): see :func:`~.reference.observed_order`.

**Well-posedness.**  The Adam family needs ``eps > 0`` or ``V > 0``; ``H`` and
``dH/dt`` need ``V > 0`` (``H`` is not differentiable at ``V = 0``), which holds
for all ``t`` once ``V(0) > 0`` because ``V' >= -b V``.  ``V(0) = 0`` (the
discrete optimizer's zero start) with small ``eps`` makes ``W' = -M / eps``
initially: the system is stiff, of stiffness ``~ 1 / (sqrt(V) + eps)``.  The
factored families need ``r, s > 0`` (``V^ = r s^T / 1^T r`` is ``0/0`` at zero);
:func:`~.systems.initial_state`'s default start guarantees both.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple, ParamSpec

import numpy as np
from tqdm.auto import tqdm

from .._cli import bar_disable
from .._xp import Array, namespace
from . import events as _events
from .controllers import ConstantStepSize, PIController, Tolerance
from .integrate import BasisSchedule, SaveAt, Solution, integrate
from .problems import Problem
from .reference import StepLimitError, observed_order
from .solvers import Solver, interpolate, make_solver
from .systems import AdafactorODEState, AdamODEState, Basis, HfacODEState, System
from .terms import ODETerm, SystemTerm

__all__ = [
    "ENERGY_TOLERANCE",
    "FD_SAMPLES",
    "FD_TOLERANCE",
    "CheckResult",
    "Trajectory",
    "check",
    "rate_fd_error",
    "well_posedness",
]

_EPS64 = float(np.finfo(np.float64).eps)
_P = ParamSpec("_P")

FD_SAMPLES = 9
"""States (evenly spaced among the saved ones) where the closed-form dH/dt meets its finite difference."""

FD_TOLERANCE = 1e-3
"""Largest relative gap between the closed-form dH/dt and its finite difference that counts as agreement (the
gap is what remains beyond the difference's own uncertainty, :func:`rate_fd_error`; a correct closed form gives
0 - 1e-9, a wrong one, a factor or a term off, tens of percent)."""

ENERGY_TOLERANCE = 0.05
"""Largest relative energy residual ``|H(0) - H(T) - int -dH/dt| / |H(0) - H(T)|`` of a resolved run: the
library's defaults close it to 1e-10 - 1e-6 (DOPRI5), up to 0.027 (RK4, T/200 steps) and 0.009 (Euler, T/2000
steps; measured over every system on the least-squares and factorization problems, T = 5), while a wrong closed
form leaves tens of percent (0.50 and 0.53 for the two families of issue 48)."""


@dataclass(frozen=True)
class Trajectory:
    """Per saved state diagnostics (host arrays), for plots."""

    t: np.ndarray
    H: np.ndarray
    L: np.ndarray
    grad_norm: np.ndarray
    dHdt: np.ndarray
    step_sizes: np.ndarray
    refresh_times: np.ndarray


@dataclass(frozen=True)
class CheckResult:
    """Everything :func:`check` measured; :meth:`to_dict` gives the JSON form.

    ``verdict`` is one of

    * ``"monotone"``: ``dH/dt <= 0`` at every sampled state (step ends and midpoints)
      and no step increased ``H`` beyond rounding;
    * ``"within_error"``: ``dH/dt <= 0`` at every sampled state, but some step increased
      ``H`` by no more than a few local error estimates (discretisation error: the
      discrete trajectory is not monotone, the ODE's is);
    * ``"violated"``: the closed-form ``dH/dt`` is positive somewhere (the ODE itself
      increases ``H``; see ``docs/errata.md``);
    * ``"numerical_increase"``: ``dH/dt <= 0`` at every sampled state, yet a step increased
      ``H`` beyond its error estimate (unresolved dynamics or an unreliable estimate);
    * ``"rate_mismatch"``: the closed-form ``dH/dt`` disagrees with the central difference of
      ``H`` along the field at a sampled state (``rate_fd_error > 1e-3``): the family's
      ``hamiltonian`` and ``hamiltonian_rate`` do not belong together, so no verdict on the
      sign can be trusted;
    * ``"unresolved"``: the closed form agrees with the finite differences and ``dH/dt <= 0``
      everywhere, but the energy balance ``H(0) - H(T) = int -dH/dt`` does not close
      (``energy_residual_rel > energy_tolerance``): the numerical trajectory does not follow
      the ODE closely enough to judge it; reduce the step;
    * ``"failed"``: the integration did not reach ``T`` (``status``), or a state is not finite;
    * ``"ill_posed"``: the initial state is outside the system's domain (e.g. ``r = 0``);
      nothing was integrated.
    """

    system: str
    problem: str
    integrator: str
    t_end: float
    status: str
    verdict: str
    message: str
    h0: float
    h_end: float
    loss0: float
    loss_end: float
    optimal_value: float | None
    max_h_increase: float
    max_h_increase_rel: float
    t_max_h_increase: float
    local_error_estimate: float
    increase_tolerance: float
    max_dhdt: float
    t_max_dhdt: float
    energy_drop: float
    energy_integral: float
    energy_residual: float
    energy_residual_rel: float
    energy_tolerance: float
    rate_fd_error: float
    t_rate_fd_error: float
    grad_norm0: float
    grad_norm_end: float
    grad_norm_tail: float
    min_second_moment: float | None
    invariants_ok: bool
    well_posed: bool
    notes: tuple[str, ...]
    n_steps: int
    n_rejected: int
    n_evals: int
    n_check_evals: int
    wall_time: float
    observed_order: float | None = None
    order_dts: tuple[float, ...] = ()
    order_errors: tuple[float, ...] = ()
    order_fit_range: tuple[float, ...] = ()
    order_refused: tuple[float, ...] = ()
    runtime_warnings: tuple[str, ...] = ()
    t_final: float = math.nan
    event: str | None = None
    trajectory: Trajectory | None = field(default=None, repr=False, compare=False)

    def to_dict(self, trajectory: bool = False) -> dict[str, Any]:
        """JSON-ready dict: non-finite floats become ``None``; the trajectory (every saved state's ``t``, ``H``,
        ``L``, ``||grad L||``, ``dH/dt``, the step sizes and refresh times) only with ``trajectory=True``."""
        out = {k: _json_value(v) for k, v in asdict(self).items() if k != "trajectory"}
        if trajectory and self.trajectory is not None:
            out["trajectory"] = {
                name: _json_value(tuple(float(x) for x in getattr(self.trajectory, name)))
                for name in self.trajectory.__dataclass_fields__
            }
        return out


def _json_value(value: Any) -> Any:
    """``value`` with non-finite floats (alone or in a tuple) as ``None`` and tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return [_json_value(x) for x in value] if isinstance(value, tuple) else value


def well_posedness(system: System, state: Any) -> tuple[bool, list[str]]:
    """Whether ``H`` and the vector field are well defined at ``state``, with explanatory notes."""
    xp = namespace(state.W)
    notes: list[str] = []
    ok = True
    if isinstance(state, AdamODEState):
        vmin = float(xp.min(state.V))
        dmin = math.sqrt(max(vmin, 0.0)) + system.eps
        if vmin < 0:
            ok = False
            notes.append(f"V has a negative entry ({vmin:.3g}): sqrt(V) is undefined")
        elif vmin == 0 and system.eps == 0:
            ok = False
            notes.append("V = 0 with eps = 0: W' = -M / sqrt(V) divides by zero")
        elif vmin == 0:
            notes.append(
                "V = 0 somewhere: H is not differentiable there, and W' = -M / eps "
                f"(1/eps = {1 / system.eps:.3g}) makes the start stiff"
            )
        if ok and dmin < 1e-4:
            notes.append(
                f"min(sqrt(V) + eps) = {dmin:.3g}: the preconditioner 1/(sqrt(V) + eps) reaches {1 / dmin:.3g}, "
                "so the system is stiff there"
            )
    if isinstance(state, AdafactorODEState | HfacODEState):
        rmin, smin = float(xp.min(state.r)), float(xp.min(state.s))
        if rmin <= 0 or smin <= 0:
            ok = False
            notes.append(f"r or s not positive (min r {rmin:.3g}, min s {smin:.3g}): V^ = r s^T / 1^T r is undefined")
        else:
            R, Sum_s = float(xp.sum(state.r)), float(xp.sum(state.s))
            gap = abs(R - Sum_s) / max(R, Sum_s)
            if gap > 1e-8:
                notes.append(
                    f"off the invariant manifold 1^T r = 1^T s (relative gap {gap:.3g}); it decays like exp(-b t)"
                )
    if system.b > 4 * system.a and system.family != "momentum":
        notes.append(f"b = {system.b:g} > 4a = {4 * system.a:g}: dH/dt <= 0 is not guaranteed (docs/errata.md)")
    return ok, notes


def _second_moment_min(states: list[Any], xp: Any) -> float | None:
    mins = []
    for s in states:
        if isinstance(s, AdamODEState):
            mins.append(float(xp.min(s.V)))
        elif isinstance(s, AdafactorODEState | HfacODEState):
            mins.append(min(float(xp.min(s.r)), float(xp.min(s.s))))
    return min(mins) if mins else None


def _richardson_h_error(
    term: SystemTerm | ODETerm, solver: Solver, t: float, y: Array, h: float, args: Any
) -> tuple[float, int]:
    """Local error estimate of ``H`` over one step, by step doubling; and the evaluations used."""
    full = solver.step(term, t, y, h, args, solver.init(term, t, y, args))
    half1 = solver.step(term, t, y, h / 2, args, solver.init(term, t, y, args))
    half2 = solver.step(term, t + h / 2, half1.y1, h / 2, args, half1.carry)
    p = solver.order
    scale = 2.0**p / (2.0**p - 1.0)
    estimate = abs(term.hamiltonian(half2.y1) - term.hamiltonian(full.y1)) * scale
    return estimate, full.n_evals + half1.n_evals + half2.n_evals


def _summarise_warnings(caught: list[warnings.WarningMessage]) -> tuple[str, ...]:
    """``"<count> x <Category>: <message>"`` per distinct warning, in order of first appearance."""
    counts: dict[str, int] = {}
    for w in caught:
        key = f"{w.category.__name__}: {w.message}"
        counts[key] = counts.get(key, 0) + 1
    return tuple(f"{count} x {key}" for key, count in counts.items())


def _collecting_warnings(run: Callable[_P, CheckResult]) -> Callable[_P, CheckResult]:
    """``run`` with the warnings raised during it kept from the console and collected in ``runtime_warnings``."""

    @functools.wraps(run)
    def collecting(*args: _P.args, **kwargs: _P.kwargs) -> CheckResult:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run(*args, **kwargs)
        return replace(result, runtime_warnings=_summarise_warnings(caught)) if caught else result

    return collecting


class _Subject(NamedTuple):
    """What is checked: the library's ``system`` (``None`` for a user's :class:`~.terms.ODETerm`) and the names."""

    system: System | None
    system_name: str
    problem_name: str
    optimal_value: float | None


@_collecting_warnings
def check(
    system: System | ODETerm,
    problem: Problem | None = None,
    integrator: str | Solver = "dopri5",
    t_end: float = 10.0,
    *,
    dt: float | None = None,
    rtol: Tolerance = 1e-8,
    atol: Tolerance = 1e-10,
    refresh_period: float | None = None,
    moments: str = "gradient",
    floor: float = 1e-4,
    y0: Array | None = None,
    basis: Basis | None = None,
    order: bool = False,
    order_t_end: float | None = None,
    order_dt0: float | None = None,
    progress: bool | None = False,
    max_steps: int = 1_000_000,
    grad_tol: float | None = None,
    loss_threshold: float | None = None,
    events: Sequence[Callable[[float, Array, Any], bool]] = (),
) -> CheckResult:
    """Integrate ``system`` on ``problem`` over ``[0, t_end]`` and measure everything listed above.

    Your own flow needs no family registration: pass an :class:`~.terms.ODETerm` with ``hamiltonian_fn`` (``H(y)``)
    and ``rate_fn`` (the closed-form ``dH/dt``) as ``system``, no ``problem``, and its start as ``y0`` (``args``
    as ``basis``; ``loss_fn``, ``grad_norm_fn`` and ``refresh_fn`` are optional).  Everything but the
    second-moment invariants and the well-posedness notes of the library's families is measured alike.

    Args:
        integrator: ``euler``, ``semi_implicit_euler``, ``rk4``, ``dopri5`` or a solver.
        dt: fixed step (default ``t_end / 2000`` for Euler-type, ``t_end / 200`` for RK4); for ``dopri5``, whose PI
            controller chooses the steps from ``rtol`` and ``atol``, the first step (default: chosen automatically).
        rtol, atol: ``dopri5``'s tolerances, numbers or one per component of the flat state (:class:`PIController`).
        refresh_period: refresh the basis every ``T`` time units from ``t = 0``
            (``None``: basis of ``grad L(W0)``, fixed).
        moments, floor: initial moments (:func:`~.systems.initial_state`).
        y0, basis: start from this flat state / basis instead (e.g. a counterexample).
        order: also measure the observed order (fixed steps against DOP853) on
            ``[0, order_t_end]`` (default ``min(t_end, 1)``) from ``order_dt0``.
        max_steps: bounds every integration, the order measurement's included; a
            run that would exceed it gives ``status="max_steps"`` (with a note).
        progress: progress bar (``None``: on a TTY).
        grad_tol, loss_threshold, events: stop early, after the first accepted step where
            ``||grad L|| <= grad_tol``, ``L <= loss_threshold`` or a user's ``event(t, y, args)`` holds
            (:mod:`.events`); the result's ``status`` is then ``"event"``, ``event`` names the condition and
            ``t_final`` the time, and every figure covers ``[0, t_final]``.

    Warnings raised during the run (NumPy's floating-point ``RuntimeWarning`` of a rejected trial stage, for
    one) do not reach the console: they are collected, counted, in ``CheckResult.runtime_warnings``.
    """
    solver = make_solver(integrator) if isinstance(integrator, str) else integrator
    term: SystemTerm | ODETerm
    if isinstance(system, ODETerm):
        missing = [name for name in ("hamiltonian_fn", "rate_fn") if getattr(system, name) is None]
        if missing or y0 is None or problem is not None:
            raise ValueError(
                "check(ODETerm) needs the term's hamiltonian_fn and rate_fn, y0, and no problem "
                f"(missing: {', '.join(missing) or 'none'}; y0 given: {y0 is not None})"
            )
        term = system
        subject = _Subject(None, getattr(system.fn, "__name__", "ODETerm"), "custom", None)
    else:
        if problem is None:
            raise ValueError("check(system, problem): a System needs a Problem")
        term = SystemTerm(system, problem)
        subject = _Subject(system, system.name, problem.name, problem.optimal_value)
        if basis is None:
            basis = term.initial_basis()
        if y0 is None:
            y0 = term.initial_state(basis, moments=moments, floor=floor)
        posed, notes = well_posedness(system, term.unpack(y0))
        if not posed:
            return _ill_posed(subject, solver, term, y0, t_end, notes)
    schedule = BasisSchedule.every(refresh_period, 0.0, t_end) if refresh_period else None
    stops: list[Callable[[float, Array, Any], bool]] = [
        *([_events.gradient_tolerance(term, grad_tol)] if grad_tol is not None else []),
        *([_events.loss_threshold(term, loss_threshold)] if loss_threshold is not None else []),
        *events,
    ]
    adaptive = solver.error_order is not None
    controller = PIController(rtol=rtol, atol=atol) if adaptive else ConstantStepSize()
    step = dt
    if step is None and not adaptive:  # the default fixed step
        step = t_end / (200.0 if solver.name in ("rk4", "dopri5") else 2000.0)
    sol = integrate(
        term,
        solver,
        0.0,
        t_end,
        y0,
        basis,
        dt0=step,
        controller=controller,
        saveat=SaveAt(steps=True, dense=True, errors=True),
        basis_schedule=schedule,
        max_steps=max_steps,
        progress=progress,
        events=stops,
    )
    result = _analyse(subject, term, solver, sol, t_end, progress=progress)
    if order:
        t_ord = min(t_end, 1.0) if order_t_end is None else order_t_end
        dt0 = order_dt0 if order_dt0 is not None else t_ord / (10.0 if solver.order >= 4 else 40.0)
        try:
            od = observed_order(
                term, solver, 0.0, t_ord, y0, basis, dt0=dt0, basis_schedule=schedule, max_steps=max_steps
            )
        except StepLimitError as exc:  # --max-steps bounds every integration, the order runs too
            note = f"observed order not measured: {exc}"
            return replace(result, status="max_steps", notes=(*result.notes, note))
        result = replace(
            result,
            observed_order=od.slope,
            order_dts=tuple(float(x) for x in od.dts),
            order_errors=tuple(float(x) for x in od.errors),
            order_fit_range=tuple(od.fit_range),
            order_refused=od.refused,
        )
    return result


def _ill_posed(
    subject: _Subject, solver: Solver, term: SystemTerm, y0: Array, t_end: float, notes: list[str]
) -> CheckResult:
    """The result for an initial state where the system is not defined: nothing is integrated."""
    g0 = term.grad_norm(y0)
    loss0 = term.loss(y0)
    # the figures of an integration and of the checks along it: none was run
    unmeasured: dict[str, Any] = dict.fromkeys(
        "h0 h_end max_h_increase max_h_increase_rel t_max_h_increase local_error_estimate increase_tolerance "
        "max_dhdt t_max_dhdt energy_drop energy_integral energy_residual energy_residual_rel rate_fd_error "
        "t_rate_fd_error".split(),
        math.nan,
    )
    return CheckResult(
        system=subject.system_name,
        problem=subject.problem_name,
        integrator=solver.name,
        t_end=float(t_end),
        status="ill_posed",
        verdict="ill_posed",
        message="the initial state is outside the domain of the system: " + "; ".join(notes),
        loss0=loss0,
        loss_end=loss0,
        optimal_value=subject.optimal_value,
        energy_tolerance=ENERGY_TOLERANCE,
        grad_norm0=g0,
        grad_norm_end=g0,
        grad_norm_tail=g0,
        min_second_moment=_second_moment_min([term.unpack(y0)], term.xp),
        invariants_ok=True,
        well_posed=False,
        notes=tuple(notes),
        n_steps=0,
        n_rejected=0,
        n_evals=0,
        n_check_evals=1,
        wall_time=0.0,
        trajectory=None,
        **unmeasured,
    )


def rate_fd_error(term: Any, t: float, y: Array, args: Any) -> tuple[float, int]:
    r"""Relative gap between the closed-form ``dH/dt`` and the derivative of ``H`` along the field at ``y``.

    ``f = term.vector_field(t, y, args)``; ``D(d) = (H(y + d f) - H(y - d f)) / (2 d)`` at ``d`` and ``d / 2``
    with ``d = 1e-4 ||y||_inf / ||f||_inf`` (the perturbation is 1e-4 of the state), extrapolated,
    ``D = (4 D(d/2) - D(d)) / 3`` (Richardson: error ``O(d^4)``).  Its uncertainty ``u`` is ``|D(d) - D(d/2)|``
    (a bound on the extrapolation's truncation error where ``H`` is strongly curved along ``f``, e.g. in
    Rosenbrock's valley) plus the rounding ``1e3 eps |H| / d``.  The gap is the part of ``|rate - D|`` beyond
    ``u``, relative to ``|rate| + |D|``: 0 for agreement within what the differences can tell, 1/3 for a rate
    off by a factor 2.  Returns the gap and the field evaluations used (1); NaN where ``H``, ``f`` or the rate
    is not finite.
    """
    xp = namespace(y)
    f = term.vector_field(t, y, args)
    f_size = float(xp.max(xp.abs(f)))
    rate = term.hamiltonian_rate(t, y, args)
    if not (math.isfinite(f_size) and math.isfinite(rate)):
        return math.nan, 1
    if f_size == 0.0:
        return (0.0 if rate == 0.0 else 1.0), 1
    d = 1e-4 * max(float(xp.max(xp.abs(y))), 1e-300) / f_size

    def central(step: float) -> tuple[float, float]:
        plus, minus = term.hamiltonian(y + step * f), term.hamiltonian(y - step * f)
        return (plus - minus) / (2.0 * step), 1e3 * _EPS64 * max(abs(plus), abs(minus)) / step

    coarse, _ = central(d)
    fine, rounding = central(d / 2)
    fd = (4.0 * fine - coarse) / 3.0
    if not math.isfinite(fd):
        return math.nan, 1
    excess = max(0.0, abs(rate - fd) - abs(coarse - fine) - rounding)
    return excess / max(abs(rate) + abs(fd), 1e-300), 1


def _analyse(
    subject: _Subject,
    term: SystemTerm | ODETerm,
    solver: Solver,
    sol: Solution,
    t_end: float,
    progress: bool | None = False,
) -> CheckResult:
    xp = namespace(sol.ys)
    n = len(sol.ts)
    # about two evaluations of dH/dt per accepted step: as long as the integration itself, so it shows progress
    # (``disable=None`` is tqdm's "only on a terminal", the integrator's ``progress=None``)
    bar = tqdm(total=2 * n - 1, desc="checking H, dH/dt", unit="eval", leave=False, disable=bar_disable(progress))
    ys = [sol.ys[i, :] for i in range(n)]
    # the structured states of the library's families (second-moment invariants, well-posedness notes)
    states = [term.unpack(y) for y in ys] if isinstance(term, SystemTerm) else []
    # H, L, ||grad L|| and dH/dt at every saved state, with the basis of the step that ended there;
    # where a refresh starts the next step, dH/dt again with the new basis (H itself does not change)
    H, L, gnorm, rate_end = (np.empty(n) for _ in range(4))
    for i in range(n):
        H[i], L[i], gnorm[i], rate_end[i] = term.diagnostics(float(sol.ts[i]), ys[i], sol.bases[int(sol.segments[i])])
        bar.update()
    check_evals = n
    rate_start, rate_mid = np.empty(n - 1), np.empty(n - 1)  # the saved states include t_0: n >= 1
    assert sol.dense is not None
    for k in range(n - 1):
        basis = sol.bases[int(sol.segments[k + 1])]
        if int(sol.segments[k + 1]) == int(sol.segments[k]):
            rate_start[k] = rate_end[k]
        else:
            rate_start[k] = term.hamiltonian_rate(float(sol.ts[k]), ys[k], basis)
            check_evals += 1
        t_mid = 0.5 * (float(sol.ts[k]) + float(sol.ts[k + 1]))
        rate_mid[k] = term.hamiltonian_rate(t_mid, interpolate(sol.dense[k], t_mid), basis)
        check_evals += 1
        bar.update()
    bar.close()
    hs = np.diff(sol.ts)
    integral = float(np.sum(hs / 6.0 * (rate_start + 4.0 * rate_mid + rate_end[1:]))) if n > 1 else 0.0
    drop = float(H[0] - H[-1])
    residual = drop - (-integral)
    all_rates = np.concatenate([rate_start, rate_mid, rate_end])
    finite_rates = all_rates[np.isfinite(all_rates)]
    rate_scale = float(np.max(np.abs(finite_rates))) if finite_rates.size else 0.0
    i_rate = int(np.argmax(rate_end))
    max_rate = float(rate_end[i_rate])
    t_max_rate = float(sol.ts[i_rate])
    if n > 1 and float(np.max(rate_mid)) > max_rate:
        k = int(np.argmax(rate_mid))
        max_rate, t_max_rate = float(rate_mid[k]), float(0.5 * (sol.ts[k] + sol.ts[k + 1]))

    # largest increase of H and its local error estimate
    dH = np.diff(H)
    ranked = np.where(np.isfinite(dH), dH, -np.inf)  # a blown-up state's NaN step is reported by the verdict
    k_inc = int(np.argmax(ranked)) if dH.size else 0
    inc = max(0.0, float(ranked[k_inc])) if dH.size else 0.0
    estimate = 0.0
    if inc > 0:
        basis = sol.bases[int(sol.segments[k_inc + 1])]
        estimate, used = _richardson_h_error(term, solver, float(sol.ts[k_inc]), ys[k_inc], float(hs[k_inc]), basis)
        check_evals += used
        if sol.y_errs is not None and sol.y_errs.shape[0] > k_inc:
            embedded = abs(term.hamiltonian(ys[k_inc + 1]) - term.hamiltonian(ys[k_inc + 1] - sol.y_errs[k_inc, :]))
            estimate = max(estimate, embedded)
    rounding = 64.0 * _EPS64 * float(np.max(np.abs(H[k_inc : k_inc + 2]))) if n > 1 else 0.0
    tolerance = 3.0 * estimate + rounding
    rate_tol = 1e-10 * max(rate_scale, 1e-300)

    # the closed form against finite differences of H along the field, at states spread over the run
    finite = np.isfinite(H) & np.isfinite(rate_end)
    samples = np.unique(np.linspace(0, n - 1, min(FD_SAMPLES, n)).astype(int))
    fd_gaps = np.full(len(samples), math.nan)
    for j, i in enumerate(samples):
        if finite[i]:
            fd_gaps[j], used = rate_fd_error(term, float(sol.ts[i]), ys[i], sol.bases[int(sol.segments[i])])
            check_evals += used
    fd_known = np.isfinite(fd_gaps)
    fd_error = float(np.max(fd_gaps[fd_known])) if fd_known.any() else math.nan
    t_fd_error = float(sol.ts[samples[fd_known][int(np.argmax(fd_gaps[fd_known]))]]) if fd_known.any() else math.nan
    energy_rel = abs(residual) / abs(drop) if drop else math.inf if residual else 0.0
    balance = f"energy residual {energy_rel:.2g} of H(0) - H(T)"

    # tail of the gradient norm
    t0 = float(sol.ts[0])
    tail = gnorm[sol.ts >= t0 + 0.9 * (sol.t_final - t0)]
    vmin = _second_moment_min(states, xp)
    all_finite = bool(np.all(finite)) and bool(xp.all(xp.isfinite(sol.ys)))
    invariants_ok = all_finite and (vmin is None or vmin >= 0.0)
    ok, notes = well_posedness(subject.system, states[0]) if subject.system is not None else (True, [])
    if not all_finite:
        first_bad = int(np.argmin(finite)) if not np.all(finite) else n - 1
        notes.append(f"the state is not finite from t = {float(sol.ts[first_bad]):.6g} on (a blow-up)")

    if not sol.success or not all_finite:
        verdict = "failed"
        message = f"integration stopped at t = {sol.t_final:.6g}: {sol.status}"
        if sol.success:
            message = f"the state is not finite on the trajectory (t = {float(sol.ts[int(np.argmin(finite))]):.6g})"
    elif fd_error > FD_TOLERANCE:
        verdict = "rate_mismatch"
        message = (
            f"the closed-form dH/dt disagrees with the finite difference of H along the field at t = "
            f"{t_fd_error:.4g} (relative gap {fd_error:.2g}) and the {balance}: the Hamiltonian and its rate "
            "do not belong together, so the sign of dH/dt proves nothing"
        )
    elif max_rate > rate_tol:
        verdict = "violated"
        message = (
            f"dH/dt = {max_rate:.3g} > 0 at t = {t_max_rate:.4g}: the ODE itself increases H "
            f"(largest step increase {inc:.3g}, local error estimate {estimate:.3g}; {balance})"
        )
    elif inc > tolerance:
        verdict = "numerical_increase"
        message = (
            f"H rose by {inc:.3g} on one step, more than its local error estimate {estimate:.3g}, "
            f"although dH/dt <= 0 at every sampled state: reduce the step (stiff system?); {balance}"
        )
    elif inc > rounding:
        verdict = "within_error"
        message = (
            f"dH/dt <= 0 at every sampled state; H rose by {inc:.3g} on one step, within its local error "
            f"estimate {estimate:.3g} ({estimate / max(abs(H[k_inc]), 1e-300):.2g} of H): discretisation error, "
            f"a smaller step removes it; {balance}"
        )
    elif energy_rel > ENERGY_TOLERANCE:
        verdict = "unresolved"
        message = (
            f"H is non-increasing and dH/dt <= 0 at every sampled state, but the {balance} exceeds "
            f"{ENERGY_TOLERANCE:g}: the trajectory does not follow the ODE closely enough to close the balance; "
            "reduce the step"
        )
    else:
        verdict = "monotone"
        message = (
            f"H is non-increasing (largest step increase {inc:.3g}, rounding level {rounding:.3g}); {balance}, "
            f"closed-form dH/dt agrees with finite differences of H (gap {fd_error:.1g})"
        )

    if sol.event is not None:
        message = f"stopped at t = {sol.t_final:.6g} ({sol.event}); {message}"
    trajectory = Trajectory(
        t=np.asarray(sol.ts),
        H=H,
        L=L,
        grad_norm=gnorm,
        dHdt=rate_end,
        step_sizes=sol.step_sizes,
        refresh_times=np.asarray(sol.piece_starts[1:]),  # every piece after the first starts with a refresh
    )
    return CheckResult(
        system=subject.system_name,
        problem=subject.problem_name,
        integrator=solver.name,
        t_end=float(t_end),
        status=sol.status,
        verdict=verdict,
        message=message,
        h0=float(H[0]),
        h_end=float(H[-1]),
        loss0=float(L[0]),
        loss_end=float(L[-1]),
        optimal_value=subject.optimal_value,
        max_h_increase=inc if all_finite else math.nan,
        max_h_increase_rel=(inc / abs(H[0]) if H[0] else math.inf if inc else 0.0) if all_finite else math.nan,
        t_max_h_increase=float(sol.ts[k_inc + 1]) if dH.size else 0.0,
        local_error_estimate=float(estimate),
        increase_tolerance=float(tolerance),
        max_dhdt=max_rate,
        t_max_dhdt=t_max_rate,
        energy_drop=drop,
        energy_integral=-integral,
        energy_residual=residual,
        energy_residual_rel=energy_rel,
        energy_tolerance=ENERGY_TOLERANCE,
        rate_fd_error=fd_error,
        t_rate_fd_error=t_fd_error,
        grad_norm0=float(gnorm[0]),
        grad_norm_end=float(gnorm[-1]),
        grad_norm_tail=float(np.max(tail)) if tail.size else float(gnorm[-1]),
        min_second_moment=vmin,
        invariants_ok=bool(invariants_ok),
        well_posed=ok,
        notes=tuple(notes),
        n_steps=sol.n_steps,
        n_rejected=sol.n_rejected,
        n_evals=sol.n_evals,
        n_check_evals=check_evals,
        wall_time=sol.wall_time,
        t_final=float(sol.t_final),
        event=sol.event,
        trajectory=trajectory,
    )
