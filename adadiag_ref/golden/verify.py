"""Verify a fixture set against the live core (``adadiag-ref golden verify``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import BaseConfig
from ..replay import refresh_conditioning
from .compare import ComparisonReport, compare
from .format import GoldenCase, array_sha256, load_cases
from .generator import STREAMS, make_stream, run_core, stack_states

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


def verify_case(case: GoldenCase) -> CaseResult:
    """Re-run ``case`` with the live core and check parameters and every stored state (:func:`compare`), and inputs."""

    cfg = case.make_config()
    params, states = run_core(cfg, case.w0, case.grads, case.state_steps)
    stored = [t for t in case.state_steps if case.state(t)]  # format 1 stores a few steps, format 2 every one
    live = stack_states(states, stored) if stored == list(range(1, case.steps + 1)) else {}
    report = compare(params, case, states={k[len("state_") :]: v for k, v in live.items()})
    problems = _check_inputs(case) + (_check_sparse_states(case, states) if not live else [])
    problems += _check_conditioning(case, cfg)
    return CaseResult(case.name, report, tuple(problems))


def _check_conditioning(case: GoldenCase, cfg: BaseConfig) -> list[str]:
    """Format 3: the stored ``kappa`` of every refresh is the live :func:`refresh_conditioning` (to 1%: it sets a
    tolerance, and the singular values' rounding moves a ``kappa`` of a near-tie by far less)."""
    problems = []
    for t, stored in zip(case.refresh_steps, case.conditioning, strict=False):
        live = refresh_conditioning(cfg, case.grads[t - 1])
        if not np.isclose(stored, live, rtol=1e-2, atol=0.0):
            problems.append(f"conditioning of the refresh at step {t}: stored {stored:.3g}, live {live:.3g}")
    return problems


def _check_sparse_states(case: GoldenCase, states: dict[int, dict[str, np.ndarray]]) -> list[str]:
    """Format 1: the states stored at a few steps, each checked on its own (:func:`compare` checks every step)."""
    problems = []
    rtol = case.tolerance.state_rtol
    for t in case.state_steps:
        golden, live = case.state(t), states.get(t, {})
        for name, want in golden.items():
            got = live.get(name)
            if got is None or got.shape != want.shape:
                problems.append(f"state {name} after step {t}: the live core has {None if got is None else got.shape}")
                continue
            atol = rtol * float(np.max(np.abs(want))) if want.size else 0.0
            if not np.allclose(got, want, rtol=rtol, atol=atol):
                problems.append(f"state {name} after step {t}: differs beyond state_rtol {rtol:g}")
    return problems


def verify(directory: str | Path | None = None) -> list[CaseResult]:
    """Verify every case of a fixture directory (default: the shipped set)."""
    return [verify_case(case) for case in load_cases(directory)]
