"""Verify a fixture set against the live core (``adadiag-ref golden verify``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .compare import ComparisonReport, compare
from .format import GoldenCase, array_sha256, load_cases
from .generator import STREAMS, make_stream, run_core

__all__ = ["CaseResult", "verify", "verify_case"]


@dataclass(frozen=True)
class CaseResult:
    """Outcome of one case: the parameter report plus input and state checks."""

    case: str
    report: ComparisonReport
    problems: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return self.report.passed and not self.problems

    def summary(self) -> str:
        text = self.report.summary()
        if self.problems:
            text += "\n  " + "\n  ".join(self.problems)
        return text


def _check_inputs(case: GoldenCase) -> list[str]:
    problems = []
    for key in ("w0", "grads"):
        want = case.sha256.get(key)
        if want is not None and array_sha256(case.arrays[key]) != want:
            problems.append(f"{key}: SHA-256 differs from the manifest (file corrupted or edited)")
    stream_name = case.stream.get("name")
    stream = STREAMS.get(stream_name) if isinstance(stream_name, str) else None
    if stream is not None and stream.seed == case.stream.get("seed"):
        w0, grads = make_stream(stream, case.dtype)
        if array_sha256(w0) != array_sha256(case.w0) or array_sha256(grads) != array_sha256(case.grads):
            problems.append(f"inputs differ from the seeded stream {stream_name!r} (seed {stream.seed})")
    return problems


def _check_states(case: GoldenCase, states: dict[int, dict[str, np.ndarray]]) -> list[str]:
    problems = []
    rtol = case.tolerance.state_rtol
    for t in case.state_steps:
        golden = case.state(t)
        live = states.get(t, {})
        if set(golden) != set(live):
            problems.append(f"state after step {t}: fields {sorted(golden)} stored, live core has {sorted(live)}")
            continue
        for name, want in golden.items():
            got = live[name]
            if got.shape != want.shape:
                problems.append(f"state {name} after step {t}: shape {got.shape} != {want.shape}")
                continue
            if name == "count":
                if not np.array_equal(got, want):
                    problems.append(f"state count after step {t}: {got} != {want}")
                continue
            w64 = want.astype(np.float64)
            atol = rtol * float(np.max(np.abs(w64))) if w64.size else 0.0
            err = np.abs(got.astype(np.float64) - w64)
            if not np.all(err <= atol + rtol * np.abs(w64)):
                problems.append(
                    f"state {name} after step {t}: max abs error {float(np.max(err)):.3e} "
                    f"exceeds atol {atol:.3e} + rtol {rtol:g} |y|"
                )
    return problems


def verify_case(case: GoldenCase) -> CaseResult:
    """Re-run ``case`` with the live core and check parameters, states and inputs."""

    cfg = case.make_config()
    params, states = run_core(cfg, case.w0, case.grads, case.state_steps)
    report = compare(params, case)
    problems = _check_inputs(case) + _check_states(case, states)
    return CaseResult(case.name, report, tuple(problems))


def verify(directory: str | Path | None = None) -> list[CaseResult]:
    """Verify every case of a fixture directory (default: the shipped set)."""
    return [verify_case(case) for case in load_cases(directory)]
