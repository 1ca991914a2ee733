r"""``integrate(term, solver, t0, t1, y0, args, ...) -> Solution``: the stepping loop.

Concerns are separate, as in diffrax's ``diffeqsolve`` and
:func:`scipy.integrate.solve_ivp`: the *term* is the right-hand side, the
*solver* takes one step, the *controller* accepts steps and chooses ``h``,
:class:`SaveAt` says what to keep and :class:`BasisSchedule` says when the
basis of a rotated system is refreshed.

**Basis refresh.**  ``[t0, t1]`` is cut at the refresh times; each piece is
integrated with its basis held fixed (so every piece is a smooth ODE and the
solvers keep their order), and at the start of a piece the term recomputes
``args = term.refresh(t, y, args)`` (``P, _, Q^T = canonical_svd(G(W(t)))``).
``y`` (``W`` and the moments) is carried over untouched.  Steps never straddle
a refresh; the last step of a piece is shortened to end on it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

from .._cli import bar_disable
from .._xp import Array, namespace
from .controllers import ConstantStepSize, ControllerState, PIController, initial_step
from .events import event_name
from .solvers import DenseStep, ExplicitRK, Rosenbrock, Solver, interpolate

__all__ = ["BasisSchedule", "SaveAt", "Solution", "integrate"]

Controller = ConstantStepSize | PIController

_BAR_FORMAT = "{desc}: {percentage:5.1f}%|{bar}| t={n:.4g}/{total:.4g} [{elapsed}{postfix}]"
"""Fraction of ``[t0, t1]`` done (one decimal), the time reached, elapsed seconds, then steps and ``h``."""


@dataclass(frozen=True)
class SaveAt:
    """What :func:`integrate` keeps.

    Attributes:
        steps: keep ``y`` at ``t0`` and after every accepted step (``Solution.ts``, ``.ys``).
        ts: keep ``y`` at these times instead (from the dense interpolant): sorted, in ``[t0, t1]``
            (:func:`integrate` refuses others with ``ValueError`` before it starts).  A run that ends early
            (an event, or ``status`` other than ``"success"``) has no state after ``t_final``: those times are
            absent from ``Solution.ts``.
        dense: keep every step's interpolant, for :meth:`Solution.evaluate`.
        errors: keep every accepted step's embedded error estimate (``Solution.y_errs``).
    """

    steps: bool = True
    ts: tuple[float, ...] | None = None
    dense: bool = False
    errors: bool = False


@dataclass(frozen=True)
class BasisSchedule:
    """ODE times at which a rotated system's basis is recomputed from ``grad L(W(t))``.

    An empty schedule keeps the basis given in ``args`` for the whole run (a fixed
    basis).  A refresh at ``t0`` replaces the given basis by the SVD basis of ``W0``.
    """

    refresh_times: tuple[float, ...] = ()

    @classmethod
    def fixed(cls) -> BasisSchedule:
        """Never refresh: the ``args`` basis holds throughout."""
        return cls(())

    @classmethod
    def every(cls, period: float, t0: float, t1: float) -> BasisSchedule:
        """Refresh at ``t0, t0 + T, t0 + 2T, ... < t1`` (the discrete optimizer's "step 1, then every T")."""
        if not period > 0:
            raise ValueError(f"refresh period must be > 0, got {period!r}")
        count = math.ceil((t1 - t0) / period - 1e-12)
        return cls(tuple(t0 + k * period for k in range(max(count, 1))))


class Solution(NamedTuple):
    """The result of :func:`integrate`.

    Attributes:
        ts: host times of the saved states.
        ys: saved states, shape ``(len(ts), dim)``, in the namespace of ``y0``.
        segments: index into ``bases`` of the basis in force for the step that ended
            at each saved time (for ``t0``: the first piece).
        t_steps: host end times of every accepted step (``t_steps[0] = t0``).
        step_sizes: accepted step sizes.
        error_norms: the controller's weighted error norm per accepted step (NaN for fixed steps).
        y_errs: ``(n_steps, dim)`` embedded error estimates when saved, else ``None``.
        bases: ``args`` of every piece, in order.
        piece_starts: start time of every piece.
        dense: per-step interpolants when saved, else ``None``.
        t_final: where the integration stopped (``t1`` on success).
        y_final: the state there.
        n_steps: accepted steps; n_rejected: rejected steps; n_evals: vector-field evaluations.
        status: ``"success"`` (reached ``t1``), ``"event"`` (a terminal event held: ``event``), ``"max_steps"``,
            ``"nonfinite"`` or ``"dt_min"``.
        solver: the solver's name; wall_time: seconds spent.
        event: the name of the event that ended the run (:func:`~.events.event_name`), else ``None``.
    """

    ts: np.ndarray
    ys: Array
    segments: np.ndarray
    t_steps: np.ndarray
    step_sizes: np.ndarray
    error_norms: np.ndarray
    y_errs: Array | None
    bases: tuple[Any, ...]
    piece_starts: np.ndarray
    dense: tuple[DenseStep, ...] | None
    t_final: float
    y_final: Array
    n_steps: int
    n_rejected: int
    n_evals: int
    status: str
    solver: str
    wall_time: float
    event: str | None = None

    @property
    def success(self) -> bool:
        """Whether the integration ended as asked: at ``t1``, or where a terminal event held."""
        return self.status in ("success", "event")

    def evaluate(self, t: float | Sequence[float] | np.ndarray) -> Array:
        """``y(t)`` from the dense output (needs ``SaveAt(dense=True)``).

        ``t`` a number: the state, shape ``(dim,)``.  ``t`` a 1-D sequence or array of times: the states stacked,
        shape ``(len(t), dim)``.  Times outside the integrated span ``[t0, t_final]`` raise ``ValueError`` (the
        interpolant would extrapolate).
        """
        if self.dense is None:
            raise ValueError("no dense output: integrate with SaveAt(dense=True)")
        times = np.asarray(t, dtype=np.float64)
        if times.ndim > 1:
            raise ValueError(f"t must be a number or a 1-D array of times, got shape {times.shape}")
        _check_span(times, float(self.t_steps[0]), self.t_final, "Solution.evaluate")
        starts = np.array([d.t0 for d in self.dense])
        if times.ndim == 0:
            return _evaluate_dense(self.dense, starts, float(times))
        xp = namespace(self.y_final)
        return xp.stack([_evaluate_dense(self.dense, starts, float(x)) for x in times], axis=0)

    def basis_at(self, t: float) -> Any:
        """The ``args`` in force at time ``t`` (the later piece at a refresh time)."""
        i = int(np.clip(np.searchsorted(self.piece_starts, t, side="right") - 1, 0, len(self.bases) - 1))
        return self.bases[i]


def _check_span(times: np.ndarray, t0: float, t1: float, what: str) -> None:
    """``ValueError`` unless every time is finite and in ``[t0, t1]`` (up to 1e-12 relative rounding)."""
    slack = 1e-12 * max(1.0, abs(t0), abs(t1))
    outside = times[~((times >= t0 - slack) & (times <= t1 + slack))]
    if outside.size:
        raise ValueError(f"{what}: time(s) {outside.tolist()[:5]} outside the span [{t0:g}, {t1:g}]")


def _evaluate_dense(dense: Sequence[DenseStep], starts: np.ndarray, t: float) -> Array:
    """``y(t)`` from the interpolant of the step that contains ``t`` (``starts``: the steps' start times)."""
    i = int(np.clip(np.searchsorted(starts, t, side="right") - 1, 0, len(dense) - 1))
    return interpolate(dense[i], t)


def _pieces(t0: float, t1: float, schedule: BasisSchedule | None) -> list[tuple[float, float, bool]]:
    """``(start, end, refresh_at_start)`` for every piece of ``[t0, t1]``."""
    times = sorted({t for t in (schedule.refresh_times if schedule else ()) if t0 <= t < t1})
    cuts = [t0, *[t for t in times if t > t0], t1]
    refresh = set(times)
    return [(a, b, a in refresh) for a, b in itertools.pairwise(cuts)]


def integrate(
    term: Any,
    solver: Solver,
    t0: float,
    t1: float,
    y0: Array,
    args: Any = None,
    *,
    dt0: float | None = None,
    controller: Controller | None = None,
    saveat: SaveAt | None = None,
    basis_schedule: BasisSchedule | None = None,
    max_steps: int = 1_000_000,
    progress: bool | None = False,
    events: Sequence[Callable[[float, Array, Any], bool]] = (),
) -> Solution:
    r"""Integrate ``dy/dt = term.vector_field(t, y, args)`` from ``t0`` to ``t1``.

    Args:
        term: an :class:`~.terms.ODETerm` or :class:`~.terms.SystemTerm`.
        solver: a :class:`~.solvers.Solver`.
        t0, t1: the interval, ``t1 > t0``.
        y0: flat initial state.
        args: passed to the term (the basis for a system term).
        dt0: the (initial) step; for a :class:`ConstantStepSize` without ``dt`` it is
            the step.  ``None`` with a :class:`PIController` picks one automatically.
        controller: :class:`ConstantStepSize` (default) or :class:`PIController`.
        saveat: what to keep (default: every step).
        basis_schedule: refresh times of the basis (default: fixed basis).
        max_steps: give up (``status="max_steps"``) after this many attempted steps.
        progress: progress bar on stderr: ``True`` forces it, ``None`` shows it on a TTY.
        events: terminal conditions ``event(t, y, args) -> bool`` checked after every accepted step
            (:mod:`.events`); the first that holds ends the run (``status="event"``, ``Solution.event``).

    The fixed-step loop takes ``ceil((b - a) / dt)`` steps of size ``dt`` per piece
    ``[a, b]``, the last one shortened to land on ``b`` exactly.
    """
    start_clock = time.perf_counter()
    if not t1 > t0:
        raise ValueError(f"need t1 > t0, got t0={t0!r}, t1={t1!r}")
    xp = namespace(y0)
    controller = ConstantStepSize() if controller is None else controller
    saveat = SaveAt() if saveat is None else saveat
    if saveat.ts is not None:
        requested = np.asarray(saveat.ts, dtype=np.float64)
        _check_span(requested, float(t0), float(t1), "SaveAt.ts")
        if np.any(np.diff(requested) < 0):
            raise ValueError(f"SaveAt.ts must be sorted, got {list(saveat.ts)[:5]}...")
    if not controller.adaptive:
        dt = controller.dt if isinstance(controller, ConstantStepSize) and controller.dt is not None else dt0
        if dt is None or not dt > 0:
            raise ValueError("a constant step size needs dt0 > 0 (or ConstantStepSize(dt))")
        dt0 = dt
    bar = tqdm(total=t1 - t0, desc=solver.name, bar_format=_BAR_FORMAT, disable=bar_disable(progress))

    t, y = float(t0), y0
    h = dt0
    if not bool(xp.all(xp.isfinite(y0))):
        raise ValueError("y0 has NaN or Inf entries")
    ts, ys, segs = [t], [y], [0]
    t_steps, hs, errs = [t], [], []
    y_errs: list[Array] = []
    dense: list[DenseStep] = []
    bases: list[Any] = []
    piece_starts: list[float] = []
    n_steps = n_rejected = n_evals = attempts = 0
    status = "success"
    event: str | None = None
    cstate = ControllerState()

    for a, b, refresh in _pieces(float(t0), float(t1), basis_schedule):
        if refresh:
            args = term.refresh(a, y, args)
        bases.append(args)
        piece_starts.append(a)
        piece = len(bases) - 1
        carry = solver.init(term, a, y, args)
        if h is None:
            assert isinstance(controller, PIController)
            f0 = term.vector_field(a, y, args)
            n_evals += 1
            carry = f0 if isinstance(solver, ExplicitRK | Rosenbrock) else carry  # f(t0, y0) starts the first step
            h, used = initial_step(term, a, y, args, f0, solver.order, controller.rtol, controller.atol)
            n_evals += used
        while t < b:
            if attempts >= max_steps:
                status = "max_steps"
                break
            if not (math.isfinite(h) and h > 0):
                status = "nonfinite"
                break
            remaining = b - t
            # snap: a step that would leave a sliver shorter than 1e-9 of itself lands on b instead
            h_try = remaining if h >= remaining * (1.0 - 1e-9) else h
            out = solver.step(term, t, y, h_try, args, carry)
            attempts += 1
            n_evals += out.n_evals
            decision = controller.decide(h_try, y, out.y1, out.y_err, solver.error_order, cstate)
            if not decision.accept:
                n_rejected += 1
                carry = out.retry_carry
                h = decision.h_next
                if isinstance(controller, PIController) and h < max(controller.dt_min, 1e-14 * max(1.0, abs(t))):
                    status = "dt_min"
                    break
                continue
            t = b if h_try == remaining else t + h_try
            y = out.y1
            carry = out.carry
            cstate = decision.state
            n_steps += 1
            t_steps.append(t)
            hs.append(h_try)
            errs.append(decision.err)
            if saveat.errors and out.y_err is not None:
                y_errs.append(out.y_err)
            if saveat.dense or saveat.ts is not None:
                dense.append(out.dense)
            if saveat.steps and saveat.ts is None:
                ts.append(t)
                ys.append(y)
                segs.append(piece)
            if controller.adaptive:
                h = decision.h_next
            bar.set_postfix_str(f"steps={n_steps} h={h_try:.3g}", refresh=False)
            bar.update((t - t0) - bar.n)  # tqdm throttles the redraws itself
            if not bool(xp.all(xp.isfinite(y))):
                status = "nonfinite"
                break
            fired = next((e for e in events if e(t, y, args)), None)
            if fired is not None:
                status, event = "event", event_name(fired)
                break
        if status != "success":
            break
    bar.close()

    if saveat.ts is not None:
        ts, ys, segs = [], [], []
        starts = np.array([d.t0 for d in dense]) if dense else np.zeros(0)
        for tq in saveat.ts:
            if tq > t + 1e-12 * max(1.0, abs(t)):
                break
            ts.append(float(tq))
            if not dense or tq <= t0:
                ys.append(y0 if tq <= t0 else y)
                segs.append(0)
            else:
                ys.append(_evaluate_dense(dense, starts, float(tq)))
                segs.append(int(np.searchsorted(np.array(piece_starts), tq, side="left") - 1))
    return Solution(
        ts=np.asarray(ts, dtype=np.float64),
        ys=xp.stack(ys, axis=0) if ys else xp.zeros((0, y0.shape[0]), dtype=y0.dtype),
        segments=np.asarray(segs, dtype=np.int64),
        t_steps=np.asarray(t_steps, dtype=np.float64),
        step_sizes=np.asarray(hs, dtype=np.float64),
        error_norms=np.asarray(errs, dtype=np.float64),
        y_errs=xp.stack(y_errs, axis=0) if y_errs else None,
        bases=tuple(bases),
        piece_starts=np.asarray(piece_starts, dtype=np.float64),
        dense=tuple(dense) if (saveat.dense or saveat.ts is not None) else None,
        t_final=t,
        y_final=y,
        n_steps=n_steps,
        n_rejected=n_rejected,
        n_evals=n_evals,
        status=status,
        solver=solver.name,
        wall_time=time.perf_counter() - start_clock,
        event=event,
    )
