"""Check any AdaDiag implementation against the golden fixtures.

Typical use (``docs/golden.md``)::

    from adadiag_ref.golden import load_cases
    from adadiag_ref.testing import assert_trajectory_close

    for case in load_cases(optimizer="adadiag"):
        opt = MyAdaDiag(**case.config)              # a fresh optimizer per case

        def step_fn(w, g, t):                       # W_t, G_t, t = 1, 2, ...
            return opt.step(w, g)                   # -> W_{t+1}

        assert_trajectory_close(step_fn, case)

:func:`compare` returns a :class:`ComparisonReport`: the first step, field
(the parameter ``W`` or a state field the step function returns) and entry
that leave the tolerance, the largest parameter error at every step, the
recognised patterns of the first wrong field and a hint drawn from that
evidence.  A step function may return ``(W_{t+1}, state)`` with ``state`` a
mapping of ``count P Q M V r s u v`` (work frame) to have the state checked
too (torch.optim's ``exp_avg``, ``exp_avg_sq`` and optax's ``mu``, ``nu`` are read as ``M``, ``V``; other
names through ``state_map``; raw EMAs detected or declared with ``moments``); a port that raises fails with its
traceback.  ``adadiag-ref conform``
(:mod:`adadiag_ref.golden.conform`) runs a torch class, an optax factory or a
command over every case.
"""

from __future__ import annotations

from .golden.compare import (
    CAUSE_FLOAT32,
    CAUSE_NONFINITE,
    CAUSE_OTHER,
    CAUSE_RAISED,
    CAUSE_REFRESH,
    CAUSE_SCHEDULE,
    CAUSE_STEP1,
    CAUSE_STEP2,
    KNOWN_STATE_NAMES,
    PARAMETER,
    ComparisonReport,
    Mismatch,
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
    "CAUSE_RAISED",
    "CAUSE_REFRESH",
    "CAUSE_SCHEDULE",
    "CAUSE_STEP1",
    "CAUSE_STEP2",
    "KNOWN_STATE_NAMES",
    "PARAMETER",
    "ComparisonReport",
    "Mismatch",
    "assert_trajectory_close",
    "compare",
    "completion_steps",
    "likely_cause",
    "load_case",
    "load_cases",
    "run_step_fn",
]
