"""Semi-implicit Euler is the discrete optimizer: one step equals one core ``update``.

With ``eta = h``, ``beta_1 = 1 - a h``, ``beta_2 = 1 - b h`` and no bias correction,
one :class:`~adadiag_ref.ode.SemiImplicitEuler` step of the system equals one
``update`` of the core on the same state and basis.  The Adafactor family needs
the Algorithm's form of the ODE (``momentum_form="update"`` or ``"none"``) and
Hfac the Algorithm's normalisation with ``momentum_scale = beta_1``: the paper's
own ODEs are *not* the limits of its algorithms (docs/errata.md).  The two
computations order their floating-point operations differently, so they agree
to rounding: 1e-13 relative (a few ulps times the condition of the update).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from adadiag_ref import ode

RTOL = 1e-13


def _core():
    """The core API (``ar.init`` etc.; falls back to the modules while ``adadiag_ref`` does not export them)."""
    import adadiag_ref as ar

    if all(hasattr(ar, n) for n in ("init", "update", "refresh_basis", "make_config", "step")):
        return ar
    try:
        from adadiag_ref.config import make_config
        from adadiag_ref.optim import core
    except ImportError:  # pragma: no cover
        pytest.skip("the core optimizers are not available")
    return SimpleNamespace(
        init=core.init, update=core.update, refresh_basis=core.refresh_basis, step=core.step, make_config=make_config
    )


H, A, B, WD = 0.01, 3.0, 0.5, 0.1

ALGORITHM_HFAC = {"normalization": "algorithm", "momentum_scale": 1 - A * H, "clip_threshold": 1.0}

# core name, core family options, matching ODE options (beyond a, b, weight decay)
CASES = [
    ("adamw", {}, "adam", {}),
    ("adadiag", {}, "adadiag", {}),
    ("adadiag_pp", {}, "adadiag_pp", {}),
    ("adafactor", {"momentum": True, "clip_threshold": 1.0}, "adafactor",
     {"momentum_form": "update", "clip_threshold": 1.0}),
    ("adafactor", {"momentum": False, "clip_threshold": 1.0}, "adafactor",
     {"momentum_form": "none", "clip_threshold": 1.0}),
    ("adafacdiag", {"momentum": True, "clip_threshold": None}, "adafacdiag", {"momentum_form": "update"}),
    ("adafacdiag_pp", {"momentum": True, "clip_threshold": 0.5}, "adafacdiag_pp",
     {"momentum_form": "update", "clip_threshold": 0.5}),
    ("hfac", {"clip_threshold": 1.0}, "hfac", ALGORITHM_HFAC),
    ("hfacdiag", {"clip_threshold": 1.0}, "hfacdiag", ALGORITHM_HFAC),
]  # fmt: skip


def _config(ar, core_name, core_opts, update_freq=None, **extra):
    return ar.make_config(
        core_name, lr=H, betas=(1 - A * H, 1 - B * H), weight_decay=WD, update_freq=update_freq,
        bias_correction=False, **core_opts, **extra,
    )  # fmt: skip


@pytest.mark.parametrize(("core_name", "core_opts", "ode_name", "ode_opts"), CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("seed", [0, 1])
def test_one_semi_implicit_euler_step_is_one_update(core_name, core_opts, ode_name, ode_opts, seed):
    ar = _core()
    rng = np.random.default_rng(seed)
    problem = ode.least_squares_problem(3, 5, seed=seed)
    W = problem.W0
    G = problem.grad(W)
    cfg = _config(ar, core_name, core_opts)
    state = ar.refresh_basis(ar.init(W, cfg), G + rng.standard_normal(G.shape), cfg)  # some basis, not G's own
    moments = {}
    for name in state._fields:
        value = getattr(state, name)
        if name in ("count", "P", "Q", "param_shape") or value is None:
            continue
        moments[name] = rng.random(value.shape) + 0.1 if name in ("V", "r", "s") else rng.standard_normal(value.shape)
    state = state._replace(**moments)
    delta, new_state = ar.update(state, G, cfg, W)

    system = ode.make_system(ode_name, a=A, b=B, weight_decay=WD, **ode_opts)
    term = ode.SystemTerm(system, problem)
    cls = ode.systems.state_type(system)
    y = term.pack(cls(W=W, **{k: moments.get(k) for k in cls._fields if k != "W"}))
    out = ode.SemiImplicitEuler().step(term, 0.0, y, H, ode.Basis(state.P, state.Q), None)
    stepped = term.unpack(out.y1)
    np.testing.assert_allclose(stepped.W, W + delta, rtol=RTOL, atol=RTOL * np.max(np.abs(W)))
    for name in moments:
        expected = getattr(new_state, name)
        np.testing.assert_allclose(getattr(stepped, name), expected, rtol=RTOL, atol=RTOL * np.max(np.abs(expected)))
    assert out.n_evals == 1


@pytest.mark.parametrize(
    ("core_name", "core_opts", "ode_name", "ode_opts"), CASES[1:3] + CASES[5:6] + CASES[8:], ids=str
)
def test_trajectory_with_refreshes_is_the_core_loop(core_name, core_opts, ode_name, ode_opts):
    """60 core steps with refresh period T = 7 (steps 1, 8, 15, ...) = semi-implicit Euler with refreshes at
    t = 0, 7h, 14h, ...: the ODE's refresh from grad L(W(t_k)) is the core's canonical SVD of G_t.

    Adam-family eps is raised to 1e-4 here: right after a two-sided refresh G~ = P^T G Q is diagonal up to
    rounding, and M / (sqrt(V) + eps) turns those ~1e-16 entries into ~1e-16 / eps contributions, so with
    the paper's eps = 1e-8 the two computations legitimately differ at 1e-8 relative (measured 8e-8)."""
    ar = _core()
    problem = ode.factorization_problem(k=2, m=3, n=4, seed=3)
    eps = {"eps": 1e-4} if ode_name.startswith("adadiag") else {}
    cfg = _config(ar, core_name, core_opts, update_freq=7, **eps)
    W = problem.W0
    state = ar.init(W, cfg)
    for _ in range(60):
        W, state = ar.step(state, problem.grad(W), cfg, W)

    system = ode.make_system(ode_name, a=A, b=B, weight_decay=WD, **ode_opts, **eps)
    term = ode.SystemTerm(system, problem)
    y0 = term.initial_state(moments="zero")  # the core starts from zero moments
    sol = ode.integrate(
        term, ode.SemiImplicitEuler(), 0.0, 60 * H, y0, ode.Basis(None, None),
        dt0=H, basis_schedule=ode.BasisSchedule.every(7 * H, 0.0, 60 * H), saveat=ode.SaveAt(steps=False),
    )  # fmt: skip
    assert sol.n_steps == 60
    final = term.unpack(sol.y_final)
    np.testing.assert_allclose(final.W, W, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(sol.bases[-1].P, state.P, rtol=1e-10, atol=1e-12)


def test_momentum_sgd_is_heavy_ball():
    """M_{k+1} = beta M_k + (1 - beta) G_k, W_{k+1} = W_k - h (M_{k+1} + lambda W_k), beta = 1 - a h.

    (The core has no momentum SGD; the reference is this loop.)"""
    problem = ode.rosenbrock_problem(2, 3, alpha=10.0)
    system = ode.make_system("momentum_sgd", a=A, weight_decay=WD)
    term = ode.SystemTerm(system, problem)
    y0 = term.initial_state(moments="zero")
    sol = ode.integrate(term, ode.SemiImplicitEuler(), 0.0, 40 * H, y0, ode.Basis(None, None), dt0=H)
    W, M = problem.W0, np.zeros_like(problem.W0)
    beta = 1 - A * H
    for _ in range(40):
        G = problem.grad(W)
        M = beta * M + (1 - beta) * G
        W = W - H * (M + WD * W)
    final = term.unpack(sol.y_final)
    np.testing.assert_allclose(final.W, W, rtol=1e-12)
    np.testing.assert_allclose(final.M, M, rtol=1e-12)


def test_paper_forms_are_not_the_algorithms():
    """The paper's Adafactor and Hfac ODEs differ from the Algorithms at first order in h: their semi-implicit
    Euler step is off the core's update by O(h) relative to the step itself (not rounding)."""
    ar = _core()
    problem = ode.least_squares_problem(3, 5)
    W, G = problem.W0, problem.grad(problem.W0)
    for core_name, core_opts, paper_opts in [
        ("adafactor", {"momentum": True, "clip_threshold": None}, {}),
        ("hfac", {"clip_threshold": None}, {}),
    ]:
        cfg = _config(ar, core_name, core_opts)
        state = ar.init(W, cfg)
        rng = np.random.default_rng(5)
        moments = {}
        for k in state._fields:
            value = getattr(state, k)
            if k in ("count", "P", "Q", "param_shape") or value is None:
                continue
            moments[k] = rng.random(value.shape) + 0.5 if k in ("r", "s") else rng.standard_normal(value.shape)
        state = state._replace(**moments)
        delta, _ = ar.update(state, G, cfg, W)
        system = ode.make_system(core_name, a=A, b=B, weight_decay=WD, **paper_opts)
        term = ode.SystemTerm(system, problem)
        cls = ode.systems.state_type(system)
        y = term.pack(cls(W=W, **{k: moments[k] for k in cls._fields if k != "W"}))
        out = ode.SemiImplicitEuler().step(term, 0.0, y, H, ode.Basis(None, None), None)
        gap = np.max(np.abs(term.unpack(out.y1).W - (W + delta))) / np.max(np.abs(delta))
        assert gap > 0.05, core_name


def test_bias_corrected_optimizer_converges_to_the_non_autonomous_ode():
    """With bias correction the discrete optimizer tends (order 1 in h) to the ODE with rates a / (1 - e^{-a t}),
    b / (1 - e^{-b t}) from M0 = G0, V0 = G0^2, not to the autonomous ODE: measured max|W| errors 3.5e-3, 1.8e-3,
    8.8e-4 at h = 4e-3, 2e-3, 1e-3, while both autonomous ODEs are 0.36 and 0.50 away."""
    ar = _core()
    problem = ode.least_squares_problem(3, 4, cond=100.0)
    a, b, T = 2.0, 0.5, 2.0
    system = ode.make_system("adam", a=a, b=b)
    term = ode.SystemTerm(system, problem)
    W0, G0 = problem.W0, problem.grad(problem.W0)
    y0 = term.pack(ode.AdamODEState(W=W0, M=G0, V=G0 * G0))
    limit = ode.integrate(
        ode.bias_corrected_term(system, problem), ode.Dopri5(), 1e-9, T, y0, ode.Basis(None, None),
        dt0=1e-6, controller=ode.PIController(rtol=1e-10, atol=1e-12), saveat=ode.SaveAt(steps=False),
    )  # fmt: skip
    W_limit = term.unpack(limit.y_final).W
    errors = []
    for h in (4e-3, 2e-3, 1e-3):
        cfg = ar.make_config("adamw", lr=h, betas=(1 - a * h, 1 - b * h), update_freq=None, bias_correction=True)
        W, state = W0, ar.init(W0, cfg)
        for _ in range(round(T / h)):
            W, state = ar.step(state, problem.grad(W), cfg, W)
        errors.append(np.max(np.abs(W - W_limit)))
    assert errors[0] / errors[1] == pytest.approx(2.0, rel=0.1)
    assert errors[1] / errors[2] == pytest.approx(2.0, rel=0.1)
    autonomous = ode.integrate(term, ode.Dopri5(), 0.0, T, y0, ode.Basis(None, None), controller=ode.PIController())
    assert np.max(np.abs(term.unpack(autonomous.y_final).W - W_limit)) > 100 * errors[-1]
    assert ode.bias_corrected_rate(2.0, 1e-6) == pytest.approx(1e6, rel=1e-5)
    assert ode.bias_corrected_rate(2.0, 50.0) == pytest.approx(2.0, rel=1e-15)


def test_bias_corrected_hamiltonian_decreases():
    """With bias correction (rates a(t), b(t)) the time-dependent H_t = L + (1 - e^{-a t}) <M/D, M> / (2a) is
    non-increasing when b <= a (docs/ode.md, section 3): checked at every step of a tight DOPRI5 run."""
    problem = ode.least_squares_problem(3, 4, cond=100.0)
    a, b = 2.0, 0.5
    system = ode.make_system("adam", a=a, b=b)
    term = ode.SystemTerm(system, problem)
    G0 = problem.grad(problem.W0)
    y0 = term.pack(ode.AdamODEState(W=problem.W0, M=G0, V=G0 * G0 + 1e-6))
    with np.errstate(invalid="ignore"):  # a trial stage of a rejected step may overshoot V < 0; it is rejected
        sol = ode.integrate(
            ode.bias_corrected_term(system, problem), ode.Dopri5(), 1e-9, 6.0, y0, ode.Basis(None, None),
            dt0=1e-6, controller=ode.PIController(rtol=1e-11, atol=1e-13),  # b(t) ~ 1/t: start small
        )  # fmt: skip
    H_t = []
    for t, y in zip(sol.ts, sol.ys, strict=True):
        st = term.unpack(y)
        kinetic = np.sum(st.M**2 / (np.sqrt(st.V) + system.eps))
        H_t.append(float(problem.loss(st.W)) + (-np.expm1(-a * t)) / (2 * a) * kinetic)
    H_t = np.array(H_t)
    assert np.all(np.diff(H_t) <= 1e-12 * np.abs(H_t[:-1]))
    assert H_t[-1] < 0.1 * H_t[0]
