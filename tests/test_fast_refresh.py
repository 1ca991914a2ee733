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


def test_auto_keeps_the_svd_for_float64_and_two_sided(monkeypatch: pytest.MonkeyPatch) -> None:
    # "auto" decomposes float64 and two-sided refreshes by the SVD, never the Gram route; its canonical rules run
    # the fast steps, equal to the reference loop's to rounding (float64 at the golden tolerance)
    monkeypatch.setattr(linalg, "_gram_route", lambda *a, **k: pytest.fail("the Gram route ran"))
    rng = np.random.default_rng(2)
    G = rng.standard_normal((6, 11))
    for compute_q in (False, True):
        a, b = canonical_svd(G, compute_q=compute_q), canonical_svd(G, compute_q=compute_q, method="auto")
        np.testing.assert_allclose(b.P, a.P, rtol=0, atol=1e-12)
        if compute_q:
            np.testing.assert_allclose(b.Q, a.Q, rtol=0, atol=1e-12)
    G32 = G.astype(np.float32)
    a, b = canonical_svd(G32), canonical_svd(G32, method="auto")
    np.testing.assert_allclose(b.P, a.P, rtol=0, atol=2e-6)
    np.testing.assert_allclose(b.Q, a.Q, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_two_sided_refresh_completes_q_by_the_fast_steps_unless_svd(dtype: type, monkeypatch) -> None:
    # The default basis_method ("auto") completes Q's n - m null-space columns by the projector's pivoted
    # Cholesky (one pass per column instead of rebuilding an n x n residual: 512 x 1376 took 9 s in float32 and
    # 15 s in float64 by the loop); basis_method="svd" stays the reference loop, bit for bit.
    from adadiag_ref import _kernels

    if not _kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    calls: list[int] = []
    original = linalg._projector_columns

    def spy(*args: object) -> object:
        calls.append(1)
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(linalg, "_projector_columns", spy)
    g = np.random.default_rng(4).standard_normal((20, 90)).astype(dtype)  # 70 null-space columns of Q
    auto = ar.refresh_basis(ar.init(g, ar.make_config("adadiag_pp")), g, ar.make_config("adadiag_pp"))
    assert calls, "the completion did not take the fast steps"
    calls.clear()
    cfg = ar.make_config("adadiag_pp", basis_method="svd")
    ref = ar.refresh_basis(ar.init(g, cfg), g, cfg)
    assert not calls
    U, S, Vh = np.linalg.svd(g, full_matrices=False)
    loop = linalg.canonicalize_svd(U, S, Vh, g.shape)
    np.testing.assert_array_equal(ref.Q, loop.Q)
    atol = 1e-12 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(auto.P, ref.P, rtol=0, atol=atol)
    np.testing.assert_allclose(auto.Q, ref.Q, rtol=0, atol=atol)


def test_gram_in_float64_is_the_exact_route() -> None:
    # float64 is the golden mode: the Gram route squares the condition number, so "gram" must not be used
    # there; every method returns the SVD route's result bit for bit (the old code forced the Gram route).
    rng = np.random.default_rng(3)
    G = _with_spectrum(rng, 1.0 / np.arange(1, 13), 12, 30, np.float64)
    ref = canonical_svd(G, compute_q=False)
    for method in ("gram", "auto"):
        fast = canonical_svd(G, compute_q=False, method=method)
        np.testing.assert_array_equal(fast.P, ref.P)
        np.testing.assert_array_equal(fast.S, ref.S)


@pytest.mark.parametrize(
    ("dtype", "method", "compute_q", "shape", "expected"),
    [
        (np.float32, "svd", False, (3, 5), False),
        (np.float32, "gram", False, (3, 5), True),
        (np.float32, "auto", False, (3, 5), True),
        (np.float32, "auto", True, (3, 5), False),  # two-sided: Q needs the SVD
        (np.float32, "gram", True, (3, 5), False),
        (np.float32, "auto", False, (5, 3), False),  # tall: a 5 x 5 eigenproblem for rank 3, the SVD is cheaper
        (np.float32, "gram", False, (5, 3), True),
        (np.float64, "gram", False, (3, 5), False),  # golden mode: exact route
        (np.float64, "auto", False, (3, 5), False),
    ],
)
def test_route_selection(dtype: type, method: str, compute_q: bool, shape: tuple[int, int], expected: bool) -> None:
    G = np.ones(shape, dtype=dtype)
    assert linalg.gram_route_applies(G, method, compute_q=compute_q) is expected


def test_bad_method() -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        canonical_svd(np.eye(3), method="qr")
    with pytest.raises(ValueError, match="method must be one of"):
        linalg.gram_route_applies(np.eye(3), "eigh", compute_q=False)


@pytest.mark.parametrize("bad", ["qr", "SVD", "", None, 1])
def test_config_rejects_unknown_basis_method(bad: object) -> None:
    with pytest.raises(ValueError, match="basis_method must be one of 'svd', 'gram', 'auto'"):
        ar.make_config("adadiag", basis_method=bad)


def test_config_basis_method_default_and_replace() -> None:
    cfg = ar.make_config("adadiag")
    assert cfg.basis_method == "auto"
    assert cfg.replace(basis_method="svd").basis_method == "svd"
    with pytest.raises(ValueError, match="basis_method"):
        cfg.replace(basis_method="eig")
    assert ar.make_config("hfacdiag", basis_method="gram").basis_method == "gram"


@pytest.mark.parametrize("method", ["svd", "gram", "auto"])
def test_refresh_basis_follows_the_config(method: str) -> None:
    # refresh_basis passes cfg.basis_method to canonical_svd: the basis equals that route's, bit for bit.
    rng = np.random.default_rng(11)
    g = _with_spectrum(rng, 1.0 / np.arange(1, 41), 40, 90, np.float32)
    cfg = ar.make_config("adadiag", basis_method=method)
    state = ar.refresh_basis(ar.init(g, cfg), g, cfg)
    np.testing.assert_array_equal(state.P, canonical_svd(g, compute_q=False, method=method).P)


def test_refresh_switch_in_optimizer_trajectory() -> None:
    # AdaDiag in float32 with the Gram refresh stays within float32 tolerance of the SVD refresh.
    rng = np.random.default_rng(4)
    w0 = rng.standard_normal((24, 40)).astype(np.float32)
    grads = rng.standard_normal((9, 24, 40)).astype(np.float32)
    ref = np.asarray(ar.replay("adadiag", w0, grads, lr=1e-3, update_freq=3, basis_method="svd"))
    for method in ("gram", "auto"):
        fast = np.asarray(ar.replay("adadiag", w0, grads, lr=1e-3, update_freq=3, basis_method=method))
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


def _leading_half_disagreement(P: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(column, subspace) disagreement of the leading half ``h = m // 2`` of two canonical bases.

    column: ``max |P[:, :h] - ref[:, :h]|`` (both canonicalised, so no sign or rotation freedom is left);
    subspace: ``||ref[:, :h]^T P[:, h:]||_2``, the sine of the largest principal angle between the spans.
    """
    h = P.shape[0] // 2
    P64, ref64 = P.astype(np.float64), ref.astype(np.float64)
    column = float(np.max(np.abs(P64[:, :h] - ref64[:, :h])))
    subspace = float(np.linalg.norm(ref64[:, :h].T @ P64[:, h:], 2))
    return column, subspace


def _route_cases(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        # 1/i: the gaps 1/i^2 fall below the float32 cluster tolerance 700 eps32 = 8.3e-5 from i ~ 110 on, so
        # the trailing ~150 columns form one cluster (the projector's Cholesky runs, count >= 24)
        "decaying_1_over_i": _with_spectrum(rng, 1.0 / np.arange(1, 257), 256, 700, np.float32),
        "gaussian": rng.standard_normal((128, 300)).astype(np.float32),
        "rank_deficient": _with_spectrum(rng, np.r_[np.linspace(3, 1, 60), np.zeros(68)], 128, 300, np.float32),
        "repeated": _with_spectrum(
            rng, np.r_[np.full(40, 2.0), np.linspace(1.5, 0.5, 60), np.zeros(28)], 128, 300, np.float32
        ),
    }


@pytest.mark.parametrize("case", ["decaying_1_over_i", "gaussian", "rank_deficient", "repeated"])
@pytest.mark.parametrize("method", ["gram", "auto"])
def test_fast_route_matches_canonical_svd_on_leading_half(case: str, method: str) -> None:
    # The documented guarantee of the fast route (docs/performance.md): in float32 its basis matches the
    # canonical SVD's on the leading half of the spectrum to 1e-3, column by column after canonicalisation
    # and as a subspace.  Both are float32 approximations of the same exact basis, each within
    # ~eps32 sigma_max / gap of it; 1e-3 is the bound (observed: <= 1e-5 on these cases).
    G = _route_cases(np.random.default_rng(21))[case]
    ref = canonical_svd(G, compute_q=False, method="svd")
    fast = canonical_svd(G, compute_q=False, method=method)
    assert fast.rank == ref.rank
    assert fast.P.dtype == np.float32
    column, subspace = _leading_half_disagreement(fast.P, ref.P)
    assert column <= 1e-3 and subspace <= 1e-3, (column, subspace)
    np.testing.assert_allclose(fast.P.T @ fast.P, np.eye(G.shape[0]), rtol=0, atol=1e-5)  # orthogonal


@pytest.mark.parametrize("case", ["decaying_1_over_i", "gaussian", "rank_deficient", "repeated"])
def test_fast_route_in_float64_is_exact(case: str) -> None:
    # In float64 the Gram route is not used: every method decomposes by the SVD.  Its fast canonicalisation
    # ("gram", "auto") gives these one-sided bases bit for bit (a few ulps in general: the two-sided test above).
    G = _route_cases(np.random.default_rng(22))[case].astype(np.float64)
    ref = canonical_svd(G, compute_q=False, method="svd")
    for method in ("gram", "auto"):
        np.testing.assert_array_equal(canonical_svd(G, compute_q=False, method=method).P, ref.P)


def _cluster_block(dtype: type) -> tuple[np.ndarray, int, int, float]:
    """``U`` (square) of a 1/i spectrum and its widest cluster ``[a, b)`` (what canonicalize_svd canonicalises)."""
    G = _with_spectrum(np.random.default_rng(23), 1.0 / np.arange(1, 201), 200, 600, np.float32).astype(dtype)
    U, S, _ = np.linalg.svd(G, full_matrices=False)
    eps = float(np.finfo(dtype).eps)
    S64 = S.astype(np.float64)
    a, b = max(linalg._clusters(S64, 200, 600 * eps * S64[0]), key=lambda c: c[1] - c[0])
    assert linalg._cholesky_pays(b - a, 200)  # wide enough for the projector's Cholesky to be chosen
    return U, a, b, eps**0.5


def test_projector_cholesky_equals_the_gram_schmidt_loop() -> None:
    # Pivoted Cholesky of the projector takes the loop's pivots and yields its vectors, column by column
    # (a different pivot changes a whole column by O(1)).  The cluster (float32, from its own basis and from
    # the complement of the other columns) to a few float32 ulps of the unit vectors (2e-6; the factorisation
    # runs in float64, the loop in float32); the completion of a float64 basis (from the projector
    # I - B B^T and from a basis of the complement) to 1e-12.
    U, a, b, rtol = _cluster_block(np.float32)
    Uc = U[:, a:b]
    ref = Uc @ linalg._pivoted_gram_schmidt(np.ascontiguousarray(Uc.T), b - a, None, rtol, np)
    from_span = linalg._projector_columns(Uc, None, 200, b - a, rtol)
    from_complement = linalg._projector_columns(None, np.concatenate([U[:, :a], U[:, b:]], axis=1), 200, b - a, rtol)
    for fast in (from_span, from_complement):
        assert fast is not None and fast.dtype == np.float64
        np.testing.assert_allclose(fast, ref, rtol=0, atol=2e-6)
    B, _ = np.linalg.qr(np.random.default_rng(24).standard_normal((60, 20)))
    complement = np.eye(60) - B @ B.T
    ref = linalg._pivoted_gram_schmidt(complement, 40, B, 1.5e-8, np)
    null = np.linalg.svd(complement)[0][:, :40]  # another orthonormal basis of the complement
    for span, orthogonal in ((None, B), (null, None)):
        fast = linalg._projector_columns(span, orthogonal, 60, 40, 1.5e-8)
        assert fast is not None
        np.testing.assert_allclose(fast, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("rank", "n"), [(200, 600), (200, 2000), (170, 600), (30, 600)])
def test_fast_canonicalisation_of_a_wide_cluster_and_its_completion(rank: int, n: int) -> None:
    # canonicalize_svd(fast=True) against the reference loop, P and Q, on: a full-rank 1/i spectrum whose
    # trailing cluster (tolerance n eps32) is narrower than its complement (600: ~80 of 200, projector from the
    # cluster's own columns) or wider (2000: ~135 of 200, projector I - B B^T from the other columns); a cluster
    # followed by a completion narrower than the rank (projector from the null-space columns); a completion
    # wider than the rank (from I - B B^T).
    sigma = np.r_[1.0 / np.arange(1, rank + 1), np.zeros(200 - rank)]
    G = _with_spectrum(np.random.default_rng(25), sigma, 200, n, np.float64).astype(np.float32)
    U, S, Vh = np.linalg.svd(G, full_matrices=False)
    # Q only for n = 600: the 1800-step float32 completion of a 2000 x 2000 Q meets a residual norm within float32
    # rounding of the tie threshold (observed: 1.7e-6 above it in float64, below it in the loop's float32
    # residual), where the two may legitimately choose differently; that case is here for P's wide cluster.
    compute_q = n <= 600
    ref = linalg.canonicalize_svd(U, S, Vh, G.shape, compute_q=compute_q)
    fast = linalg.canonicalize_svd(U, S, Vh, G.shape, compute_q=compute_q, fast=True)
    assert fast.rank == ref.rank
    np.testing.assert_allclose(fast.P, ref.P, rtol=0, atol=2e-6)
    if compute_q:
        np.testing.assert_allclose(fast.Q, ref.Q, rtol=0, atol=2e-6)


def test_the_refresh_route_is_configuration_not_environment() -> None:
    # The route is cfg.basis_method; no module of the library reads ADADIAG_REF_REFRESH (a typo in an
    # environment variable was silently ignored and changed results globally).
    from pathlib import Path

    package = Path(ar.__file__).resolve().parent
    readers = [p.name for p in package.rglob("*.py") if "ADADIAG_REF_REFRESH" in p.read_text(encoding="utf-8")]
    assert readers == []
    assert not hasattr(linalg, "set_refresh_method") and not hasattr(linalg, "refresh_method")


def test_narrow_clusters_of_a_large_side_keep_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # The projector costs ~m^2 d against the loop's ~d^2 m: a 30-wide cluster of a 512-side basis must not
    # build the 512 x 512 projector (on a 4096 x 4096 Gaussian gradient, 43 such clusters had made the fast
    # route 3x slower than the SVD), while the same cluster in a 200-side basis still takes it.
    calls: list[int] = []
    real = linalg._projector_columns
    monkeypatch.setattr(linalg, "_projector_columns", lambda *a: calls.append(a[2]) or real(*a))
    for side in (512, 200):
        rng = np.random.default_rng(side)
        U = np.linalg.qr(rng.standard_normal((side, side)))[0].astype(np.float32)
        S = np.concatenate([np.linspace(2.0, 1.5, 20), np.full(30, 1.0), np.linspace(0.9, 0.5, side - 50)])
        fast = linalg.canonicalize_svd(U, S.astype(np.float32), None, (side, side), compute_q=False, fast=True)
        ref = linalg.canonicalize_svd(U, S.astype(np.float32), None, (side, side), compute_q=False)
        np.testing.assert_allclose(np.asarray(fast.P), np.asarray(ref.P), atol=2e-5)  # float32 columns
    assert calls == [200]


def test_two_sided_refresh_of_a_cpu_torch_tensor_takes_the_fast_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's SVD factors, canonicalised on zero-copy NumPy views by the same fast steps (the loop took 5.3 s on a
    # 512 x 1376 float32 gradient, 0.95 s this way); torch tensors of the input's dtype come back
    torch = pytest.importorskip("torch")
    from adadiag_ref import _kernels

    if not _kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    calls: list[int] = []
    original = linalg._projector_columns
    monkeypatch.setattr(linalg, "_projector_columns", lambda *a: calls.append(1) or original(*a))
    g = torch.from_numpy(np.random.default_rng(5).standard_normal((20, 90)))
    fast = ar.refresh_basis(ar.init(g, ar.make_config("adadiag_pp")), g, ar.make_config("adadiag_pp"))
    assert calls and isinstance(fast.Q, torch.Tensor) and fast.Q.dtype == torch.float64
    calls.clear()
    cfg = ar.make_config("adadiag_pp", basis_method="svd")
    ref = ar.refresh_basis(ar.init(g, cfg), g, cfg)
    assert not calls
    np.testing.assert_allclose(fast.P.numpy(), ref.P.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(fast.Q.numpy(), ref.Q.numpy(), rtol=0, atol=1e-12)
