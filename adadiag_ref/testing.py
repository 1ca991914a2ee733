"""Check any AdaDiag implementation against the golden fixtures.

Typical use (``docs/golden.md``)::

    from adadiag_ref.golden import load_cases
    from adadiag_ref.testing import assert_trajectory_close

    for case in load_cases(optimizer="adadiag"):
        opt = MyAdaDiag(**case.config)              # a fresh optimizer per case

        def step_fn(w, g, t):                       # W_t, G_t, t = 1, 2, ...
            return opt.step(w, g)                   # -> W_{t+1}

        assert_trajectory_close(step_fn, case)

:func:`compare` returns a :class:`ComparisonReport`: the first step at which
any entry leaves the tolerance, the largest absolute and relative error at
every step, and, where the pattern tells, the likely cause.
"""

from __future__ import annotations

from .golden.compare import (
    CAUSE_FLOAT32,
    CAUSE_NONFINITE,
    CAUSE_OTHER,
    CAUSE_REFRESH,
    CAUSE_SCHEDULE,
    CAUSE_STEP1,
    ComparisonReport,
    assert_trajectory_close,
    compare,
    completion_steps,
    likely_cause,
    run_step_fn,
)
from .golden.format import load_case, load_cases

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
    "load_case",
    "load_cases",
    "run_step_fn",
]
