"""Vector fields, Hamiltonians and the closed-form dH/dt of every ODE system.

The central check: the closed-form ``dH/dt`` (``hamiltonian_rate``) equals
``<grad H, f>`` computed independently, by 5-point central differences of ``H``
along ``f`` (``directional_derivative``), on random states.  The difference
quotient has truncation error ``O(tau^4)`` with ``tau ~ 1e-3 ||y|| / ||f||`` and a
rounding error ``~ eps |H| / tau``; both are below ``1e-9`` relative here, so a
relative tolerance of ``1e-7`` (of ``|dH/dt| + |f|``-scale) leaves a wide margin
while any wrong coefficient (errors of order 1) fails.
"""

from __future__ import annotations

import math

import array_api_strict
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adadiag_ref import ode
from adadiag_ref._xp import to_numpy
from adadiag_ref.ode import systems as S
from adadiag_ref.ode.claims import directional_derivative, random_state

# every family and every option that changes the equations
VARIANTS: list[tuple[str, dict]] = [
    ("momentum_sgd", {}),
    ("momentum_sgd", {"a": 2.5, "weight_decay": 0.3}),
    ("adam", {}),
    ("adam", {"a": 0.7, "b": 5.0, "eps": 1e-3, "weight_decay": 0.1}),
    ("adadiag", {}),
    ("adadiag_pp", {"a": 3.0, "b": 0.2}),
    ("adafactor", {}),
    ("adafactor", {"a": 2.0, "b": 0.5, "eps": 1e-3}),
    ("adafactor", {"momentum_form": "update"}),
    ("adafactor", {"momentum_form": "update", "clip_threshold": 0.5, "b": 3.0}),
    ("adafactor", {"momentum_form": "none", "clip_threshold": 0.5}),
    ("adafacdiag", {"weight_decay": 0.2}),
    ("adafacdiag_pp", {"momentum_form": "update", "clip_threshold": 1.0}),
    ("hfac", {}),
    ("hfac", {"normalization": "algorithm", "momentum_scale": 0.9, "clip_threshold": 0.5, "a": 2.0, "b": 0.3}),
    ("hfacdiag", {}),
    ("hfacdiag", {"normalization": "algorithm", "weight_decay": 0.05, "b": 6.0}),
]


def _basis(system: ode.System, W: np.ndarray, seed: int) -> ode.Basis:
    """A generic orthogonal basis (not the SVD one, to exercise arbitrary P, Q)."""
    rng = np.random.default_rng(1000 + seed)
    m, n = W.shape
    P = np.linalg.qr(rng.standard_normal((m, m)))[0] if system.sides >= 1 else None
    Q = np.linalg.qr(rng.standard_normal((n, n)))[0] if system.sides == 2 else None
    return ode.Basis(P, Q)


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=lambda v: str(v))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_closed_form_rate_matches_finite_differences(name, options, seed):
    system = ode.make_system(name, **options)
    problem = ode.least_squares_problem(3, 4, seed=seed, cond=50.0)
    W = problem.W0 + 0.3 * np.random.default_rng(seed).standard_normal((3, 4))
    state = random_state(system, W, seed=seed, spread=1.5)
    basis = _basis(system, W, seed)
    G = problem.grad(W)
    closed = float(S.hamiltonian_rate(system, state, G, S.rotate(G, *basis, np)))
    numeric = directional_derivative(system, problem, state, basis)
    f = S.vector_field(system, state, S.rotate(G, *basis, np), basis)
    scale = abs(closed) + math.sqrt(sum(float(np.sum(x * x)) for x in f if x is not None))
    assert closed == pytest.approx(numeric, rel=1e-7, abs=1e-7 * scale)


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["adam", "adadiag_pp", "adafactor", "adafacdiag", "hfac", "hfacdiag"]),
    a=st.floats(0.1, 10.0),
    b=st.floats(0.1, 10.0),
    seed=st.integers(0, 10_000),
    spread=st.floats(0.0, 3.0),
)
def test_closed_form_rate_property(name, a, b, seed, spread):
    """The same identity over random rates, states and second-moment spreads (hypothesis, derandomized)."""
    system = ode.make_system(name, a=a, b=b)
    problem = ode.least_squares_problem(2, 3, seed=seed % 7)
    W = np.random.default_rng(seed).standard_normal((2, 3))
    state = random_state(system, W, seed=seed, spread=spread)
    basis = _basis(system, W, seed)
    G = problem.grad(W)
    closed = float(S.hamiltonian_rate(system, state, G, S.rotate(G, *basis, np)))
    numeric = directional_derivative(system, problem, state, basis)
    f = S.vector_field(system, state, S.rotate(G, *basis, np), basis)
    scale = abs(closed) + math.sqrt(sum(float(np.sum(x * x)) for x in f if x is not None))
    assert closed == pytest.approx(numeric, rel=1e-6, abs=1e-6 * scale)


