"""check(): the result object, its figures, the verdicts and well-posedness."""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

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


# ----------------------------------------------------------------------------- verdicts from the evidence


@pytest.mark.parametrize(
    ("family", "changes", "residual"),
    [
        # the rate of L + ||M||^2 / (2a) along W' = -M, M' = a (G - M) is -||M||^2: half of it is wrong
        ("halfrate", {"hamiltonian_rate": lambda c, s, G, xp: -0.5 * xp.sum(s.M * s.M)}, 0.4),
        # an H whose kinetic term is twice too large: its true rate is <G, -M> + 2 <M, G - M> != -||M||^2
        ("wrongh", {"hamiltonian": lambda c, s, loss, xp: loss + xp.sum(s.M * s.M) / c.a}, 0.1),
    ],
)
def test_a_closed_form_that_disagrees_with_the_trajectory_is_reported(family, changes, residual):
    """Issue 48: both families got ``monotone``, their energy residuals computed and never used (measured here
    0.5 and 0.19; finite-difference gaps 0.33 and 0.14)."""
    from _heavy_ball_variants import registered_variant

    with registered_variant(family, **changes):
        result = ode.check(ode.make_system(family), PROBLEM, "dopri5", 5.0)
    assert result.verdict == "rate_mismatch", result.message
    assert result.rate_fd_error > 0.1 and result.energy_residual_rel > residual
    assert "finite difference" in result.message and "energy residual" in result.message


def test_a_correct_closed_form_agrees_with_finite_differences():
    result = ode.check(ode.make_system("adadiag_pp"), PROBLEM, "dopri5", 5.0, refresh_period=1.0)
    assert result.verdict == "monotone"
    # central differences with a 1e-5 relative perturbation: truncation ~1e-10, measured 1e-10 - 3e-9
    assert result.rate_fd_error < 1e-7 and result.energy_residual_rel < 1e-6
    assert "energy residual" in result.message


def test_rate_fd_error_measures_the_gap():
    term = ode.SystemTerm(ode.make_system("adam"), PROBLEM)
    y, basis = term.initial_state(), term.initial_basis()
    gap, used = ode.checks.rate_fd_error(term, 0.0, y, basis)
    assert gap < 1e-8 and used == 1
    doubled = SimpleNamespace(
        vector_field=lambda t, y, args: 2.0 * term.vector_field(t, y, args),
        hamiltonian=term.hamiltonian,
        hamiltonian_rate=term.hamiltonian_rate,
    )
    gap, _ = ode.checks.rate_fd_error(doubled, 0.0, y, basis)
    assert gap == pytest.approx(1 / 3, rel=1e-6)  # |r - 2r| / (|r| + |2r|)


