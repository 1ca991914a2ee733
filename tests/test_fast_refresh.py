"""The fast one-sided refresh (Gram route) against the canonical SVD route.

Stated tolerance: on well-conditioned float32 input (every gap between
consecutive singular values >= 1e-2 sigma_max) the Gram route's ``P`` equals the
SVD route's to ``max|dP| <= 1e-4``.  Both are within float32's own error of the
exact basis, ``~eps32 sigma_max / gap = 1.2e-7 / 1e-2 ~ 1e-5`` per entry, with a
10x margin.  ``auto`` must return the SVD route's result exactly wherever it
falls back (float64, ambiguous rank or cluster decisions, two-sided).
"""

from __future__ import annotations

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref import linalg
from adadiag_ref.linalg import canonical_svd


def _with_spectrum(rng: np.random.Generator, sigma: np.ndarray, m: int, n: int, dtype: type) -> np.ndarray:
    U, _ = np.linalg.qr(rng.standard_normal((m, m)))
    V, _ = np.linalg.qr(rng.standard_normal((n, m)))
    return ((U * sigma) @ V.T).astype(dtype)


@pytest.mark.parametrize("shape", [(8, 8), (16, 40), (48, 200)])
def test_gram_equals_svd_on_well_conditioned_float32(shape: tuple[int, int]) -> None:
    m, n = shape
    rng = np.random.default_rng(m)
    sigma = np.linspace(3.0, 0.5, m)  # gaps (2.5 / (m - 1)) / 3 >= 1.7e-2 sigma_max
    G = _with_spectrum(rng, sigma, m, n, np.float32)
    ref = canonical_svd(G, compute_q=False)
    for method in ("gram", "auto"):
        fast = canonical_svd(G, compute_q=False, method=method)
        assert fast.rank == ref.rank == m
        assert fast.P.dtype == np.float32
        np.testing.assert_allclose(fast.P, ref.P, rtol=0, atol=1e-4)
        np.testing.assert_allclose(fast.S, ref.S, rtol=1e-5)
    # and the Gram route is close to the exact (float64) basis, column by column up to sign: the sign
    # rule's tie tolerance is sqrt(eps(dtype)), so float32 and float64 may legitimately pick different
    # signs for a column whose two largest entries are within 3.5e-4 of each other.
    exact = canonical_svd(G.astype(np.float64), compute_q=False).P
    P = canonical_svd(G, compute_q=False, method="gram").P
    P = P * np.sign(np.sum(P * exact, axis=0))
    np.testing.assert_allclose(P, exact, rtol=0, atol=1e-4)


def test_gram_rank_deficient_completion_matches() -> None:
    # rank 5 in 12 x 30: the 7 completion columns come from the same canonical Gram-Schmidt.
    rng = np.random.default_rng(1)
    sigma = np.concatenate([np.linspace(2.0, 1.0, 5), np.zeros(7)])
    G = _with_spectrum(rng, sigma, 12, 30, np.float32)
    ref = canonical_svd(G, compute_q=False)
    fast = canonical_svd(G, compute_q=False, method="auto")
    assert fast.rank == ref.rank == 5
    np.testing.assert_allclose(fast.P, ref.P, rtol=0, atol=1e-4)


def test_zero_matrix_gives_identity() -> None:
    G = np.zeros((4, 9), dtype=np.float32)
    np.testing.assert_array_equal(canonical_svd(G, compute_q=False, method="gram").P, np.eye(4, dtype=np.float32))


def test_auto_keeps_the_exact_route_for_float64_and_two_sided() -> None:
    rng = np.random.default_rng(2)
    G = rng.standard_normal((6, 11))
    a, b = canonical_svd(G, compute_q=False), canonical_svd(G, compute_q=False, method="auto")
    np.testing.assert_array_equal(a.P, b.P)
    G32 = G.astype(np.float32)
    a, b = canonical_svd(G32), canonical_svd(G32, method="auto")
    np.testing.assert_array_equal(a.P, b.P)
    np.testing.assert_array_equal(a.Q, b.Q)


def test_auto_falls_back_near_the_rank_tolerance() -> None:
    # sigma_min placed just above the float32 rank tolerance max(m, n) eps32 sigma_max:
    # the rank decision is ambiguous, so ``auto`` must give the SVD route's answer bit for bit.
    m, n = 6, 10
    tol = n * float(np.finfo(np.float32).eps) * 2.0
    sigma = np.array([2.0, 1.7, 1.4, 1.1, 0.8, 1.5 * tol])
    G = _with_spectrum(np.random.default_rng(3), sigma, m, n, np.float32)
    a, b = canonical_svd(G, compute_q=False), canonical_svd(G, compute_q=False, method="auto")
    np.testing.assert_array_equal(a.P, b.P)
    assert a.rank == b.rank


