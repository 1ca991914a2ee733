"""The test problems: gradients against finite differences, optima, determinism, namespaces.

Central differences with step 1e-6 have truncation error ~1e-12 (times the third
derivative) and rounding error ~1e-16 / 1e-6 = 1e-10 relative to L, so 1e-6
relative to ||grad L|| is a safe bound.
"""

from __future__ import annotations

import array_api_strict
import numpy as np
import pytest

from adadiag_ref import ode


def _fd_grad(loss, W, step=1e-6):
    G = np.zeros_like(W)
    for idx in np.ndindex(W.shape):
        E = np.zeros_like(W)
        E[idx] = step
        G[idx] = (float(loss(W + E)) - float(loss(W - E))) / (2 * step)
    return G


@pytest.mark.parametrize(
    "problem",
    [
        ode.least_squares_problem(3, 4, cond=1e3),
        ode.least_squares_problem(2, 5, noise=0.3),
        ode.factorization_problem(),
        ode.rosenbrock_problem(2, 3, alpha=100.0),
    ],
    ids=lambda p: p.name,
)
def test_gradient_matches_finite_differences(problem):
    W = problem.W0 + 0.1
    G = problem.grad(W)
    assert G.shape == W.shape
    np.testing.assert_allclose(G, _fd_grad(problem.loss, W), rtol=1e-6, atol=1e-6 * np.max(np.abs(G)))


def test_optimal_values():
    ls = ode.least_squares_problem(3, 4, cond=10.0, seed=2, noise=0.0)
    assert ls.optimal_value == 0.0
    noisy = ode.least_squares_problem(3, 4, cond=10.0, seed=2, noise=0.5)
    assert noisy.optimal_value > 0
    rb = ode.rosenbrock_problem(2, 3)
    assert float(rb.loss(np.ones((2, 3)))) == 0.0 and np.all(rb.grad(np.ones((2, 3))) == 0)
    assert rb.W0[0, 0] == -1.2 and rb.W0[0, 1] == 1.0


def test_least_squares_conditioning():
    """The Hessian (B B^T) kron (A^T A) has the requested condition number."""
    import itertools

    p = ode.least_squares_problem(3, 4, cond=1e3, seed=1)
    # recover A^T A and B B^T from the gradient, which is linear in W: grad(E_ij) - grad(0)
    base = p.grad(np.zeros((3, 4)))
    cols = []
    for i, j in itertools.product(range(3), range(4)):
        E = np.zeros((3, 4))
        E[i, j] = 1.0
        cols.append((p.grad(E) - base).ravel())
    Hmat = np.array(cols).T
    ev = np.linalg.eigvalsh(0.5 * (Hmat + Hmat.T))
    assert ev.max() / ev.min() == pytest.approx(1e3, rel=1e-8)


def test_problems_are_wide_deterministic_and_namespace_independent():
    for name in ode.PROBLEMS:
        a, b = ode.make_problem(name), ode.make_problem(name)
        m, n = a.shape
        assert m <= n
        np.testing.assert_array_equal(a.W0, b.W0)
        strict = ode.make_problem(name, xp=array_api_strict)
        Ws = strict.W0
        assert float(strict.loss(Ws)) == pytest.approx(float(a.loss(a.W0)), rel=1e-13)
        np.testing.assert_allclose(np.from_dlpack(strict.grad(Ws)), a.grad(a.W0), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="unknown problem"):
        ode.make_problem("sphere")


def test_custom_problem_runs_through_check():
    C = np.arange(6.0).reshape(2, 3)
    problem = ode.custom_problem(lambda W: 0.5 * np.sum((W - C) ** 2), lambda W: W - C, np.zeros((2, 3)), name="mine")
    result = ode.check(ode.make_system("adadiag"), problem, "rk4", 2.0)
    assert result.problem == "mine" and result.verdict == "monotone"
    assert result.loss_end < result.loss0
    with pytest.raises(ValueError, match="matrix"):
        ode.custom_problem(lambda W: W, lambda W: W, np.zeros(3))
