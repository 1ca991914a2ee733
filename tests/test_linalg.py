"""canonical_svd: reconstruction, orthogonality, and every canonical rule."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import to_np
from hypothesis import given
from hypothesis import strategies as st

from adadiag_ref import canonical_svd
from adadiag_ref.linalg import canonicalize_svd

# Orthogonality and reconstruction are backward-stable LAPACK results plus one
# Gram-Schmidt pass: errors are a small multiple of n * eps(float64) ~ 1e-14.
TOL = 1e-12


def _check_decomposition(G: np.ndarray, P: np.ndarray, S: np.ndarray, Q: np.ndarray) -> None:
    m, n = G.shape
    k = min(m, n)
    np.testing.assert_allclose(P.T @ P, np.eye(m), atol=TOL)
    np.testing.assert_allclose(Q.T @ Q, np.eye(n), atol=TOL)
    np.testing.assert_allclose((P[:, :k] * S) @ Q[:, :k].T, G, atol=TOL * max(1.0, float(np.abs(G).max())))
    assert np.all(np.diff(S) <= 0)


def _signs_ok(B: np.ndarray) -> None:
    for j in range(B.shape[1]):
        col = B[:, j]
        i = int(np.argmax(np.abs(col) >= np.abs(col).max() * (1 - 1e-12)))
        assert col[i] > 0


@given(
    m=st.integers(1, 7),
    n=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_reconstruction_orthogonality_and_sign(m: int, n: int, seed: int) -> None:
    G = np.random.default_rng(seed).standard_normal((m, n))
    svd = canonical_svd(G)
    _check_decomposition(G, svd.P, svd.S, svd.Q)
    _signs_ok(svd.P)
    assert svd.rank == min(m, n)


@given(m=st.integers(1, 6), n=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_invariant_to_sign_flips_of_singular_pairs(m: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((m, n))
    U, S, Vh = np.linalg.svd(G, full_matrices=False)
    D = np.diag(rng.choice([-1.0, 1.0], size=S.size))
    a = canonicalize_svd(U, S, Vh, (m, n))
    b = canonicalize_svd(U @ D, S, D @ Vh, (m, n))
    np.testing.assert_allclose(b.P, a.P, atol=TOL)
    np.testing.assert_allclose(b.Q, a.Q, atol=TOL)


def test_zero_matrix_gives_identity() -> None:
    for shape in [(1, 1), (3, 5), (5, 3), (4, 4)]:
        svd = canonical_svd(np.zeros(shape))
        np.testing.assert_array_equal(svd.P, np.eye(shape[0]))
        np.testing.assert_array_equal(svd.Q, np.eye(shape[1]))
        assert svd.rank == 0


def test_rank_deficient_input_is_completed_deterministically() -> None:
    rng = np.random.default_rng(0)
    G = np.outer(rng.standard_normal(4), rng.standard_normal(6))  # rank 1
    svd = canonical_svd(G)
    assert svd.rank == 1
    _check_decomposition(G, svd.P, svd.S, svd.Q)
    # any orthonormal basis of the numerical null space maps to the same completion
    U, S, Vh = np.linalg.svd(G, full_matrices=False)
    R = np.linalg.qr(rng.standard_normal((3, 3)))[0]
    U2 = U.copy()
    U2[:, 1:] = U[:, 1:] @ R
    Vh2 = Vh.copy()
    Vh2[1:] = R.T @ Vh[1:]
    other = canonicalize_svd(U2, S, Vh2, G.shape)
    np.testing.assert_allclose(other.P, svd.P, atol=TOL)
    np.testing.assert_allclose(other.Q, svd.Q, atol=TOL)
    # the completion is pivoted Gram-Schmidt over e_1..e_m: its pivots are not arbitrary
    _signs_ok(svd.P)
    _signs_ok(svd.Q)


def test_completion_picks_largest_residual_first() -> None:
    # G = e_1 (x) v: P's completion of span(e_1) is e_2, e_3 in order (ties go to the lowest index)
    G = np.zeros((3, 4))
    G[0] = [1.0, 2.0, 0.0, 0.0]
    svd = canonical_svd(G)
    np.testing.assert_allclose(svd.P, np.eye(3), atol=TOL)
    # Q: first column (1,2,0,0)/sqrt5; residual norms of e_1..e_4 are 4/5, 1/5, 1, 1 -> e_3, e_4, then e_1's residual
    q0 = np.array([1.0, 2.0, 0.0, 0.0]) / np.sqrt(5)
    np.testing.assert_allclose(svd.Q[:, 0], q0, atol=TOL)
    np.testing.assert_allclose(svd.Q[:, 1], [0, 0, 1, 0], atol=TOL)
    np.testing.assert_allclose(svd.Q[:, 2], [0, 0, 0, 1], atol=TOL)
    np.testing.assert_allclose(svd.Q[:, 3], np.array([2.0, -1.0, 0, 0]) / np.sqrt(5), atol=TOL)


def test_repeated_singular_values_are_canonical() -> None:
    """Any rotation inside a cluster of equal singular values gives the same basis."""
    rng = np.random.default_rng(1)
    Q0 = np.linalg.qr(rng.standard_normal((6, 6)))[0]
    G = 2.0 * Q0[:4]  # all four singular values equal 2
    U, S, Vh = np.linalg.svd(G, full_matrices=False)
    base = canonicalize_svd(U, S, Vh, G.shape)
    for _ in range(3):
        R = np.linalg.qr(rng.standard_normal((4, 4)))[0]
        other = canonicalize_svd(U @ R, S, R.T @ Vh, G.shape)
        np.testing.assert_allclose(other.P, base.P, atol=TOL)
        np.testing.assert_allclose(other.Q, base.Q, atol=TOL)
    _check_decomposition(G, base.P, base.S, base.Q)
    # a scaled identity block gives the identity basis for P
    np.testing.assert_allclose(canonical_svd(np.eye(3) * 5.0).P, np.eye(3), atol=TOL)


def test_invariant_to_permuting_equal_columns() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal(4), rng.standard_normal(4)
    G1 = np.stack([a, b, a, b, a], axis=1)
    G2 = np.stack([b, a, a, b, a], axis=1)  # same columns, permuted: same G G^T, same P
    np.testing.assert_allclose(canonical_svd(G1).P, canonical_svd(G2).P, atol=TOL)


def test_only_requested_sides_are_formed() -> None:
    G = np.random.default_rng(3).standard_normal((3, 50))
    svd = canonical_svd(G, compute_q=False)
    assert svd.Q is None and svd.P.shape == (3, 3)
    np.testing.assert_allclose(svd.P, canonical_svd(G).P, atol=TOL)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="matrix"):
        canonical_svd(np.zeros(3))
    with pytest.raises(ValueError, match="non-empty"):
        canonical_svd(np.zeros((0, 3)))


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4)])
def test_same_basis_on_every_backend(xp, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(4)
    G = rng.standard_normal(shape)
    G[:, 0] = G[:, 1]  # a repeated column: still full rank in the smaller side for (3,5)
    ref = canonical_svd(G)
    got = canonical_svd(xp.asarray(G))
    np.testing.assert_allclose(to_np(got.P), ref.P, atol=TOL)
    np.testing.assert_allclose(to_np(got.Q), ref.Q, atol=TOL)
    np.testing.assert_allclose(to_np(got.S), ref.S, atol=TOL)
    rank1 = np.outer(rng.standard_normal(shape[0]), rng.standard_normal(shape[1]))
    np.testing.assert_allclose(to_np(canonical_svd(xp.asarray(rank1)).Q), canonical_svd(rank1).Q, atol=TOL)