def test_hamiltonian_is_basis_free_and_rotation_is_adjoint():
    """H takes no basis; <G, P X Q^T> = <P^T G Q, X> for any P, Q, which is the cross-term cancellation."""
    rng = np.random.default_rng(3)
    G, X = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    P, Q = rng.standard_normal((3, 3)), rng.standard_normal((5, 5))  # not even orthogonal
    basis = ode.Basis(P, Q)
    lhs = np.sum(G * S.unrotate(X, *basis, np))
    rhs = np.sum(S.rotate(G, *basis, np) * X)
    assert lhs == pytest.approx(rhs, rel=1e-13)


def test_paper_hamiltonians_are_the_special_cases():
    """a = b = 1: H is the paper's, e.g. Hfac's (1/4)<u 1^T / sqrt(r 1^T), u 1^T> + (1/4)<1 v^T/sqrt(1 s^T), 1 v^T>."""
    system = ode.make_system("hfac")
    W = np.zeros((2, 3))
    state = random_state(system, W, seed=4)
    u, v, r, s = state.u, state.v, state.r, state.s
    U1 = np.outer(u, np.ones(3))
    V1 = np.outer(np.ones(2), v)
    paper = 0.25 * np.sum(U1 / np.sqrt(np.outer(r, np.ones(3))) * U1) + 0.25 * np.sum(
        V1 / np.sqrt(np.outer(np.ones(2), s)) * V1
    )
    assert float(S.hamiltonian(system, state, 0.0)) == pytest.approx(paper, rel=1e-14)
    adam = ode.make_system("adam")
    st_a = random_state(adam, W, seed=5)
    paper_adam = 0.5 * np.sum(st_a.M / (np.sqrt(st_a.V) + adam.eps) * st_a.M)
    assert float(S.hamiltonian(adam, st_a, 0.0)) == pytest.approx(paper_adam, rel=1e-14)


def test_vector_field_equations_adam_family():
    """W' = -P (M / (sqrt(V) + eps)) Q^T - lambda W, M' = a (G~ - M), V' = b (G~^2 - V), written out."""
    system = ode.make_system("adadiag_pp", a=2.0, b=0.5, eps=1e-3, weight_decay=0.1)
    rng = np.random.default_rng(6)
    W = rng.standard_normal((2, 3))
    state = random_state(system, W, seed=6)
    basis = _basis(system, W, 6)
    G = rng.standard_normal((2, 3))
    Gr = basis.P.T @ G @ basis.Q
    f = S.vector_field(system, state, Gr, basis)
    np.testing.assert_allclose(f.W, -basis.P @ (state.M / (np.sqrt(state.V) + 1e-3)) @ basis.Q.T - 0.1 * W, rtol=1e-14)
    np.testing.assert_allclose(f.M, 2.0 * (Gr - state.M), rtol=1e-14)
    np.testing.assert_allclose(f.V, 0.5 * (Gr**2 - state.V), rtol=1e-14)


def test_vector_field_equations_factored_families():
    """r' = b((G~^2 + eps) 1_n - r), s' = b((G~^2 + eps)^T 1_m - s), Hfac's u' = a(G~ 1_n / n - u)."""
    rng = np.random.default_rng(7)
    W = rng.standard_normal((2, 4))
    G = rng.standard_normal((2, 4))
    for name in ("adafactor", "hfac"):
        system = ode.make_system(name, a=1.5, b=0.25, eps=1e-3)
        state = random_state(system, W, seed=7)
        f = S.vector_field(system, state, G, ode.Basis(None, None))
        np.testing.assert_allclose(f.r, 0.25 * ((G**2 + 1e-3).sum(axis=1) - state.r), rtol=1e-14)
        np.testing.assert_allclose(f.s, 0.25 * ((G**2 + 1e-3).sum(axis=0) - state.s), rtol=1e-14)
        if name == "hfac":
            np.testing.assert_allclose(f.u, 1.5 * (G.mean(axis=1) - state.u), rtol=1e-14)
            np.testing.assert_allclose(f.v, 1.5 * (G.mean(axis=0) - state.v), rtol=1e-14)
        else:
            Vhat = np.outer(state.r, state.s) / state.r.sum()
            np.testing.assert_allclose(f.W, -state.M / np.sqrt(Vhat), rtol=1e-14)


