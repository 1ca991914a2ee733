"""Compare a port with a golden case, parameters and states, step by step: the machinery behind
:mod:`adadiag_ref.testing`.

It lives in the ``golden`` package, beside the format it reads and the
verification (:mod:`adadiag_ref.golden.verify`) that uses it, so that imports
run one way: ``adadiag_ref.testing`` (the public face) imports ``golden``,
never the reverse.

:func:`compare` returns a :class:`ComparisonReport`: the first step, field
(``W``, the parameter, or a state field ``count P Q M V r s u v``) and entry
that leave the tolerance, the largest parameter error at every step, the
patterns recognised in the first wrong field ("columns of P differ by sign",
"P and Q swapped", "transposed", "off by one step in the bias correction"),
and a hint drawn only from that evidence.  A port that raises is a failed
comparison with its traceback.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._xp import to_numpy
from ..config import AdafactorConfig, AdamConfig, BaseConfig
from ..linalg import canonical_svd
from ..optim.layout import layout_for, to_work
from ..optim.schedules import beta_hat, first_moment_decay
from .conventions import recognise
from .format import STATE_FIELDS, GoldenCase, load_case

__all__ = [
    "CAUSE_FLOAT32",
    "CAUSE_NONFINITE",
    "CAUSE_OTHER",
    "CAUSE_RAISED",
    "CAUSE_REFRESH",
    "CAUSE_SCHEDULE",
    "CAUSE_STEP1",
    "CAUSE_STEP1_UNROTATED",
    "CAUSE_STEP2",
    "EDGE_RATIO",
    "KNOWN_STATE_NAMES",
    "MOMENT_CONVENTIONS",
    "PARAMETER",
    "ComparisonReport",
    "Mismatch",
    "assert_trajectory_close",
    "compare",
    "completion_steps",
    "error_report",
    "likely_cause",
    "parse_state_map",
    "port_traceback",
    "run_step_fn",
]

StepFn = Callable[[np.ndarray, np.ndarray, int], Any]

PARAMETER = "W"
"""The field name of the parameter ``W_{t+1}`` in a :class:`Mismatch` (beside the state fields)."""
FIELD_ORDER = ("count", "P", "Q", "V", "r", "s", "M", "u", "v", PARAMETER)
"""The order in which one step's fields are checked: the order the step computes them (counter, bases, second
moments, first moments: Adafactor's ``M`` averages ``G~ / sqrt(V)``, then the parameter), so the first wrong field
of a step is the one the error starts in, not one it spread to."""

CAUSE_STEP1 = (
    "differs from step 1: the update rule itself differs (eps placement, bias correction, weight decay, "
    "which side is rotated, or the basis used at t = 1)"
)
CAUSE_STEP1_UNROTATED = (
    "differs from step 1: the update rule itself differs (eps placement, bias correction, weight decay, the step size)"
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
CAUSE_RAISED = "the port raised"
CAUSE_STEP2 = (
    "diverges at step 2, one step after a refresh whose basis has null-space completion columns: either those "
    "columns (they multiply exact zeros on the refresh step and are first felt one step later) or the moment "
    "update (beta-hat is 0 at t = 1, which hides most moment bugs until step 2); return the state from the step "
    "function to tell which"
)

_EPS32 = float(np.finfo(np.float32).eps)

EDGE_RATIO = 2.0
"""A field whose error never exceeds this many tolerances at any step is at the tolerance's edge, not diverging:
its error is rounding of the size the tolerance was set at (a bug the kit names moves a value by >= 1e-9 of its
scale, 1000x a float64 tolerance), so the report says so instead of "diverges" (it still fails)."""

MOMENT_CONVENTIONS = ("auto", "raw", "corrected")
"""How a port's ``M``, ``V`` relate to the fixture's bias-corrected EMAs (:func:`compare`'s ``moments``)."""


@dataclass(frozen=True)
class Mismatch:
    """The first entry that leaves the tolerance.

    Attributes:
        step: ``t`` (1-based): the value after step ``t`` (``W_{t+1}``, or the state after step ``t``).
        field: ``"W"`` (:data:`PARAMETER`) or a state field (``count P Q M V r s u v``, work frame).
        index: the entry (the worst one of that field at that step), ``()`` for a shape mismatch.
        got, want: the port's and the fixture's value there (``nan`` for a shape mismatch).
        bound: ``atol + rtol |want|`` there; ``|got - want| > bound``.
        violations: how many entries of the field leave the tolerance at that step.
        note: what else is known (a shape mismatch: both shapes).
    """

    step: int
    field: str
    index: tuple[int, ...]
    got: float
    want: float
    bound: float
    violations: int
    note: str = ""

    def describe(self) -> str:
        """``step 5, P[0, 1]: got -0.70710678, expected 0.70710678 (...)``."""
        if self.note:
            return f"step {self.step}, {self.field}: {self.note}"
        where = f"{self.field}[{', '.join(map(str, self.index))}]" if self.index else self.field
        error = abs(self.got - self.want)
        ratio = error / self.bound if self.bound > 0 else float("inf")
        return (
            f"step {self.step}, {where}: got {self.got:.10g}, expected {self.want:.10g} "
            f"(|error| {error:.3g} = {ratio:.3g} x tolerance; {self.violations} "
            f"entr{'y' if self.violations == 1 else 'ies'} out)"
        )

    def to_dict(self) -> dict[str, Any]:
        floats = {name: _json_float(getattr(self, name)) for name in ("got", "want", "bound")}
        return {**asdict(self), "index": list(self.index), **floats}


def _json_float(x: float) -> float | str:
    """A float JSON can hold (``nan``/``inf`` as strings)."""
    return x if np.isfinite(x) else str(x)


@dataclass(frozen=True)
class ComparisonReport:
    """Result of :func:`compare`.

    Attributes:
        case: fixture name.
        first_diverging_step: first ``t`` (1-based) at which the parameter ``W_{t+1}`` or a state field
            compared leaves the tolerance, or at which the port raised; ``None`` if none.
        max_abs_error: ``max_ij |x - y|`` of the parameter per step (shape ``(K,)``; ``nan`` for steps the
            port did not reach).
        max_rel_error: ``max_abs_error[t] / max_ij |y|`` per step, the error on
            the scale of the golden parameter (entrywise relative errors of
            entries near zero say nothing and are not reported).
        tolerance_ratio: ``max_ij |x - y| / (atol + rtol |y|)`` per step (> 1 fails).
        refresh_steps: the fixture's refresh steps.
        likely_cause: a hint drawn from the evidence (the first wrong field, the patterns, the steps).
        first_mismatch: the first step, field and entry out of tolerance (:class:`Mismatch`), or ``None``.
        patterns: what the first wrong field is recognised as (columns differing by sign, P and Q swapped,
            transposed, off by one step in the bias correction).
        state_fields: the state fields the port returned and that were compared (``()``: parameters only).
        error: the port's traceback when it raised (at step ``error_step``), else ``None``.
        conditioning: ``kappa_t`` per step, how well the bases in use at step ``t`` are determined
            (:meth:`~adadiag_ref.golden.GoldenCase.conditioning_per_step`; empty when not used).
        step_rtol, step_atol, step_state_rtol: the tolerances applied at each step: ``rtol``, ``atol`` and
            ``state_rtol`` widened by the conditioning where it is larger (docs/golden.md, "Tolerances").
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
    first_mismatch: Mismatch | None = None
    patterns: tuple[str, ...] = ()
    state_fields: tuple[str, ...] = ()
    error: str | None = None
    error_step: int | None = None
    state_rtol: float = 0.0
    conditioning: np.ndarray = field(default_factory=lambda: np.zeros(0))
    step_rtol: np.ndarray = field(default_factory=lambda: np.zeros(0))
    step_atol: np.ndarray = field(default_factory=lambda: np.zeros(0))
    step_state_rtol: np.ndarray = field(default_factory=lambda: np.zeros(0))
    field_status: tuple[tuple[str, int | None, float], ...] = ()
    moment_notes: tuple[str, ...] = ()
    rotated: bool = True
    not_applicable: str | None = None

    @property
    def passed(self) -> bool:
        return self.first_diverging_step is None and self.not_applicable is None

    @property
    def failed(self) -> bool:
        """Ran and did not conform (a case that does not apply to the port is neither passed nor failed)."""
        return self.not_applicable is None and self.first_diverging_step is not None

    @property
    def at_edge(self) -> bool:
        """Every field out of tolerance stays within :data:`EDGE_RATIO` tolerances at every step (and the port
        ran to the end): rounding at the tolerance's edge, not a divergence."""
        out = [(f, ratio) for f, first, ratio in self.field_status if first is not None]
        return bool(out) and self.error is None and all(ratio <= EDGE_RATIO for _, ratio in out)

    def field_verdicts(self) -> str:
        """Each compared field on its own: ``W agrees at all 12 steps; V differs from step 1; count agrees``."""
        ordered = sorted(self.field_status, key=lambda f: f[0] != PARAMETER)  # W first, then the states
        return "; ".join(
            f"{name} agrees at all {self.steps} steps" if first is None else f"{name} differs from step {first}"
            for name, first, _ in ordered
        )

    @property
    def widened_from(self) -> int | None:
        """The first step whose tolerance the basis conditioning widened, or ``None``."""
        wider = np.flatnonzero((self.step_rtol > self.rtol) | (self.step_state_rtol > self.state_rtol))
        return int(wider[0]) + 1 if wider.size else None

    def tolerance_note(self) -> str:
        """Why the tolerance is what it is: the case's own, or widened by the basis conditioning from step t."""
        t = self.widened_from
        if t is None:
            return ""
        k = int(np.argmax(self.step_rtol))
        return (
            f"tolerance widened by the basis conditioning from step {t}: the bases are determined only to "
            f"kappa {self.conditioning[k]:.2g} (a near-tie or a rank decision at a refresh; docs/golden.md, "
            f"Tolerances), so rtol up to {self.step_rtol[k]:.2g} (case: {self.rtol:g}), atol up to "
            f"{self.step_atol[k]:.2g}, state_rtol up to {float(np.max(self.step_state_rtol)):.2g}"
        )

    def summary(self) -> str:
        """One line: pass (and what was compared), not applicable (why), or the first diverging step, the first
        wrong entry, each compared field's own verdict and the hint."""
        if self.not_applicable is not None:
            return f"{self.case}: not applicable: {self.not_applicable}"
        checked = f"; states {', '.join(self.state_fields)}" if self.state_fields else "; parameters only"
        if self.passed:
            ratio = self.tolerance_ratio[np.isfinite(self.tolerance_ratio)]
            worst = float(np.max(ratio)) if ratio.size else 0.0
            note = f"; {self.tolerance_note()}" if self.widened_from is not None else ""
            moments = f"; moments {', '.join(self.moment_notes)}" if self.moment_notes else ""
            every = "; every compared field agrees at every step" if self.state_fields else ""
            compared = f"{checked}{moments}{every}{note}"
            return f"{self.case}: OK ({self.steps} steps, worst error {worst:.2g} x tolerance{compared})"
        t = self.first_diverging_step
        if self.first_mismatch is None and self.error is not None:
            where = f"at step {self.error_step} of {self.steps}" if self.error_step else "before its first step"
            return f"{self.case}: FAILED, the port failed {where}; likely cause: {self.likely_cause}"
        if self.at_edge:
            worst = max(ratio for _, first, ratio in self.field_status if first is not None)
            text = (
                f"{self.case}: at the tolerance's edge from step {t} of {self.steps} (never more than {worst:.4g} x "
                f"tolerance, at any step: rounding, not a divergence; --rtol/--state-rtol to accept it)"
            )
        else:
            text = f"{self.case}: diverges at step {t} of {self.steps}"
        if self.first_mismatch is not None:
            text += f": {self.first_mismatch.describe()}"
        if len(self.field_status) > 1:
            text += f"; {self.field_verdicts()}"
        if self.patterns:
            text += f"; pattern: {'; '.join(self.patterns)}"
        return text if self.likely_cause in self.patterns else f"{text}; likely cause: {self.likely_cause}"

    def table(self) -> str:
        """Per-step parameter errors, refresh steps marked with ``R`` (a rotated optimizer's); the row where ``W``
        first leaves the tolerance, and the row where a state field does first when that is earlier, flagged."""
        widened = self.widened_from is not None
        lines = [
            f"   t  {'R' if self.rotated else ' '}    max abs err    max rel err   err/tol"
            + ("       rtol" if widened else "")
        ]
        w_first = next((first for name, first, _ in self.field_status if name == PARAMETER), None)
        if not self.field_status and self.first_mismatch is not None and self.first_mismatch.field == PARAMETER:
            w_first = self.first_mismatch.step
        state_first = self.first_mismatch
        for k in range(self.steps):
            t = k + 1
            mark = "R" if self.rotated and t in self.refresh_steps else " "
            flag = "  <- first divergence" if t == w_first else ""
            if state_first is not None and state_first.field != PARAMETER and t == state_first.step:
                if w_first is None or t < w_first:
                    flag = f"  <- {state_first.field} differs first (W within tolerance here)"
            rtol = f"  {self.step_rtol[k]:9.2g}" if widened else ""
            lines.append(
                f"{t:4d}  {mark}  {self.max_abs_error[k]:13.3e}  {self.max_rel_error[k]:13.3e}"
                f"  {self.tolerance_ratio[k]:8.2g}{rtol}{flag}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        if self.not_applicable is not None:
            return self.summary()
        text = f"{self.summary()}\n(rtol={self.rtol:g}, atol={self.atol:.3g}"
        text += f", state_rtol={self.state_rtol:g})" if self.state_fields else ")"
        if self.widened_from is not None and not self.passed:
            text += f"\n{self.tolerance_note()}"
        text += f"\n{self.table()}"
        if self.error:
            where = f"at step {self.error_step}" if self.error_step else "before its first step"
            text += f"\nthe port failed {where}:\n{self.error.rstrip()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record (``adadiag-ref conform --json``)."""

        def floats(a: np.ndarray) -> list[float | str]:
            return [_json_float(float(x)) for x in a]

        return {
            "case": self.case,
            "passed": self.passed,
            "steps": self.steps,
            "first_diverging_step": self.first_diverging_step,
            "first_mismatch": None if self.first_mismatch is None else self.first_mismatch.to_dict(),
            "patterns": list(self.patterns),
            "likely_cause": self.likely_cause,
            "state_fields": list(self.state_fields),
            "not_applicable": self.not_applicable,
            "fields": {
                name: {"first_out": first, "worst_ratio": _json_float(ratio)}
                for name, first, ratio in self.field_status
            },
            "moment_notes": list(self.moment_notes),
            "at_edge": self.at_edge,
            "error_step": self.error_step,
            "error": self.error,
            "rtol": self.rtol,
            "atol": self.atol,
            "state_rtol": self.state_rtol,
            "conditioning": floats(self.conditioning),
            "step_rtol": floats(self.step_rtol),
            "step_atol": floats(self.step_atol),
            "step_state_rtol": floats(self.step_state_rtol),
            "tolerance_note": self.tolerance_note(),
            "refresh_steps": list(self.refresh_steps),
            "candidate_dtype": self.candidate_dtype,
            "max_abs_error": floats(self.max_abs_error),
            "tolerance_ratio": floats(self.tolerance_ratio),
        }


_KIT = str(Path(__file__).resolve().parent)


def port_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without the kit's own frames (``adadiag_ref/golden``): what the port did, from its
    first frame to the raise (the porter reads their code, not the driver's)."""
    info = traceback.TracebackException.from_exception(exc)
    kept = [frame for frame in info.stack if not str(Path(frame.filename).resolve()).startswith(_KIT)]
    info.stack = traceback.StackSummary.from_list(kept)
    return "".join(info.format())


def _resolve_case(fixture: GoldenCase | str | Path, directory: str | Path | None) -> GoldenCase:
    if isinstance(fixture, GoldenCase):
        return fixture if fixture.arrays else load_case(fixture.name, directory)
    return load_case(fixture, directory)


@dataclass
class _Run:
    """What driving a step function produced: parameters and states up to the step that raised (if any)."""

    params: list[np.ndarray] = field(default_factory=list)
    states: dict[str, list[np.ndarray]] = field(default_factory=dict)
    error: str | None = None
    error_step: int | None = None
    renamed: set[str] = field(default_factory=set)


def _host(value: Any) -> np.ndarray:
    """A port's value as a host array: an array of any backend, or a Python number (``count`` kept as an int)."""
    if isinstance(value, int | float):
        return np.asarray(value)
    return to_numpy(value)


KNOWN_STATE_NAMES: dict[str, str] = {"step": "count", "exp_avg": "M", "exp_avg_sq": "V", "mu": "M", "nu": "V"}
"""State names of the layouts the kit recognises, and the fixture field each holds: torch.optim's Adam/AdamW
(``step``, ``exp_avg``, ``exp_avg_sq``) and optax's ``ScaleByAdamState`` (``count``, ``mu``, ``nu``).  Their
moments are the raw EMAs; the fixture's are bias-corrected (docs/golden.md): see ``moments`` of :func:`compare`."""


def parse_state_map(text: str) -> dict[str, str]:
    """``"exp_avg=M,exp_avg_sq=V"`` as ``{"exp_avg": "M", "exp_avg_sq": "V"}`` (each target a fixture state field).

    Raises ``ValueError`` naming a malformed pair or an unknown field."""
    out = {}
    for pair in (p.strip() for p in text.split(",")):
        if not pair:
            continue
        source, sep, target = (x.strip() for x in pair.partition("="))
        if not sep or not source or target not in STATE_FIELDS:
            raise ValueError(f"state map {pair!r}: expected NAME=FIELD with FIELD one of {', '.join(STATE_FIELDS)}")
        out[source] = target
    return out


def _state_arrays(state: Any, names: Mapping[str, str]) -> dict[str, np.ndarray]:
    """A step function's state as ``{field: host array}``: a mapping or a NamedTuple, its keys renamed by ``names``
    (:data:`KNOWN_STATE_NAMES` and the porter's map); keys that name no fixture field are ignored."""
    items = state._asdict().items() if hasattr(state, "_asdict") else dict(state).items()
    out = {}
    for key, value in items:
        name = names.get(key, key)
        if name in STATE_FIELDS and value is not None and name not in out:
            out[name] = np.array(_host(value), copy=True)
    return out


def _outputs(step_fn: StepFn, case: GoldenCase) -> Iterator[tuple[np.ndarray, Any]]:
    """``(W_{t+1}, state or None)`` for t = 1..K, ``step_fn`` driven on its own outputs over the case's gradients
    (fresh copies of ``W_t`` and ``G_t`` each step); an exception of ``step_fn`` propagates."""
    w = np.array(case.w0, copy=True)
    for k in range(case.steps):
        out = step_fn(np.array(w, copy=True), np.array(case.grads[k], copy=True), k + 1)
        state = None
        if isinstance(out, tuple) and len(out) == 2:
            out, state = out
        w = np.asarray(to_numpy(out)).reshape(case.shape)
        yield w, state


def _drive(step_fn: StepFn, case: GoldenCase, names: Mapping[str, str]) -> _Run:
    """Run ``step_fn`` over the case's gradients; an exception ends the run and is recorded with its traceback."""
    run = _Run()
    try:
        for w, state in _outputs(step_fn, case):
            fields_ = _state_arrays(state, names) if state is not None else {}
            if state is not None and not run.params:
                keys = state._fields if hasattr(state, "_fields") else list(dict(state))
                run.renamed = _renamed(keys, names)
            run.params.append(w)
            for name, value in fields_.items():
                run.states.setdefault(name, []).append(value)
    except Exception as exc:  # the port's failure is the result: recorded, and the other cases still run
        run.error, run.error_step = port_traceback(exc), len(run.params) + 1
    return run


def run_step_fn(step_fn: StepFn, case: GoldenCase) -> np.ndarray:
    """Drive ``step_fn(W_t, G_t, t) -> W_{t+1}`` over the case's gradients (its own trajectory, t = 1..K).

    Inputs are NumPy arrays of the fixture's dtype and shape; the return value
    may be any array convertible to NumPy (NumPy, torch, JAX, CuPy, ...), or a pair
    ``(W_{t+1}, state)`` (the state is dropped here; :func:`compare` checks it).
    An exception of ``step_fn`` propagates.
    """
    out = [w for w, _ in _outputs(step_fn, case)]
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
    """The hint from the parameters alone (no state returned), in order.

    1. non-finite output;
    2. float32 rounding: a float64 fixture, a float32 candidate, and errors on the parameter's scale
       that never exceed ``64 eps32 t`` at step ``t`` (slow growth, no jump) and stay above
       ``eps32 / 64`` at every step from the first divergence on (rounding never cancels exactly).
       A float64 candidate never gets this hint: small errors of a float64 port are evidence of a
       small bug, not of float32 rounding;
    3. first divergence at ``t = 1``;
    4. first divergence at a refresh step ``t > 1``;
    5. first divergence at ``t = 2`` after a refresh at ``t = 1`` with null-space completion columns: the
       parameters cannot tell the completion from the moment update (:data:`CAUSE_STEP2`); one step after a
       later such refresh: the refresh;
    6. first divergence one step before a refresh;
    7. otherwise: between refreshes.
    """
    if first is None:
        return None
    if not finite:
        return CAUSE_NONFINITE
    steps = np.arange(1, max_rel_error.size + 1)
    if fixture_dtype == "float64" and candidate_dtype == "float32" and max_rel_error.size:
        rel = max_rel_error[np.isfinite(max_rel_error)]
        bounded = bool(np.all(rel <= 64 * _EPS32 * steps[: rel.size]))
        persistent = bool(np.all(rel[first - 1 :] >= _EPS32 / 64))
        if bounded and persistent:
            return CAUSE_FLOAT32
    if first == 1 and 1 in completion_steps:
        return (
            f"{CAUSE_STEP1}; the refresh at step 1 is rank-deficient: also the refresh-step structure of G~ "
            "(docs/spec.md, section 5: exact zeros beyond the numerical rank)"
        )
    if first == 1:
        return CAUSE_STEP1
    if first in refresh_steps:
        return f"{CAUSE_REFRESH} (refresh at step {first})"
    if first == 2 and 1 in completion_steps:
        return CAUSE_STEP2
    if first - 1 in completion_steps:
        return f"{CAUSE_REFRESH} (refresh at step {first - 1}, whose basis has null-space completion columns)"
    if first + 1 in refresh_steps:
        return f"{CAUSE_SCHEDULE} (spec refresh at step {first + 1})"
    return CAUSE_OTHER


# ----------------------------------------------------------------------------- entrywise checks


def _within(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> bool:
    """``|got - want| <= atol + rtol |want|`` everywhere (same shapes; non-finite ``got`` fails)."""
    if got.shape != want.shape:
        return False
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return bool(np.all(np.isfinite(diff) & (diff <= atol + rtol * np.abs(want.astype(np.float64)))))


def _same_shape(got: np.ndarray, want: np.ndarray) -> np.ndarray | None:
    """``got`` in ``want``'s shape (``(n,)`` for a stored ``1 x n``: the same numbers), or ``None``."""
    if got.shape == want.shape:
        return got
    if got.size == want.size and tuple(d for d in got.shape if d != 1) == tuple(d for d in want.shape if d != 1):
        return got.reshape(want.shape)
    return None


def _ratios(
    x: np.ndarray, y: np.ndarray, rtol: float | np.ndarray, atol: float | np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(|x - y| / bound, |x - y|, bound = atol + rtol |y|)`` entrywise, in float64 (non-finite ``x``: an ``inf``
    error); ``rtol``, ``atol`` broadcast against ``y`` (one per step: a column)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.where(np.isfinite(x), np.abs(x - y), np.inf)
        bound = atol + rtol * np.abs(y)
        ratio = np.where(bound > 0, diff / np.where(bound > 0, bound, 1.0), np.where(diff > 0, np.inf, 0.0))
    return ratio, diff, bound


def _check_field(
    t: int, name: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float
) -> tuple[float, Mismatch | None]:
    """The worst ``error / tolerance`` of one field at one step (``inf``: another shape or count), and its worst
    entry when some entry is out of tolerance (or the shapes differ)."""
    same = _same_shape(got, want)
    if same is None:
        note = f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        return float("inf"), Mismatch(t, name, (), float("nan"), float("nan"), 0.0, want.size, note)
    if name == "count":
        if np.array_equal(same.astype(np.int64), want.astype(np.int64)):
            return 0.0, None
        return float("inf"), Mismatch(t, name, (), float(np.ravel(same)[0]), float(np.ravel(want)[0]), 0.0, 1)
    x, y = same.astype(np.float64), want.astype(np.float64)
    ratio, _, bound = _ratios(x, y, rtol, atol)
    worst = float(np.max(ratio)) if ratio.size else 0.0
    out = ratio > 1.0
    if not np.any(out):
        return worst, None
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
    return worst, Mismatch(t, name, index, float(x[index]), float(y[index]), float(bound[index]), int(np.sum(out)))


def _state_atol(want: np.ndarray, rtol: float) -> float:
    """A state array's ``atol``: ``state_rtol * max |array|`` (``V`` spans decades, ``P`` and ``Q`` are O(1))."""
    return rtol * float(np.max(np.abs(want.astype(np.float64)))) if want.size else 0.0


# ----------------------------------------------------------------------------- patterns of the first wrong field


def _sign_pattern(name: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> str | None:
    """Columns of a basis equal to the reference's up to their signs."""
    if name not in ("P", "Q") or got.shape != want.shape or got.ndim != 2:
        return None
    signs = np.where(np.sum(got * want, axis=0) < 0, -1.0, 1.0)
    if np.all(signs > 0) or not _within(got * signs, want, rtol, atol):
        return None
    flipped = ", ".join(str(j) for j in np.flatnonzero(signs < 0))
    return f"columns {flipped} of {name} differ by sign (the sign rule of docs/spec.md, canonical SVD)"


def _swap_pattern(name: str, got: np.ndarray, golden: Mapping[str, np.ndarray], rtol: float) -> str | None:
    """``P`` holding the reference's ``Q`` (or the reverse), up to column signs."""
    other = {"P": "Q", "Q": "P"}.get(name)
    if other is None or other not in golden:
        return None
    want = golden[other]
    if got.shape != want.shape:
        return None
    signs = np.where(np.sum(got * want, axis=0) < 0, -1.0, 1.0)
    if _within(got * signs, want, rtol, _state_atol(want, rtol)):
        return "P and Q swapped"
    return None


def _transposed_pattern(name: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> str | None:
    if got.ndim != 2 or got.shape[::-1] != want.shape or _within(got, want, rtol, atol):
        return None
    if _within(got.T, want, rtol, atol):
        return f"{name} is transposed (the work frame of docs/spec.md: m x n with m <= n, P is m x m)"
    return None


def _ema_decay(cfg: BaseConfig, name: str) -> Callable[[int], float] | None:
    """The EMA coefficient ``beta_t`` of a moment field (``F_t = beta_t F_{t-1} + (1 - beta_t) X_t``)."""
    if name in ("M", "u", "v"):
        return lambda t: float(first_moment_decay(cfg, float(t), np))
    if name in ("V", "r", "s"):
        if isinstance(cfg, AdafactorConfig) and cfg.beta2_schedule == "adafactor":
            return lambda t: float(-np.expm1(-cfg.decay_rate * np.log(t)))  # Adafactor's 1 - t^(-c)
        return lambda t: float(beta_hat(cfg.betas[1], float(t), np, bias_correction=cfg.bias_correction))
    return None


def _off_by_one_pattern(
    name: str, t: int, got: np.ndarray, case: GoldenCase, cfg: BaseConfig, rtol: float
) -> str | None:
    """A moment that is the reference's EMA with the coefficient of step ``t - 1`` or ``t + 1``.

    The fixture's own ``F_{t-1}`` and ``F_t`` give the averaged input ``X_t = (F_t - b_t F_{t-1}) / (1 - b_t)``;
    the port's ``F_t`` is then tested against ``b_s F_{t-1} + (1 - b_s) X_t`` for ``s = t -+ 1``.
    """
    decay = _ema_decay(cfg, name)
    want = case.state(t).get(name)
    if decay is None or want is None or got.shape != want.shape:
        return None
    before = case.state(t - 1).get(name) if t > 1 else np.zeros_like(want)
    if before is None:
        return None
    y, y0 = want.astype(np.float64), before.astype(np.float64)
    b_t = decay(t)
    if b_t >= 1.0:
        return None
    x = (y - b_t * y0) / (1.0 - b_t)
    for s in (t - 1, t + 1):
        if s < 1:
            continue
        b_s = decay(s)
        if b_s == b_t:
            continue
        alt = b_s * y0 + (1.0 - b_s) * x
        # the recovered input carries the rounding of 1 / (1 - b_t): a tolerance 10x the state's
        if _within(got, alt, 10 * rtol, 10 * _state_atol(alt, rtol)):
            return f"off by one step in the bias correction: {name} uses the EMA coefficient of step {s} at step {t}"
    return None


FLOAT32_BASIS_RTOL = 1e-4
"""How far a basis from a float32 SVD may sit from the float64 canonical one: ``eps32 / gap`` per column
(``1.2e-7 / gap``), so 1e-4 covers gaps down to ~1e-3 of ``sigma_max``; a wrong convention moves a column by
O(1)."""


def _raw_moment_pattern(name: str, t: int, got: np.ndarray, case: GoldenCase, rtol: float) -> str | None:
    """A moment that is the fixture's times ``1 - beta^t``: the raw EMA where the fixture's is bias-corrected."""
    factors = _bias_factors(case, name)
    want = case.state(t).get(name)
    if factors is None or want is None or got.shape != want.shape:
        return None
    raw = want.astype(np.float64) * factors[t - 1]
    if not _within(got, raw, 10 * rtol, 10 * _state_atol(raw, rtol)):
        return None
    beta = "beta1" if name == "M" else "beta2"
    return (
        f"raw moments: {name} is the fixture's times 1 - {beta}^t ({factors[t - 1]:.6g} at step {t}): a raw EMA, "
        f"where the fixture's {name} is bias-corrected (docs/golden.md); declare moments='raw' (--moments raw)"
    )


def _float32_basis_pattern(name: str, t: int, got: np.ndarray, case: GoldenCase, rtol: float) -> str | None:
    """A basis of a float64 case that agrees with the canonical one only to float32's precision (after column
    signs): the SVD was taken in float32 (flipped columns under float32 noise are named too)."""
    want = case.state(t).get(name)
    if name not in ("P", "Q") or case.dtype != "float64" or want is None or got.shape != want.shape or got.ndim != 2:
        return None
    signs = np.where(np.sum(got * want, axis=0) < 0, -1.0, 1.0)
    aligned = got * signs
    if _within(aligned, want, rtol, _state_atol(want, rtol)):
        return None  # exact up to signs: the sign pattern's
    if not _within(aligned, want, FLOAT32_BASIS_RTOL, FLOAT32_BASIS_RTOL):
        return None
    error = float(np.max(np.abs(aligned - want)))
    flipped = np.flatnonzero(signs < 0)
    text = f"{name} agrees with the canonical basis only to {error:.2g} (float32 precision)"
    if flipped.size:
        text += f" once columns {', '.join(map(str, flipped))} are negated"
    return f"{text}: a basis from a float32 SVD of a float64 gradient; take the SVD in the parameter's dtype"


def _float32_moment_pattern(name: str, t: int, got: np.ndarray, case: GoldenCase, cfg: BaseConfig) -> str | None:
    """A rotated moment of a float64 case that first differs at a refresh, and only at float32's precision (up to
    the signs of its rows, which a basis column's sign flips): the basis came from a float32 SVD."""
    want = case.state(t).get(name)
    if name not in ("M", "V") or not cfg.sides or case.dtype != "float64" or t not in case.refresh_steps:
        return None
    if want is None or got.shape != want.shape or not np.any(want):
        return None
    scale = float(np.max(np.abs(want)))
    relative = float(np.max(np.abs(np.abs(got.astype(np.float64)) - np.abs(want)))) / scale
    if not FLOAT32_MOMENT_LEVEL[0] < relative <= FLOAT32_MOMENT_LEVEL[1]:
        return None
    return (
        f"{name} agrees with the fixture only to {relative:.2g} of its scale at the refresh of step {t} (float32's "
        "precision): a basis from a float32 SVD of a float64 gradient (GaLore casts to float32); take the SVD in "
        "the parameter's dtype"
    )


FLOAT32_MOMENT_LEVEL = (1e-9, 1e-4)
"""The relative error of a moment rotated by a float32 basis: ``eps32 / gap`` (1.2e-7 over the gap, measured
3e-7 .. 2e-6 on the golden cases with GaLore's float32 SVD); float64 rounding stays below 1e-13 and a wrong rule
is O(1)."""


def _patterns(mismatch: Mismatch, got: np.ndarray, case: GoldenCase, cfg: BaseConfig, rtol: float) -> list[str]:
    """Every recognised pattern of the first wrong state field."""
    golden = case.state(mismatch.step)
    want = golden[mismatch.field]
    atol = _state_atol(want, rtol)
    found = [
        _sign_pattern(mismatch.field, got, want, rtol, atol),
        _float32_basis_pattern(mismatch.field, mismatch.step, got, case, rtol),
        _swap_pattern(mismatch.field, got, golden, rtol),
        _transposed_pattern(mismatch.field, got, want, rtol, atol),
        _raw_moment_pattern(mismatch.field, mismatch.step, got, case, rtol),
        _float32_moment_pattern(mismatch.field, mismatch.step, got, case, cfg),
        _off_by_one_pattern(mismatch.field, mismatch.step, got, case, cfg, rtol),
    ]
    return [p for p in found if p]


def _state_hint(mismatch: Mismatch, patterns: list[str], case: GoldenCase, compared: tuple[str, ...]) -> str:
    """The hint when the first wrong value is a state field, or a parameter whose state agrees."""
    t, name = mismatch.step, mismatch.field
    if patterns:
        return patterns[0]
    if name == "count":
        return f"the step counter differs after step {t} (count must be t after step t)"
    if name in ("P", "Q"):
        if t in case.refresh_steps:
            return (
                f"{name} differs from the canonical basis of the refresh at step {t}: the canonical SVD of "
                "docs/spec.md (descending order, numerical rank, clusters, sign rule, null-space completion)"
            )
        return (
            f"{name} changed at step {t}, which is no refresh step of the spec (refreshes at "
            f"{', '.join(map(str, case.refresh_steps))}): the refresh schedule (t = 1 and (t - 1) mod T == 0)"
        )
    bases = [f for f in ("P", "Q") if f in compared]
    agree = f" while {' and '.join(bases)} agree" if bases else ""
    if name == PARAMETER and t in case.refresh_steps and t in completion_steps(case):
        return (
            f"the state after step {t} agrees ({', '.join(compared)}) but W_{{t+1}} does not, at a refresh whose "
            "gradient is rank-deficient: the refresh-step structure of G~ (docs/spec.md, section 5: the entries "
            "beyond the numerical rank are exact zeros on the refresh step)"
        )
    if name == PARAMETER:
        return (
            f"the state after step {t} agrees ({', '.join(compared)}) but W_{{t+1}} does not: the parameter update "
            "from the state (eps placement, weight decay, step size eta_t, the rotation back P U~ Q^T)"
        )
    text = (
        f"{name} is the first field to differ, at step {t}{agree}: its update (EMA coefficients, bias correction, "
        "what is averaged, eps placement, clipping)"
    )
    if t in case.refresh_steps and t > 1:
        text += (
            "; a refresh step: moments are carried over unrotated, and G~ is set to its refresh-step structure "
            "(docs/spec.md, section 5)"
        )
    return text


# ----------------------------------------------------------------------------- compare


def _first_mismatch(
    case: GoldenCase,
    params: np.ndarray,
    states: Mapping[str, np.ndarray],
    rtols: np.ndarray,
    atols: np.ndarray,
    state_rtols: np.ndarray,
) -> tuple[Mismatch | None, np.ndarray | None]:
    """The first (step, field) out of tolerance, fields in :data:`FIELD_ORDER`, with the port's value there
    (the tolerances per step: :meth:`~adadiag_ref.golden.GoldenCase.tolerances_per_step`)."""
    for k in range(params.shape[0]):
        rtol, atol, state_rtol = float(rtols[k]), float(atols[k]), float(state_rtols[k])
        t = k + 1
        golden = case.state(t)
        for name in FIELD_ORDER:
            if name == PARAMETER:
                got, want, r, a = params[k], case.params[k], rtol, atol
            elif name in states and name in golden and k < len(states[name]):
                got, want = np.asarray(states[name][k]), golden[name]
                r, a = state_rtol, _state_atol(want, state_rtol)
            else:
                continue
            _, found = _check_field(t, name, got, want, r, a)
            if found is not None:
                return found, got
    return None, None


def _parameter_errors(traj: np.ndarray, case: GoldenCase, rtol: np.ndarray, atol: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per step: max abs error, max error relative to the step's scale, max error / bound (``nan`` past the run);
    ``rtol``, ``atol``: the tolerances per step."""
    full = np.full(case.steps, np.nan)
    max_abs, max_rel, max_ratio = full.copy(), full.copy(), full.copy()
    n = traj.shape[0]
    if n == 0:
        return max_abs, max_rel, max_ratio
    x, y = traj.reshape(n, -1), np.asarray(case.params[:n]).reshape(n, -1)
    ratio, diff, _ = _ratios(x, y, rtol[:n, None], atol[:n, None])
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        max_abs[:n] = diff.max(axis=1) if x.shape[1] else 0.0
        scale = np.abs(y).max(axis=1) if y.shape[1] else np.zeros(n)
        max_rel[:n] = np.where(
            scale > 0, max_abs[:n] / np.where(scale > 0, scale, 1.0), np.where(max_abs[:n] > 0, np.inf, 0.0)
        )
        max_ratio[:n] = ratio.max(axis=1) if x.shape[1] else 0.0
    return max_abs, max_rel, max_ratio


def compare(
    step_fn_or_trajectory: StepFn | Any,
    fixture: GoldenCase | str | Path,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    directory: str | Path | None = None,
    states: Mapping[str, Any] | None = None,
    conditioning: bool = True,
    state_rtol: float | None = None,
    state_map: Mapping[str, str] | None = None,
    moments: str = "auto",
) -> ComparisonReport:
    """Compare an implementation with one golden case, parameters and (when given) states, step by step.

    Args:
        step_fn_or_trajectory: either a callable ``step_fn(W_t, G_t, t)`` returning ``W_{t+1}`` or a pair
            ``(W_{t+1}, state)`` (stateful: a fresh optimizer built from ``case.config``; called for
            t = 1..K on its own outputs); ``state`` is a mapping or NamedTuple whose keys among
            ``count P Q M V r s u v`` (``step`` is read as ``count``; torch.optim's ``exp_avg``,
            ``exp_avg_sq`` and optax's ``mu``, ``nu`` as ``M``, ``V``: :data:`KNOWN_STATE_NAMES`) are compared
            with the fixture's state after step ``t``, in the work frame; an exception ends the run and fails
            the comparison with its traceback.  Or a trajectory array of shape ``(K, *shape)`` with row
            ``t - 1`` = ``W_{t+1}`` (a ``(K + 1, ...)`` array is taken to start with ``W_1`` and its first row
            is dropped).
        fixture: a :class:`~adadiag_ref.golden.GoldenCase`, a case name of the
            shipped set (or of ``directory``), or the path of a case's ``.npz``.
        rtol, atol: override the parameter tolerances stored in the manifest.
        states: with a trajectory, the port's states as ``{field: (K, *field_shape)}`` (the fixture's
            ``state_FIELD`` layout); ignored with a step function.
        conditioning: widen the tolerances after a refresh whose basis is poorly determined (a near-tie of
            singular values, a rank decision near its threshold) to what two correct implementations meet
            there: at step ``t`` the larger of the case's tolerance and ``conditioning_factor * kappa_t``
            (docs/golden.md, "Tolerances"; the report says so).  ``False``: the case's tolerance only.
        state_rtol: override the states' relative tolerance stored in the manifest.
        state_map: the port's state names for fixture fields (``{"exp_avg": "M", "exp_avg_sq": "V"}``), on top
            of :data:`KNOWN_STATE_NAMES`.
        moments: how the port's ``M``, ``V`` relate to the fixture's bias-corrected EMAs
            (``M_t = m_t / (1 - beta1^t)``, ``V_t = v_t / (1 - beta2^t)``, Adam family with bias correction):
            ``"raw"`` (the port keeps ``m_t``, ``v_t``: divided by ``1 - beta^t`` before the comparison),
            ``"corrected"``, or ``"auto"``: a field under the fixture's own name is taken as corrected, one
            under another name (mapped or known) is detected at its first informative step (the convention
            that meets the fixture there; the report says which).

    Returns:
        A :class:`ComparisonReport` (it never raises on a mismatch or a failing port; see
        :func:`assert_trajectory_close`).  Each step's fields are checked in the order the step computes
        them (``count``, ``P``, ``Q``, moments, ``W``): the first wrong one is where the error starts.
    """
    if moments not in MOMENT_CONVENTIONS:
        raise ValueError(f"moments={moments!r}; choose one of {', '.join(MOMENT_CONVENTIONS)}")
    case = _resolve_case(fixture, directory)
    names = {**KNOWN_STATE_NAMES, **(state_map or {})}
    if callable(step_fn_or_trajectory):
        run = _drive(step_fn_or_trajectory, case, names)
        traj = np.stack(run.params, axis=0) if run.params else np.zeros((0, *case.shape), dtype=case.w0.dtype)
        port_states: dict[str, Any] = {k: np.stack(v, axis=0) for k, v in run.states.items()}
        renamed = run.renamed
        error, error_step = run.error, run.error_step
    else:
        traj = np.asarray(to_numpy(step_fn_or_trajectory))
        if traj.shape[0] == case.steps + 1:
            traj = traj[1:]
        expected_shape = (case.steps, *case.shape)
        if traj.shape != expected_shape:
            raise ValueError(f"trajectory has shape {traj.shape}, the case {case.name!r} expects {expected_shape}")
        given = states or {}
        port_states = {names.get(k, k): np.asarray(_host(v)) for k, v in given.items()}
        renamed = _renamed(given, names)
        error, error_step = None, None
    candidate_dtype = str(traj.dtype)
    rtol = case.tolerance.rtol if rtol is None else rtol
    atol = case.tolerance.atol if atol is None else atol
    kappa, rtols, atols, state_rtols = _step_tolerances(case, rtol, atol, conditioning, state_rtol)
    golden_fields = set(case.state(1)) if case.steps else set()
    compared = tuple(f for f in FIELD_ORDER if f in port_states and f in golden_fields)
    port_states, moment_notes = _moment_conventions(
        case, _in_work_frame(case, {f: port_states[f] for f in compared}), renamed, moments, state_rtols
    )
    max_abs, max_rel, max_ratio = _parameter_errors(traj, case, rtols, atols)
    mismatch, got = _first_mismatch(case, traj, port_states, rtols, atols, state_rtols)
    status = _field_status(case, traj, port_states, compared, max_ratio, state_rtols)
    first = mismatch.step if mismatch is not None else None
    if error_step is not None and (first is None or error_step <= first):
        first, mismatch = error_step, None
    cfg = case.make_config()
    patterns: list[str] = []
    if first is None:
        cause = None
    elif mismatch is None:
        last = (error or "").strip().splitlines()[-1:] or [""]
        cause = f"{CAUSE_RAISED} at step {first}: {last[0]}"
    elif mismatch.field != PARAMETER:
        # a convention the whole trajectory of W fits explains the state too (coupled L2 decay moves P): first
        w_fails = any(first_out is not None for name, first_out, _ in status if name == PARAMETER)
        patterns = recognise(case, traj, rtols, atols) if w_fails else []
        if got is not None:
            patterns += _patterns(mismatch, got, case, cfg, float(state_rtols[mismatch.step - 1]))
        cause = _state_hint(mismatch, patterns, case, compared)
    else:
        patterns = recognise(case, traj, rtols, atols)
        if patterns:
            cause = patterns[0]
        elif set(compared) - {"count"}:  # a state beyond the counter agrees: the update from it is wrong
            cause = _state_hint(mismatch, patterns, case, compared)
        else:  # a non-finite trajectory is named below, whatever this says
            cause = likely_cause(
                first,
                max_rel,
                case.refresh_steps if cfg.sides else (),
                completion_steps=completion_steps(case),
                fixture_dtype=case.dtype,
                candidate_dtype=candidate_dtype,
            )
            if cause == CAUSE_STEP1 and not cfg.sides:
                cause = CAUSE_STEP1_UNROTATED
    if mismatch is not None and mismatch.field == PARAMETER and not np.all(np.isfinite(traj[:first])):
        cause = CAUSE_NONFINITE
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
        first_mismatch=mismatch,
        patterns=tuple(patterns),
        state_fields=compared,
        error=error,
        error_step=error_step,
        state_rtol=case.tolerance.state_rtol if state_rtol is None else state_rtol,
        conditioning=kappa,
        step_rtol=rtols,
        step_atol=atols,
        step_state_rtol=state_rtols,
        field_status=status,
        moment_notes=moment_notes,
        rotated=bool(cfg.sides),
    )


def _renamed(keys: Iterable[str], names: Mapping[str, str]) -> set[str]:
    """The fixture fields a port's state gave under another name (their moment convention is detected)."""
    return {names[k] for k in keys if k in names and names[k] != k}


def _in_work_frame(case: GoldenCase, states: dict[str, Any]) -> dict[str, Any]:
    """States kept in the parameter's shape (torch.optim's and optax's moments of a tall or conv parameter) read
    in the fixture's work frame (docs/spec.md: ``m x n``, ``m <= n``); fields already in it are kept."""
    layout = layout_for(case.shape, case.make_config())
    out = {}
    for name, value in states.items():
        stacked = np.asarray(value)
        want = case.state(1).get(name) if case.steps else None
        if want is not None and stacked.shape[1:] == case.shape and want.shape != case.shape:
            stacked = np.stack([np.asarray(to_work(x, layout, np)) for x in stacked], axis=0)
        out[name] = stacked
    return out


def _bias_factors(case: GoldenCase, name: str) -> np.ndarray | None:
    """``1 - beta^t`` per step for a moment kept raw (``raw = corrected (1 - beta^t)``): ``M`` (``beta1``) and
    ``V`` (``beta2``) of the Adam family with bias correction; ``None`` where the two conventions are one."""
    cfg = case.make_config()
    if name not in ("M", "V") or not isinstance(cfg, AdamConfig) or not cfg.bias_correction:
        return None
    beta = float(cfg.betas[0 if name == "M" else 1])
    if beta == 0.0:
        return None
    t = np.arange(1, case.steps + 1, dtype=np.float64)
    return -np.expm1(t * np.log(beta))  # 1 - beta^t without cancellation


def _detect_raw(name: str, got: np.ndarray, case: GoldenCase, factors: np.ndarray, rtols: np.ndarray) -> bool:
    """Whether ``got`` holds raw EMAs: at the first step where the fixture's field is nonzero, the convention
    that meets it (the closer one when neither does: a wrong moment then fails either way)."""
    for k in range(min(len(got), case.steps)):
        want = case.state(k + 1).get(name)
        if want is None or not np.any(want):
            continue
        y, x = want.astype(np.float64), np.asarray(got[k], dtype=np.float64)
        if x.shape != y.shape:
            return False
        r = float(rtols[k])
        if _within(x, y, r, _state_atol(y, r)):
            return False
        raw = x / factors[k]
        if _within(raw, y, r, _state_atol(y, r)):
            return True
        return bool(np.max(np.abs(raw - y)) < np.max(np.abs(x - y)))
    return False


def _moment_conventions(
    case: GoldenCase, states: dict[str, Any], renamed: set[str], moments: str, state_rtols: np.ndarray
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The port's states with raw moments turned into the fixture's bias-corrected ones, and a note per moment
    whose convention was declared or detected (``"V (raw EMA, detected)"``)."""
    out, notes = dict(states), []
    for name in ("M", "V"):
        factors = _bias_factors(case, name)
        if name not in states or factors is None:
            continue
        got = np.asarray(states[name], dtype=np.float64)
        if moments == "auto" and name in renamed:
            raw, how = _detect_raw(name, got, case, factors, state_rtols), "detected"
        elif moments == "auto":
            continue  # under the fixture's name: the fixture's convention
        else:
            raw, how = moments == "raw", "declared"
        notes.append(f"{name} ({'raw EMA' if raw else 'bias-corrected'}, {how})")
        if raw:
            n = got.shape[0]
            out[name] = got / factors[:n].reshape((n,) + (1,) * (got.ndim - 1))
    return out, tuple(notes)


def _field_status(
    case: GoldenCase,
    traj: np.ndarray,
    states: Mapping[str, Any],
    compared: tuple[str, ...],
    w_ratio: np.ndarray,
    state_rtols: np.ndarray,
) -> tuple[tuple[str, int | None, float], ...]:
    """``(field, first step out of tolerance or None, worst error / tolerance)`` for ``W`` and every compared
    state field, in :data:`FIELD_ORDER`."""
    out = []
    for name in compared:
        first, worst = None, 0.0
        for k in range(min(len(states[name]), case.steps)):
            want = case.state(k + 1)[name]
            got = np.asarray(states[name][k])
            r = float(state_rtols[k])
            ratio, _ = _check_field(k + 1, name, got, want, r, _state_atol(want, r))
            worst = max(worst, ratio)
            if first is None and ratio > 1.0:
                first = k + 1
        out.append((name, first, worst))
    ran = w_ratio[: traj.shape[0]]
    over = np.flatnonzero(~(ran <= 1.0))
    worst_w = float(np.max(np.where(np.isnan(ran), np.inf, ran))) if ran.size else 0.0
    out.append((PARAMETER, int(over[0]) + 1 if over.size else None, worst_w))
    return tuple(out)


def _step_tolerances(
    case: GoldenCase, rtol: float, atol: float, conditioning: bool, state_rtol: float | None = None
) -> tuple[np.ndarray, ...]:
    """``(kappa_t, rtol_t, atol_t, state_rtol_t)`` per step; without ``conditioning`` the case's own tolerances
    (``state_rtol``: the states' own, instead of the case's)."""
    own = case.tolerance.state_rtol if state_rtol is None else state_rtol
    if conditioning and case.steps:
        kappa, rtols, atols, states = (case.conditioning_per_step(), *case.tolerances_per_step(rtol, atol))
        widened = states > case.tolerance.state_rtol  # the conditioning's part, kept over the override
        return kappa, rtols, atols, np.where(widened, np.maximum(states, own), own)
    flat = np.ones(case.steps)
    return np.zeros(case.steps), rtol * flat, atol * flat, own * flat


def error_report(case: GoldenCase, error: str, step: int | None = None) -> ComparisonReport:
    """The report of a port that failed before producing a trajectory (its constructor raised, a command exited
    with an error, an output file was malformed): failed at ``step`` (default 1), with ``error`` as its traceback."""
    nan = np.full(case.steps, np.nan)
    last = error.strip().splitlines()[-1:] or [""]
    return ComparisonReport(
        case=case.name,
        steps=case.steps,
        rtol=case.tolerance.rtol,
        atol=case.tolerance.atol,
        first_diverging_step=step or 1,
        max_abs_error=nan,
        max_rel_error=nan,
        tolerance_ratio=nan,
        refresh_steps=case.refresh_steps,
        likely_cause=f"{CAUSE_RAISED}{f' at step {step}' if step else ' before its first step'}: {last[0]}",
        candidate_dtype="",
        error=error,
        error_step=step,
        state_rtol=case.tolerance.state_rtol,
    )


def assert_trajectory_close(
    step_fn_or_trajectory: StepFn | Any,
    fixture: GoldenCase | str | Path,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    directory: str | Path | None = None,
    conditioning: bool = True,
) -> ComparisonReport:
    """:func:`compare`, raising ``AssertionError`` with the full report on a mismatch."""
    report = compare(
        step_fn_or_trajectory, fixture, rtol=rtol, atol=atol, directory=directory, conditioning=conditioning
    )
    if not report.passed:
        raise AssertionError(str(report))
    return report
