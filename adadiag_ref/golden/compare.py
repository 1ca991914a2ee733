"""Compare a trajectory with a golden case: the machinery behind :mod:`adadiag_ref.testing`.

It lives in the ``golden`` package, beside the format it reads and the
verification (:mod:`adadiag_ref.golden.verify`) that uses it, so that imports
run one way: ``adadiag_ref.testing`` (the public face) imports ``golden``,
never the reverse.

:func:`compare` returns a :class:`ComparisonReport`: the first step at which
any entry leaves the tolerance, the largest absolute and relative error at
every step, and, where the pattern tells, the likely cause.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._xp import to_numpy
from ..linalg import canonical_svd
from ..optim.layout import layout_for, to_work
from .format import GoldenCase, load_case

__all__ = [
    "CAUSE_FLOAT32",
    "CAUSE_NONFINITE",
    "CAUSE_OTHER",
    "CAUSE_REFRESH",
    "CAUSE_SCHEDULE",
    "CAUSE_STEP1",
    "ComparisonReport",
    "assert_trajectory_close",
    "compare",
    "completion_steps",
    "likely_cause",
    "run_step_fn",
]

StepFn = Callable[[np.ndarray, np.ndarray, int], Any]

CAUSE_STEP1 = (
    "differs from step 1: the update rule itself differs (eps placement, bias correction, weight decay, "
    "which side is rotated, or the basis used at t = 1)"
)
CAUSE_REFRESH = (
    "diverges right after a basis refresh: check your SVD sign/completion convention against docs/spec.md "
    "(and that the moments are carried over unrotated)"
)
CAUSE_SCHEDULE = (
    "diverges one step before a refresh of the spec: check the refresh schedule "
    "(t = 1 and (t - 1) mod T == 0, not t mod T == 0)"
)
CAUSE_FLOAT32 = "drift grows like float32 rounding: compute in float64 to compare with a float64 fixture"
CAUSE_NONFINITE = "non-finite values (NaN or Inf) in the trajectory"
CAUSE_OTHER = (
    "diverges between refreshes: check the moment EMAs and the step-size schedule "
    "(beta-hat, beta2 schedule, clipping, relative step)"
)

_EPS32 = float(np.finfo(np.float32).eps)


@dataclass(frozen=True)
class ComparisonReport:
    """Result of :func:`compare`.

    Attributes:
        case: fixture name.
        first_diverging_step: first ``t`` (1-based) at which some entry of
            ``W_{t+1}`` violates ``|x - y| <= atol + rtol |y|``; ``None`` if none.
        max_abs_error: ``max_ij |x - y|`` per step (shape ``(K,)``).
        max_rel_error: ``max_abs_error[t] / max_ij |y|`` per step, the error on
            the scale of the golden parameter (entrywise relative errors of
            entries near zero say nothing and are not reported).
        tolerance_ratio: ``max_ij |x - y| / (atol + rtol |y|)`` per step (> 1 fails).
        refresh_steps: the fixture's refresh steps.
        likely_cause: a hint when the error pattern points to a known mistake.
    """

    case: str
    steps: int
    rtol: float
    atol: float
    first_diverging_step: int | None
    max_abs_error: np.ndarray
    max_rel_error: np.ndarray
    tolerance_ratio: np.ndarray
    refresh_steps: tuple[int, ...]
    likely_cause: str | None
    candidate_dtype: str

    @property
    def passed(self) -> bool:
        return self.first_diverging_step is None

    def summary(self) -> str:
        """One line: pass, or the first diverging step and the cause."""
        if self.passed:
            worst = float(np.max(self.tolerance_ratio)) if self.steps else 0.0
            return f"{self.case}: OK ({self.steps} steps, worst error {worst:.2g} x tolerance)"
        t = self.first_diverging_step
        return f"{self.case}: diverges at step {t} of {self.steps}; likely cause: {self.likely_cause}"

    def table(self) -> str:
        """Per-step errors, refresh steps marked with ``R``."""
        lines = ["   t  R    max abs err    max rel err   err/tol"]
        for k in range(self.steps):
            t = k + 1
            mark = "R" if t in self.refresh_steps else " "
            flag = "  <- first divergence" if t == self.first_diverging_step else ""
            lines.append(
                f"{t:4d}  {mark}  {self.max_abs_error[k]:13.3e}  {self.max_rel_error[k]:13.3e}"
                f"  {self.tolerance_ratio[k]:8.2g}{flag}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"{self.summary()}\n(rtol={self.rtol:g}, atol={self.atol:.3g})\n{self.table()}"


def _resolve_case(fixture: GoldenCase | str | Path, directory: str | Path | None) -> GoldenCase:
    if isinstance(fixture, GoldenCase):
        return fixture if fixture.arrays else load_case(fixture.name, directory)
    return load_case(fixture, directory)


def run_step_fn(step_fn: StepFn, case: GoldenCase) -> np.ndarray:
    """Drive ``step_fn(W_t, G_t, t) -> W_{t+1}`` over the case's gradients (its own trajectory, t = 1..K).

    Inputs are NumPy arrays of the fixture's dtype and shape; the return value
    may be any array convertible to NumPy (NumPy, torch, JAX, CuPy, ...).
    """
    w = np.array(case.w0, copy=True)
    out = []
    for k in range(case.steps):
        w_new = to_numpy(step_fn(np.array(w, copy=True), np.array(case.grads[k], copy=True), k + 1))
        w = np.asarray(w_new).reshape(case.shape)
        out.append(w)
    return np.stack(out, axis=0) if out else np.zeros((0, *case.shape), dtype=case.w0.dtype)


def completion_steps(case: GoldenCase) -> tuple[int, ...]:
    """Refresh steps whose canonical basis has columns beyond the gradient's numerical rank.

    That is every refresh of a two-sided optimizer on a non-square matrix (the
    ``n - m`` extra columns of ``Q``) and every refresh on a rank-deficient
    gradient: the convention of docs/spec.md fixes these columns, LAPACK does not.
    """
    cfg = case.make_config()
    layout = layout_for(case.shape, cfg)
    if not layout.rotate_left:
        return ()
    out = []
    for t in case.refresh_steps:
        g = to_work(np.asarray(case.grads[t - 1]), layout, np)
        rank = canonical_svd(g, compute_q=False).rank
        if rank < layout.rows or (layout.rotate_right and rank < layout.cols):
            out.append(t)
    return tuple(out)


def likely_cause(
    first: int | None,
    max_rel_error: np.ndarray,
    refresh_steps: tuple[int, ...],
    *,
    completion_steps: tuple[int, ...] = (),
    fixture_dtype: str = "float64",
    candidate_dtype: str = "float64",
    finite: bool = True,
) -> str | None:
    """The heuristics behind :attr:`ComparisonReport.likely_cause`, in order.

    1. non-finite output;
    2. float32 rounding: a float64 fixture and errors on the parameter's scale
       that never exceed ``64 eps32 t`` at step ``t`` (slow growth, no jump),
       stay above ``eps32 / 64`` at every step from the first divergence on
       (rounding never cancels exactly), and either come from a float32
       candidate or reach ``eps32 / 16``;
    3. first divergence at ``t = 1``;
    4. first divergence at a refresh step ``t > 1``, or one step after a refresh
       whose basis has null-space (completion) columns (``completion_steps``):
       those columns multiply exact zeros on the refresh step itself and are
       first felt one step later;
    5. first divergence one step before a refresh;
    6. otherwise: between refreshes.
    """
    if first is None:
        return None
    if not finite:
        return CAUSE_NONFINITE
    steps = np.arange(1, max_rel_error.size + 1)
    if fixture_dtype == "float64" and max_rel_error.size:
        bounded = bool(np.all(max_rel_error <= 64 * _EPS32 * steps))
        persistent = bool(np.all(max_rel_error[first - 1 :] >= _EPS32 / 64))
        if bounded and persistent and (candidate_dtype != "float64" or float(np.max(max_rel_error)) >= _EPS32 / 16):
            return CAUSE_FLOAT32
    if first == 1:
        return CAUSE_STEP1
    if first in refresh_steps:
        return f"{CAUSE_REFRESH} (refresh at step {first})"
    if first - 1 in completion_steps:
        return f"{CAUSE_REFRESH} (refresh at step {first - 1}, whose basis has null-space completion columns)"
    if first + 1 in refresh_steps:
        return f"{CAUSE_SCHEDULE} (spec refresh at step {first + 1})"
    return CAUSE_OTHER


def compare(
    step_fn_or_trajectory: StepFn | Any,
    fixture: GoldenCase | str | Path,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    directory: str | Path | None = None,
) -> ComparisonReport:
    """Compare an implementation with one golden case.

    Args:
        step_fn_or_trajectory: either a callable ``step_fn(W_t, G_t, t) -> W_{t+1}``
            (stateful: a fresh optimizer built from ``case.config``; called for
            t = 1..K on its own outputs), or a trajectory array of shape
            ``(K, *shape)`` with row ``t - 1`` = ``W_{t+1}`` (a ``(K + 1, ...)``
            array is taken to start with ``W_1`` and its first row is dropped).
        fixture: a :class:`~adadiag_ref.golden.GoldenCase`, a case name of the
            shipped set (or of ``directory``), or the path of a case's ``.npz``.
        rtol, atol: override the tolerances stored in the manifest.

    Returns:
        A :class:`ComparisonReport` (it never raises on a mismatch; see
        :func:`assert_trajectory_close`).
    """
    case = _resolve_case(fixture, directory)
    if callable(step_fn_or_trajectory):
        traj = run_step_fn(step_fn_or_trajectory, case)
    else:
        traj = np.asarray(to_numpy(step_fn_or_trajectory))
        if traj.shape[0] == case.steps + 1:
            traj = traj[1:]
    expected = np.asarray(case.params)
    if traj.shape != expected.shape:
        raise ValueError(f"trajectory has shape {traj.shape}, the case {case.name!r} expects {expected.shape}")
    candidate_dtype = str(traj.dtype)
    rtol = case.tolerance.rtol if rtol is None else rtol
    atol = case.tolerance.atol if atol is None else atol
    x = traj.astype(np.float64).reshape(case.steps, -1)
    y = expected.astype(np.float64).reshape(case.steps, -1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.abs(x - y)
        diff = np.where(np.isfinite(x), diff, np.inf)
        bound = atol + rtol * np.abs(y)
        ratio = np.where(bound > 0, diff / np.where(bound > 0, bound, 1.0), np.where(diff > 0, np.inf, 0.0))
        max_abs = diff.max(axis=1) if x.size else np.zeros(case.steps)
        scale = np.abs(y).max(axis=1) if y.size else np.zeros(case.steps)
        max_rel = np.where(scale > 0, max_abs / np.where(scale > 0, scale, 1.0), np.where(max_abs > 0, np.inf, 0.0))
        max_ratio = ratio.max(axis=1) if x.size else np.zeros(case.steps)
    bad = np.flatnonzero(max_ratio > 1.0)
    first = int(bad[0]) + 1 if bad.size else None
    finite = bool(np.all(np.isfinite(x[: first or case.steps])))
    cause = likely_cause(
        first,
        max_rel,
        case.refresh_steps,
        completion_steps=completion_steps(case) if first is not None else (),
        fixture_dtype=case.dtype,
        candidate_dtype=candidate_dtype,
        finite=finite,
    )
    return ComparisonReport(
        case=case.name,
        steps=case.steps,
        rtol=rtol,
        atol=atol,
        first_diverging_step=first,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        tolerance_ratio=max_ratio,
        refresh_steps=case.refresh_steps,
        likely_cause=cause,
        candidate_dtype=candidate_dtype,
    )


def assert_trajectory_close(
    step_fn_or_trajectory: StepFn | Any,
    fixture: GoldenCase | str | Path,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    directory: str | Path | None = None,
) -> ComparisonReport:
    """:func:`compare`, raising ``AssertionError`` with the full report on a mismatch."""
    report = compare(step_fn_or_trajectory, fixture, rtol=rtol, atol=atol, directory=directory)
    if not report.passed:
        raise AssertionError(str(report))
    return report