def test_pack_unpack_roundtrip_and_layout():
    problem = ode.least_squares_problem(2, 3)
    for name in ode.SYSTEMS:
        for opts in ({}, {"momentum_form": "none"} if name.startswith("adafac") else {}):
            system = ode.make_system(name, **opts)
            term = ode.SystemTerm(system, problem)
            state = random_state(system, problem.W0, seed=1)
            y = term.pack(state)
            assert y.shape == (term.layout.dim,)
            back = term.unpack(y)
            for a, b in zip(state, back, strict=True):
                assert (a is None and b is None) or np.array_equal(a, b)


def test_make_system_validates():
    with pytest.raises(ValueError, match="unknown system"):
        ode.make_system("adamax")
    with pytest.raises(ValueError, match="rate a"):
        ode.make_system("adam", a=0.0)
    with pytest.raises(ValueError, match="clip_threshold"):
        ode.make_system("adam", clip_threshold=1.0)
    with pytest.raises(ValueError, match="momentum_form"):
        ode.make_system("adam", momentum_form="update")
    with pytest.raises(ValueError, match="one-sided"):
        S.System(name="x", family="hfac", sides=2)
    with pytest.raises(ValueError, match="unknown option"):
        ode.make_system("adam", beta1=0.9)
    assert ode.make_system("adamw").name == "adam"
    assert ode.make_system("hfac").eps == 1e-30 and ode.make_system("adadiag").eps == 1e-8
    with pytest.raises(ValueError, match="m <= n"):
        ode.SystemTerm(ode.make_system("adadiag"), ode.least_squares_problem(4, 3))


def test_initial_state_lies_on_the_invariant_manifold():
    """1_m^T r0 = 1_n^T s0 (both sum G~0^2 + eps plus m n f), and second moments are positive."""
    problem = ode.least_squares_problem(3, 5)
    for name in ("adafactor", "adafacdiag_pp", "hfacdiag"):
        term = ode.SystemTerm(ode.make_system(name), problem)
        state = term.unpack(term.initial_state(term.initial_basis()))
        assert state.r.sum() == pytest.approx(state.s.sum(), rel=1e-13)
        assert state.r.min() > 0 and state.s.min() > 0
    adam = ode.SystemTerm(ode.make_system("adadiag_pp"), problem)
    state = adam.unpack(adam.initial_state(adam.initial_basis()))
    assert state.V.min() > 0  # the two-sided G~0 is diagonal: the floor keeps V > 0 off the diagonal


def test_canonical_basis_refresh_is_the_cores():
    """compute_basis uses the core's canonical_svd: P^T G is ordered and sign-fixed, P orthogonal."""
    from adadiag_ref.linalg import canonical_svd

    problem = ode.least_squares_problem(3, 5)
    G = problem.grad(problem.W0)
    basis = S.compute_basis(ode.make_system("adadiag_pp"), G)
    ref = canonical_svd(G)
    np.testing.assert_array_equal(basis.P, ref.P)
    np.testing.assert_array_equal(basis.Q, ref.Q)
    assert S.compute_basis(ode.make_system("adadiag"), G).Q is None
    assert S.compute_basis(ode.make_system("adam"), G) == ode.Basis(None, None)


def test_array_api_strict_gives_the_numpy_numbers():
    """The systems use only array-API functions: array_api_strict reproduces NumPy to rounding."""
    xps = array_api_strict
    for name in ("momentum_sgd", "adadiag_pp", "adafacdiag", "hfacdiag"):
        system = ode.make_system(name)
        out = []
        for xp in (np, xps):
            problem = ode.least_squares_problem(2, 3, xp=xp)
            term = ode.SystemTerm(system, problem)
            basis = term.initial_basis()
            y0 = term.initial_state(basis)
            f = term.vector_field(0.0, y0, basis)
            out.append((np.asarray(to_numpy(f)), term.hamiltonian(y0), term.hamiltonian_rate(0.0, y0, basis)))
        np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-12, atol=1e-14)
        assert out[0][1] == pytest.approx(out[1][1], rel=1e-12)
        assert out[0][2] == pytest.approx(out[1][2], rel=1e-10)


def test_adam_rate_at_zero_second_moment():
    """At V = 0, dH/dt is -inf where M G~ != 0 (H is not differentiable), finite where M = 0."""
    system = ode.make_system("adam")
    W = np.zeros((1, 2))
    state = ode.AdamODEState(W=W, M=np.array([[1.0, 0.0]]), V=np.array([[0.0, 0.0]]))
    assert float(S.hamiltonian_rate(system, state, np.ones((1, 2)), np.ones((1, 2)))) == -math.inf
    state0 = state._replace(M=np.zeros((1, 2)))
    assert float(S.hamiltonian_rate(system, state0, np.ones((1, 2)), np.ones((1, 2)))) == 0.0