def test_a_blown_up_state_is_never_ok():
    """Issue 48: after an RK4 blow-up the report said "invariants ok" and "largest H increase 0" at a NaN state."""
    system = ode.make_system("momentum_sgd", a=10.0)
    problem = ode.least_squares_problem(2, 3, cond=1e4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # issue 48: NumPy's RuntimeWarnings reached the console; now none escapes
        result = ode.check(system, problem, "rk4", 200.0, dt=2.0)
    assert any("RuntimeWarning" in text for text in result.runtime_warnings), result.runtime_warnings
    assert result.status == "nonfinite" and result.verdict == "failed"
    assert not result.invariants_ok
    assert math.isnan(result.max_h_increase)
    assert any("not finite" in note for note in result.notes)


def test_json_can_include_the_trajectory():
    result = ode.check(ode.make_system("adadiag"), PROBLEM, "rk4", 1.0, dt=0.05, refresh_period=0.5)
    assert "trajectory" not in result.to_dict()
    payload = json.loads(json.dumps(result.to_dict(trajectory=True)))
    trajectory = payload["trajectory"]
    assert len(trajectory["t"]) == 21 == len(trajectory["H"]) == len(trajectory["dHdt"])
    assert trajectory["refresh_times"] == [0.5] and len(trajectory["step_sizes"]) == 20
    assert trajectory["H"][0] == pytest.approx(result.h0, rel=1e-15)


def test_check_reports_the_fit_range_of_its_order():
    result = ode.check(ode.make_system("adam"), PROBLEM, "rk4", 1.0, order=True, order_dt0=1 / 10)
    # the finest three of five (measured slopes 2.8, 3.7, 3.86, 3.93 from the coarsest pair on; fit 3.90)
    assert result.order_fit_range == (0.025, 0.00625) and result.order_refused == ()
    assert result.observed_order == pytest.approx(3.9, abs=0.1)
    assert "fit_range" not in result.to_dict() and result.to_dict()["order_fit_range"] == [0.025, 0.00625]


# ----------------------------------------------------------------------------- your own flow, no registration


def _damped_oscillator(gamma: float, rate_factor: float = 1.0) -> ode.ODETerm:
    """``q' = p``, ``p' = -q - gamma p``; ``H = (q^2 + p^2) / 2``, ``dH/dt = -gamma p^2`` (times ``rate_factor``)."""

    def oscillator(t, y, args):
        return np.array([y[1], -y[0] - gamma * y[1]])

    return ode.ODETerm(
        oscillator,
        hamiltonian_fn=lambda y: 0.5 * float(y @ y),
        rate_fn=lambda t, y, args: -rate_factor * gamma * float(y[1] ** 2),
    )


def test_check_takes_an_ode_term_with_h_and_its_rate():
    result = ode.check(_damped_oscillator(0.3), integrator="dopri5", t_end=10.0, y0=np.array([1.0, 0.0]))
    assert result.verdict == "monotone", result.message
    assert result.system == "oscillator" and result.problem == "custom"
    assert result.h_end < 0.1 * result.h0 and result.min_second_moment is None and result.invariants_ok
    assert result.energy_residual_rel < 1e-6 and result.rate_fd_error < 1e-7
    assert result.loss0 == result.h0 and math.isnan(result.grad_norm0)  # no loss_fn, grad_norm_fn given


def test_check_of_an_ode_term_with_a_wrong_rate():
    result = ode.check(_damped_oscillator(0.3, rate_factor=0.5), t_end=10.0, y0=np.array([1.0, 0.0]))
    assert result.verdict == "rate_mismatch", result.message


def test_check_of_an_ode_term_needs_h_rate_and_y0():
    term = _damped_oscillator(0.3)
    with pytest.raises(ValueError, match="y0 given: False"):
        ode.check(term, t_end=1.0)
    with pytest.raises(ValueError, match="missing: hamiltonian_fn, rate_fn"):
        ode.check(ode.ODETerm(term.fn), t_end=1.0, y0=np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="needs a Problem"):
        ode.check(ode.make_system("adam"), t_end=1.0)


# ----------------------------------------------------------------------------- events in check


def test_check_stops_at_a_gradient_tolerance():
    result = ode.check(ode.make_system("adadiag"), PROBLEM, "dopri5", 1000.0, grad_tol=1e-3)
    assert result.status == "event" and result.event == "||grad L|| <= 0.001"
    assert result.grad_norm_end <= 1e-3 < result.grad_norm0 and result.t_final < 1000.0
    assert result.trajectory.t[-1] == result.t_final and result.verdict == "monotone"
    assert result.message.startswith(f"stopped at t = {result.t_final:.6g}")
    by_loss = ode.check(ode.make_system("adam"), PROBLEM, "rk4", 50.0, dt=0.05, loss_threshold=1e-3)
    assert by_loss.event == "L <= 0.001" and by_loss.loss_end <= 1e-3


def test_check_stops_at_a_user_event():
    def halfway(t, y, args):
        return t > 2.49  # the step ends are multiples of 0.025 up to rounding

    result = ode.check(ode.make_system("hfac"), PROBLEM, "rk4", 5.0, events=[halfway])
    assert result.event == "halfway" and result.t_final == pytest.approx(2.5, abs=1e-9)


def test_an_energy_balance_that_does_not_close_is_unresolved():
    """Euler at h = 0.1 on Adam: H decreases on every step and the closed form is right, but the trajectory is
    10 % off the ODE's energy balance (measured 0.10; 0.04 at h = 0.05, which stays monotone): before issue 48
    this was ``monotone``."""
    coarse = ode.check(ode.make_system("adam"), PROBLEM, "euler", 5.0, dt=0.1)
    assert coarse.verdict == "unresolved", coarse.message
    assert coarse.max_h_increase == 0.0 and coarse.rate_fd_error < ode.checks.FD_TOLERANCE
    assert coarse.energy_residual_rel > coarse.energy_tolerance
    finer = ode.check(ode.make_system("adam"), PROBLEM, "euler", 5.0, dt=0.05)
    assert finer.verdict == "monotone" and finer.energy_residual_rel < finer.energy_tolerance