def test_bad_method() -> None:
    with pytest.raises(ValueError):
        canonical_svd(np.eye(3), method="qr")
    with pytest.raises(ValueError):
        linalg.set_refresh_method("qr")


def test_refresh_switch_in_optimizer_trajectory() -> None:
    # AdaDiag in float32 with the Gram refresh stays within float32 tolerance of the SVD refresh.
    rng = np.random.default_rng(4)
    w0 = rng.standard_normal((24, 40)).astype(np.float32)
    grads = rng.standard_normal((9, 24, 40)).astype(np.float32)
    ref = np.asarray(ar.replay("adadiag", w0, grads, lr=1e-3, update_freq=3))
    previous = linalg.set_refresh_method("auto")
    try:
        assert linalg.refresh_method() == "auto"
        fast = np.asarray(ar.replay("adadiag", w0, grads, lr=1e-3, update_freq=3))
    finally:
        linalg.set_refresh_method(previous)
    np.testing.assert_allclose(fast, ref, rtol=0, atol=1e-5)


def _spectrum_cases(rng: np.random.Generator, dtype: type) -> dict[str, np.ndarray]:
    return {
        "random": rng.standard_normal((40, 90)).astype(dtype),
        "rank_deficient": _with_spectrum(rng, np.r_[np.linspace(3, 1, 15), np.zeros(25)], 40, 90, dtype),
        "repeated": _with_spectrum(
            rng, np.r_[np.full(12, 2.0), np.full(10, 1.0), np.linspace(0.9, 0.1, 10), np.zeros(8)], 40, 90, dtype
        ),
        "decaying_1_over_i": _with_spectrum(rng, 1.0 / np.arange(1, 97), 96, 200, dtype),
        "zero": np.zeros((7, 9), dtype=dtype),
    }


@pytest.mark.parametrize("case", ["random", "rank_deficient", "repeated", "decaying_1_over_i", "zero"])
@pytest.mark.parametrize("compute_q", [False, True])
def test_fast_canonicalisation_equals_reference(case: str, compute_q: bool) -> None:
    # The in-place pivoted Gram-Schmidt (fast routes only) takes the same pivots and produces the same
    # vectors as the reference loop: float64 to 1e-12 (observed: <= 4 ulps, the BLAS products see a
    # differently laid out residual), float32 to a few ulps (2e-6 absolute on unit vectors).
    for dtype, atol in ((np.float64, 1e-12), (np.float32, 2e-6)):
        G = _spectrum_cases(np.random.default_rng(7), dtype)[case]
        U, S, Vh = np.linalg.svd(G, full_matrices=False)
        ref = linalg.canonicalize_svd(U, S, Vh, G.shape, compute_q=compute_q)
        fast = linalg.canonicalize_svd(U, S, Vh, G.shape, compute_q=compute_q, fast=True)
        assert fast.rank == ref.rank
        np.testing.assert_allclose(fast.P, ref.P, rtol=0, atol=atol)
        if compute_q:
            np.testing.assert_allclose(fast.Q, ref.Q, rtol=0, atol=atol)


def test_fast_pivots_equal_reference_pivots() -> None:
    # Pivot choices are discrete: compare the chosen vectors column by column (a different pivot would
    # change a whole column by O(1)), including the completion of a rank-deficient basis.
    rng = np.random.default_rng(8)
    B, _ = np.linalg.qr(rng.standard_normal((30, 9)))
    complement = np.eye(30) - B @ B.T
    ref = linalg._pivoted_gram_schmidt(complement, 21, B, 1.5e-8, np)
    from adadiag_ref import _kernels

    fast = _kernels.pivoted_gram_schmidt(complement, 21, B, 1.5e-8)
    np.testing.assert_allclose(fast, ref, rtol=0, atol=1e-12)


def test_svd_route_is_untouched_by_the_fast_canonicalisation() -> None:
    # method="svd" (the reference) must not take the in-place path: identical to canonicalize_svd(fast=False).
    G = _spectrum_cases(np.random.default_rng(9), np.float32)["repeated"]
    U, S, _ = np.linalg.svd(G, full_matrices=False)
    ref = linalg.canonicalize_svd(U, S, None, G.shape, compute_q=False)
    np.testing.assert_array_equal(canonical_svd(G, compute_q=False).P, ref.P)
