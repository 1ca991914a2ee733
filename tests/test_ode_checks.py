"""check(): the result object, its figures, the verdicts and well-posedness."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from adadiag_ref import ode

PROBLEM = ode.least_squares_problem(3, 4, cond=100.0)


def test_check_result_figures_for_a_monotone_run():
    result = ode.check(ode.make_system("adadiag"), PROBLEM, "dopri5", 5.0, rtol=1e-9, atol=1e-11)
    assert result.verdict == "monotone" and result.status == "success"
    assert result.max_h_increase == 0.0 and result.max_h_increase_rel == 0.0
    assert result.max_dhdt < 0
    assert result.h_end < result.h0
    # energy balance: Simpson on dense output of a 1e-9 solution closes to ~1e-9 relative
    assert result.energy_drop == pytest.approx(result.energy_integral, rel=1e-7)
    assert result.grad_norm_end < 0.1 * result.grad_norm0
    assert result.grad_norm_tail >= result.grad_norm_end
    assert result.invariants_ok and result.min_second_moment > 0
    assert result.well_posed
    assert result.n_evals >= 6 * result.n_steps
    tr = result.trajectory
    assert tr.t[0] == 0.0 and tr.t[-1] == 5.0 and np.all(np.diff(tr.H) <= 0)


def test_to_dict_is_json_with_the_documented_keys():
    result = ode.check(ode.make_system("hfac"), PROBLEM, "rk4", 1.0)
    payload = json.loads(json.dumps(result.to_dict()))
    for key in ("max_h_increase", "h0", "h_end", "grad_norm_end", "n_steps", "n_evals", "verdict"):
        assert key in payload
    assert "trajectory" not in payload
    assert payload["n_steps"] == 200


def test_observed_order_in_check():
    result = ode.check(ode.make_system("adam"), PROBLEM, "semi_implicit_euler", 2.0, order=True)
    assert result.observed_order == pytest.approx(1.0, abs=0.15)
    assert len(result.order_errors) == 5
    rk4 = ode.check(ode.make_system("adafacdiag"), PROBLEM, "rk4", 2.0, order=True, order_dt0=1 / 20)
    assert rk4.observed_order == pytest.approx(4.0, abs=0.4)


def test_within_error_verdict_for_an_unstable_step():
    """Explicit Euler beyond its stability limit (a h = 3 > 2): dH/dt <= 0 holds, yet H rises step to step, by
    an amount the step-doubling estimate attributes to discretisation error; a stable step is monotone."""
    system = ode.make_system("momentum_sgd", a=10.0)
    problem = ode.least_squares_problem(2, 3, cond=1e4)
    result = ode.check(system, problem, "euler", 10.0, dt=0.3)
    assert result.verdict == "within_error"
    assert result.max_dhdt <= 0 and result.max_h_increase > 1e3 * abs(result.h0)
    assert result.max_h_increase <= result.increase_tolerance
    stable = ode.check(system, problem, "euler", 10.0, dt=0.01)
    assert stable.verdict == "monotone"


def test_violated_verdict_from_the_default_start_with_fast_second_moment():
    """b > 4a breaks the Adam claim on an ordinary trajectory too (not only at a crafted state)."""
    result = ode.check(ode.make_system("adam", b=8.0), PROBLEM, "dopri5", 5.0)
    assert result.verdict == "violated"
    assert result.max_dhdt > 0
    assert result.max_h_increase > 100 * result.local_error_estimate
    assert any("4a" in note for note in result.notes)


def test_decoupled_weight_decay_violates_along_a_trajectory():
    result = ode.check(ode.make_system("momentum_sgd", weight_decay=0.5), PROBLEM, "dopri5", 10.0)
    assert result.verdict == "violated" and result.max_dhdt > 0


def test_well_posedness_of_the_initial_states():
    term = ode.SystemTerm(ode.make_system("adam"), PROBLEM)
    ok, notes = ode.well_posedness(term.system, term.unpack(term.initial_state(moments="zero")))
    assert ok and any("stiff" in n for n in notes)
    zero_eps = ode.make_system("adam", eps=0.0)
    ok, notes = ode.well_posedness(zero_eps, term.unpack(term.initial_state(moments="zero")))
    assert not ok
    for name in ("adafactor", "hfac"):
        result = ode.check(ode.make_system(name), PROBLEM, "dopri5", 1.0, moments="zero")
        assert result.verdict == "ill_posed" and not result.well_posed and result.n_steps == 0
        assert math.isnan(result.h0)
        assert json.dumps(result.to_dict())  # NaNs become null
    fine = ode.check(ode.make_system("adafactor"), PROBLEM, "rk4", 0.1)
    assert fine.well_posed and not fine.notes


def test_small_eps_is_stiff_late_in_the_run():
    """As G -> 0, V decays like exp(-b t) and sqrt(V) + eps -> eps: the W-M coupling has frequency
    ~ sqrt(a lambda_max / (sqrt(V) + eps)), so late in the run an explicit solver needs more steps for small eps
    (measured 1285 steps at eps = 1e-8 against 638 at eps = 1e-2 over t in [0, 20]; equal up to t = 10)."""
    system = ode.make_system("adam")
    stiff = ode.check(system, PROBLEM, "dopri5", 20.0)
    mild = ode.check(system.replace(eps=1e-2), PROBLEM, "dopri5", 20.0)
    assert stiff.status == mild.status == "success"
    assert stiff.n_steps > 1.5 * mild.n_steps


def test_refresh_times_show_in_the_trajectory():
    result = ode.check(ode.make_system("hfacdiag"), ode.least_squares_problem(3, 5), "rk4", 2.0, refresh_period=0.5)
    np.testing.assert_allclose(result.trajectory.refresh_times, [0.5, 1.0, 1.5])
    assert result.verdict == "monotone"
