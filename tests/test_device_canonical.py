"""The canonical rules on a device (issue 31, item 4): what a refresh moves to the host, and the same bases.

``array_api_strict`` arrays stand in for device arrays (:mod:`adadiag_ref.perf.traffic` counts the bytes its
host conversions move); torch CPU tensors and JAX arrays run the same device route with their own kernels.

* a refresh of a generic full-rank 512 x 512 float32 matrix moves at most 16 KiB device->host (its 512
  singular values and a few verdicts; the factors stayed on the device), for every ``basis_method``, one-sided
  and two-sided, and a batch of refreshes moves as much per matrix;
* where a host rule is needed (a cluster), only the cluster's columns come to the host;
* the bases equal NumPy's (bit for bit on ``array_api_strict``, which computes with NumPy; to 1e-12 in float64
  and 1e-5 in float32 on torch and JAX, whose decompositions round differently) on generic, clustered,
  rank-deficient and near-tied spectra and on a basis whose columns tie in magnitude;
* the sign rule on the device (stacks included) equals the host rule exactly, ties included.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import _load_backend, to_np

import adadiag_ref as ar
from adadiag_ref.linalg import canonical_svd, sign_canonical
from adadiag_ref.perf.traffic import count_traffic

xs = pytest.importorskip("array_api_strict")

KIB = 1024
METHODS = ["svd", "gram", "auto"]


def strict(a):
    return xs.asarray(np.asarray(a))


def _orthogonal(side, rng):
    Q, _ = np.linalg.qr(rng.standard_normal((side, side)))
    return Q


def _with_spectrum(m, n, s, rng, *, left=None):
    """``U diag(s) V^T`` (float64) with random orthogonal ``U`` (or ``left``) and ``V``."""
    U = _orthogonal(m, rng) if left is None else left
    V = _orthogonal(n, rng)
    k = min(m, n)
    return (U[:, :k] * np.asarray(s, dtype=np.float64)) @ V[:, :k].T


def _hadamard(side):
    """A Hadamard matrix over sqrt(side): every entry of every column ties in magnitude (side a power of 2)."""
    H = np.ones((1, 1))
    while H.shape[0] < side:
        H = np.block([[H, H], [H, -H]])
    return H / np.sqrt(side)


def spectrum(kind, m, n, dtype, rng):
    """A test matrix of ``kind``: distinct singular values, an exact cluster, a rank deficiency, values tied to
    a few ulps (one cluster up to rounding), or a basis whose columns tie in magnitude (the sign rule's ties)."""
    k = min(m, n)
    eps = float(np.finfo(dtype).eps)
    if kind == "generic":
        s = np.linspace(3.0, 1.0, k)
    elif kind == "clustered":
        s = np.array([3.0] + [2.0] * 3 + list(np.linspace(1.5, 1.0, k - 4)))
    elif kind == "rank_deficient":
        s = np.array([3.0, 2.0, 1.0] + [0.0] * (k - 3))
    elif kind == "near_tied":
        s = np.array([3.0] + [2.0 * (1 + j * eps) for j in range(3)] + list(np.linspace(1.5, 1.0, k - 4)))
    else:  # "tied_entries"
        return _with_spectrum(m, n, np.linspace(3.0, 1.0, k), rng, left=_hadamard(m)).astype(dtype)
    return _with_spectrum(m, n, s, rng).astype(dtype)


# ----------------------------------------------------------------------------- bytes moved


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"], ids=["one-sided", "two-sided"])
def test_refresh_of_a_generic_512_matrix_moves_at_most_16_kib(name, method):
    rng = np.random.default_rng(31)
    G_host = rng.standard_normal((512, 512)).astype(np.float32)
    cfg = ar.make_config(name, basis_method=method)
    with count_traffic() as traffic:
        new = ar.refresh_basis(ar.init(strict(G_host), cfg), strict(G_host), cfg)
    assert traffic.bytes_to_host <= 16 * KIB, (traffic.bytes_to_host, dict(traffic.conversions))
    assert new.P.shape == (512, 512) and (new.Q is not None) == (name == "adadiag_pp")  # the bases: see below


@pytest.mark.parametrize("method", METHODS)
def test_batched_refreshes_move_at_most_16_kib_per_matrix(method):
    rng = np.random.default_rng(32)
    cfg = ar.make_config("adadiag_pp", basis_method=method)
    grads = [strict(rng.standard_normal((512, 512)).astype(np.float32)) for _ in range(2)]
    with count_traffic() as traffic:
        new = ar.refresh_bases([ar.init(g, cfg) for g in grads], grads, cfg)
    assert traffic.bytes_to_host <= 2 * 16 * KIB, (traffic.bytes_to_host, dict(traffic.conversions))
    assert all(s.P.shape == s.Q.shape == (512, 512) for s in new)  # the batch's bases: test_device_traffic.py


def test_a_cluster_brings_only_its_columns_to_the_host():
    """One exact cluster of 3 values in a 64 x 64 float64 matrix: the host reads the 64 singular values, the
    cluster's 64 x 3 columns and the finiteness verdicts; the rest of the basis stays on the device."""
    rng = np.random.default_rng(33)
    G = spectrum("clustered", 64, 64, np.float64, rng)
    with count_traffic() as traffic:
        out = canonical_svd(strict(G), method="svd")
    verdicts = 16  # a few booleans and counts (the input's and the factors' finiteness)
    assert traffic.bytes_to_host <= (64 + 64 * 3) * 8 + verdicts, (traffic.bytes_to_host, dict(traffic.conversions))
    ref = canonical_svd(G, method="svd")
    np.testing.assert_array_equal(to_np(out.P), ref.P)
    np.testing.assert_array_equal(to_np(out.Q), ref.Q)


# ----------------------------------------------------------------------------- the same bases


KINDS = ["generic", "clustered", "rank_deficient", "near_tied", "tied_entries"]


@pytest.mark.parametrize("backend", ["array_api_strict", "torch", "torch_ops", "jax"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(("shape", "two_sided"), [((8, 12), False), ((8, 12), True), ((8, 8), True)])
def test_device_bases_equal_numpy(backend, kind, dtype, shape, two_sided, monkeypatch):
    """Each route (``svd``; ``gram`` for float32 one-sided) on the device against NumPy's bases: exact on
    ``array_api_strict`` except near ties; on torch and JAX to 1e-12 (float64) and 1e-5 (float32), the spec's
    tolerances: two backward-stable decompositions of one matrix agree to a small multiple of ``eps / gap`` (gaps
    >= 0.1 here, clusters and the null space exact), and the rules then remove every choice.  ``torch_ops``: CPU
    tensors through torch's own operations (``linalg.TORCH_CPU_ON_NUMPY`` off), as on a CUDA device.

    ``near_tied`` on ``array_api_strict``: the device route's GEMMs are not the host route's, and which OpenBLAS
    kernel runs them depends on the processor (``OPENBLAS_CORETYPE``: the SkylakeX kernel moved 8 of 64 entries of
    ``P`` by up to 3e-8 in float32, the Haswell kernel none); a near tie amplifies that rounding by ``1 / gap``, so
    there the spec's tolerance is asserted, not bits (docs/spec.md, "Bits across processors")."""
    if backend == "torch_ops":
        monkeypatch.setattr(ar.linalg, "TORCH_CPU_ON_NUMPY", False)
    xp = _load_backend("torch" if backend == "torch_ops" else backend)
    G = spectrum(kind, *shape, dtype, np.random.default_rng(34))
    exact = backend == "array_api_strict" and kind != "near_tied"
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for method in ("svd", "gram"):
        ref = canonical_svd(G, compute_q=two_sided, method=method)
        got = canonical_svd(xp.asarray(G), compute_q=two_sided, method=method)
        assert got.rank == ref.rank
        for field in ("P", "S", "Q"):
            want, have = getattr(ref, field), getattr(got, field)
            assert (want is None) == (have is None)
            if want is None:
                continue
            if exact:
                np.testing.assert_array_equal(to_np(have), want, err_msg=f"{method} {field}")
            else:
                np.testing.assert_allclose(to_np(have), want, rtol=tol, atol=tol, err_msg=f"{method} {field}")


@pytest.mark.parametrize("backend", ["array_api_strict", "torch", "jax"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_device_sign_rule_equals_the_host_rule_with_ties(backend, dtype):
    """``sign_canonical`` on device stacks equals the host rule on each matrix, bit for bit: exact ties (to
    the lowest index), ties within the relative tolerance ``sqrt(eps)`` (also to the lowest index), magnitudes
    just outside it (to the larger), zero columns (+1)."""
    xp = _load_backend(backend)
    rtol = float(np.finfo(dtype).eps) ** 0.5
    inside, outside = 1 - rtol / 4, 1 + 4 * rtol
    columns = np.array(
        [
            [-1.0, 1.0, 0.0, 0.5, -1.0, 0.0],
            [1.0, -inside, 0.0, -0.5, outside, 0.0],
            [0.3, 0.2, 0.0, 0.5, 0.1, 0.0],
            [0.0, -1.0, 0.0, -0.5, 0.0, 0.0],
        ]
    )
    stack = np.stack([columns, -columns, columns[::-1].copy(), _hadamard(4) @ columns]).astype(dtype)
    want = np.stack([sign_canonical(B, rtol) for B in stack])
    np.testing.assert_array_equal(want[0], [-1, 1, 1, 1, 1, 1])  # the rule itself, as the spec states it
    np.testing.assert_array_equal(to_np(sign_canonical(xp.asarray(stack), rtol)), want)
    for B, signs in zip(stack, want, strict=True):
        np.testing.assert_array_equal(to_np(sign_canonical(xp.asarray(B), rtol)), signs)
