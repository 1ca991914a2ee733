"""adadiag_ref.testing: compare / assert_trajectory_close and the likely-cause heuristics."""

from __future__ import annotations

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref.golden import default_data_dir, load_case
from adadiag_ref.testing import (
    CAUSE_FLOAT32,
    CAUSE_NONFINITE,
    CAUSE_OTHER,
    CAUSE_REFRESH,
    CAUSE_SCHEDULE,
    CAUSE_STEP1,
    CAUSE_STEP2,
    assert_trajectory_close,
    compare,
    completion_steps,
    likely_cause,
)

CASE = load_case("adadiag-wide-f64")  # 3 x 5, T = 4, 12 steps, refreshes at 1, 5, 9


def core_step_fn(case, dtype=None):  # type: ignore[no-untyped-def]
    """A step_fn built on the library itself (optionally in another dtype)."""
    cfg = case.make_config()
    holder = {}

    def step_fn(w, g, t):  # type: ignore[no-untyped-def]
        if dtype is not None:
            w, g = w.astype(dtype), g.astype(dtype)
        if "state" not in holder:
            holder["state"] = ar.init(w, cfg)
        w_new, holder["state"] = ar.step(holder["state"], g, cfg, w)
        return w_new

    return step_fn


def test_exact_trajectory_passes() -> None:
    report = compare(CASE.params, CASE)
    assert report.passed and report.first_diverging_step is None and report.likely_cause is None
    assert report.max_abs_error.shape == report.max_rel_error.shape == (CASE.steps,)
    assert np.all(report.max_abs_error == 0)
    assert "OK" in report.summary()


def test_step_fn_on_the_core_passes_by_name_and_by_path() -> None:
    assert compare(core_step_fn(CASE), "adadiag-wide-f64").passed
    assert compare(core_step_fn(CASE), default_data_dir() / CASE.file).passed
    assert assert_trajectory_close(core_step_fn(CASE), CASE).passed


def test_trajectory_with_w0_row_is_accepted() -> None:
    assert compare(np.concatenate([CASE.w0[None], CASE.params]), CASE).passed


def test_wrong_shape_is_an_error() -> None:
    with pytest.raises(ValueError, match="expects"):
        compare(CASE.params[:-1], CASE)


@pytest.mark.parametrize("step", [1, 3, 5, 6, 12])
def test_first_diverging_step_and_errors(step: int) -> None:
    traj = CASE.params.copy()
    traj[step - 1 :, 1, 2] += 1e-8
    report = compare(traj, CASE)
    assert report.first_diverging_step == step
    np.testing.assert_allclose(report.max_abs_error[step - 1 :], 1e-8, rtol=1e-6)
    assert np.all(report.max_abs_error[: step - 1] == 0)
    scale = np.abs(CASE.params[step - 1]).max()
    assert report.max_rel_error[step - 1] == pytest.approx(1e-8 / scale, rel=1e-6)
    assert f"diverges at step {step}" in str(report) and "<- first divergence" in str(report)


def test_tolerance_is_the_manifest_one_and_can_be_overridden() -> None:
    traj = CASE.params.copy()
    traj[4:] *= 1 + 1e-13  # inside rtol = 1e-12
    assert compare(traj, CASE).passed
    traj[4:] *= 1 + 1e-11
    assert compare(traj, CASE).first_diverging_step == 5
    assert compare(traj, CASE, rtol=1e-9).passed


def test_assert_trajectory_close_raises_with_the_report() -> None:
    traj = CASE.params.copy()
    traj[0] += 1e-6
    with pytest.raises(AssertionError, match="diverges at step 1 of 12") as info:
        assert_trajectory_close(traj, CASE)
    assert CAUSE_STEP1 in str(info.value)


def test_float32_run_on_float64_fixture_is_blamed_on_rounding() -> None:
    report = compare(core_step_fn(CASE, np.float32), CASE)
    assert report.first_diverging_step == 1
    assert report.likely_cause == CAUSE_FLOAT32, str(report)
    assert report.candidate_dtype == "float32"


def test_float32_fixture_accepts_float32_core_and_float64_core() -> None:
    case = load_case("adadiag-wide-f32")
    assert compare(core_step_fn(case), case).passed
    promoted = compare(core_step_fn(case, np.float64), case)  # float64 arithmetic on float32 inputs
    assert promoted.passed, str(promoted)


def test_nan_is_reported() -> None:
    traj = CASE.params.copy()
    traj[2:] = np.nan
    report = compare(traj, CASE)
    assert report.first_diverging_step == 3 and report.likely_cause == CAUSE_NONFINITE


def test_cause_rules() -> None:
    rel = np.full(12, 1e-3)
    refresh = (1, 5, 9)
    assert likely_cause(None, rel, refresh) is None
    assert likely_cause(1, rel, refresh) == CAUSE_STEP1
    assert likely_cause(5, rel, refresh).startswith(CAUSE_REFRESH)  # type: ignore[union-attr]
    # step 2 after a completion at t = 1: the parameters cannot tell the completion from the moment update
    assert likely_cause(2, rel, refresh, completion_steps=(1,)) == CAUSE_STEP2
    assert likely_cause(6, rel, refresh, completion_steps=(5,)).startswith(CAUSE_REFRESH)  # type: ignore[union-attr]
    assert likely_cause(4, rel, refresh).startswith(CAUSE_SCHEDULE)  # type: ignore[union-attr]
    assert likely_cause(3, rel, refresh) == CAUSE_OTHER
    f32_like = 2 * np.finfo(np.float32).eps * np.arange(1, 13)
    assert likely_cause(1, f32_like, refresh, candidate_dtype="float32") == CAUSE_FLOAT32
    # a float64 port is never told "float32 rounding": its small errors are a small bug's
    assert likely_cause(1, f32_like, refresh) == CAUSE_STEP1
    assert likely_cause(1, f32_like, refresh, fixture_dtype="float32", candidate_dtype="float32") == CAUSE_STEP1
    jump = f32_like.copy()
    jump[6] = 1e-2  # a jump is a bug, not rounding
    assert likely_cause(1, jump, refresh, candidate_dtype="float32") == CAUSE_STEP1


def test_completion_steps() -> None:
    assert completion_steps(load_case("adadiag_pp-wide-f64")) == (1, 5, 9)  # 5 x 5 Q from rank 3
    assert completion_steps(load_case("adadiag-wide-f64")) == ()  # P is 3 x 3, G has rank 3
    assert completion_steps(load_case("adadiag-degenerate-f64")) == (1, 9)  # zero and rank-1 gradients
    assert completion_steps(load_case("adamw-wide-f64")) == ()
