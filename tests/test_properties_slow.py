"""Long hypothesis runs (marked slow; CI runs them in its second pass).

The library against the loop references over random shapes, hyperparameters and
refresh periods, and canonical_svd's invariances over random degenerate input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from reference import reference

import adadiag_ref as ar
from adadiag_ref.linalg import canonicalize_svd

pytestmark = pytest.mark.slow


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(list(ar.OPTIMIZERS)),
    m=st.integers(1, 4),
    n=st.integers(1, 5),
    lr=st.floats(1e-4, 1e-1),
    b1=st.sampled_from([0.0, 0.5, 0.9]),
    b2=st.sampled_from([0.9, 0.99, 0.999]),
    wd=st.floats(0.0, 0.2),
    T=st.sampled_from([1, 2, 3, None]),
    seed=st.integers(0, 2**31 - 1),
)
def test_library_equals_loop_reference(name, m, n, lr, b1, b2, wd, T, seed) -> None:
    if m > n:
        m, n = n, m  # the references are written for the paper's m <= n
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal((m, n))
    grads = rng.standard_normal((6, m, n))
    eps = ar.default_eps(name)
    got = ar.replay(name, w0, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, update_freq=T)
    want = reference(name, w0, list(grads), lr=lr, betas=(b1, b2), eps=eps, wd=wd, T=T, momentum=b1 > 0)
    # same formulas, different summation order: rounding only, amplified by the normalisations
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(1, 6),
    n=st.integers(1, 6),
    rank=st.integers(0, 6),
    repeated=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(m=3, n=3, rank=2, repeated=True, seed=141)  # LAPACK split the equal pair by more than the tolerance
def test_canonical_basis_is_independent_of_the_decomposition(m, n, rank, repeated, seed) -> None:
    """Rotating the thin SVD inside every cluster and null space never changes the canonical bases."""
    rng = np.random.default_rng(seed)
    k = min(m, n)
    rank = min(rank, k)
    U0 = np.linalg.qr(rng.standard_normal((m, m)))[0][:, :k]
    V0 = np.linalg.qr(rng.standard_normal((n, n)))[0][:, :k]
    S = np.sort(rng.uniform(1.0, 3.0, size=k))[::-1]
    if repeated:
        S[:] = 2.0
    S[rank:] = 0.0
    G = (U0 * S) @ V0.T
    U, S_, Vh = np.linalg.svd(G, full_matrices=False)
    if repeated and rank > 1:
        # LAPACK returns equal singular values up to its own rounding, which can exceed the cluster tolerance
        # (seed 141, 3 x 3: a gap of 1.8e-15 against 1.3e-15), and then they are two values, not one cluster, and
        # mixing them below is no longer "another SVD of the same G": the property is about equal values
        S_[:rank] = S_[0]
    base = canonicalize_svd(U, S_, Vh, (m, n))
    # any orthogonal mixing inside the equal-value block and inside the null block is another valid SVD
    R = np.eye(k)
    for a, b in [(0, rank), (rank, k)]:
        if b - a > 1:
            R[a:b, a:b] = np.linalg.qr(rng.standard_normal((b - a, b - a)))[0]
    if not repeated:
        R[:rank, :rank] = np.diag(rng.choice([-1.0, 1.0], size=rank))
    other = canonicalize_svd(U @ R, S_, R.T @ Vh, (m, n))
    np.testing.assert_allclose(other.P, base.P, atol=1e-10)
    np.testing.assert_allclose(other.Q, base.Q, atol=1e-10)
    np.testing.assert_allclose(base.P.T @ base.P, np.eye(m), atol=1e-12)
    np.testing.assert_allclose(base.Q.T @ base.Q, np.eye(n), atol=1e-12)
