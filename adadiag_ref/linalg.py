"""Canonical singular value decomposition: one basis for every backend.

An SVD ``G = P diag(S) Q^T`` is unique only up to the sign of each singular pair,
and up to a rotation inside (a) a cluster of equal singular values, (b) the
numerical null space of a rank-deficient ``G`` and (c) the ``n - m`` extra columns
of a full ``Q``.  LAPACK, cuSOLVER, torch and jax resolve these choices
differently, and because AdaDiag carries its moments across basis refreshes
without re-rotating them, the choice changes the optimizer's trajectory.

:func:`canonical_svd` fixes every choice (``docs/spec.md``, section 4):

* **Order** - singular values descending.
* **Numerical rank** - ``r = #{i : sigma_i > max(m, n) * eps(dtype) * sigma_max}``.
* **Clusters** - consecutive singular values (within the rank) whose gap is at
  most the same tolerance form one cluster.  Inside a cluster the columns of
  ``P`` are re-chosen by pivoted Gram-Schmidt over the projections of
  ``e_1 .. e_m`` onto the cluster's left subspace, and ``Q``'s columns follow as
  ``Q_c = V_c A`` with the same coefficients ``A`` (so ``G Q_c = P_c sigma``).
* **Completion** - columns beyond the rank come from pivoted Gram-Schmidt over
  ``e_1 .. e_d``: take the ``e_i`` whose residual after projecting out every
  column chosen so far is largest (ties to the lowest index), normalise it,
  re-orthogonalise once more ("twice is enough") and append it.  This is QR with
  column pivoting of ``I - B B^T``.  A zero matrix gives the identity.
* **Sign** - the entry of largest magnitude of every column of ``P`` is
  positive; the matching column of ``Q`` is flipped with it.  Completion
  columns of ``Q`` follow the same rule on themselves.

Ties (equal residual norms, equal magnitudes) are decided up to a relative
tolerance of ``sqrt(eps(dtype))`` (1.5e-8 in float64, 3.5e-4 in float32): values
that are equal in exact arithmetic differ by a few ulps after rounding, and
differently on every backend, so an exact comparison would flip the choice.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from array_api_compat import is_numpy_namespace, is_torch_namespace

from ._xp import Array, Namespace, count_nonfinite, creation_device, namespace, sqrt, to_numpy, warn_at_caller
from .config import BASIS_METHODS

__all__ = [
    "DECISION_BAND",
    "DECOMPOSITION_LADDER",
    "REFRESH_METHODS",
    "CanonicalSVD",
    "DecompositionError",
    "DecompositionWarning",
    "NonFiniteInputError",
    "basis_conditioning",
    "canonical_complement",
    "canonical_svd",
    "canonical_svd_batch",
    "canonicalize_svd",
    "decomposition_budget",
    "gram_route_applies",
    "set_decomposition_budget",
    "sign_canonical",
]


class CanonicalSVD(NamedTuple):
    """Result of :func:`canonical_svd`: ``G = P[:, :k] diag(S) Q[:, :k]^T``, k = min(m, n).

    ``P`` is ``m x m`` and ``Q`` is ``n x n`` (full, orthogonal); either is ``None``
    when it was not requested.  ``S`` holds the ``k`` singular values, descending.
    ``rank`` is the numerical rank used for completion.
    """

    P: Array | None
    S: Array
    Q: Array | None
    rank: int


def _tolerance(S_host: np.ndarray, m: int, n: int, eps: float) -> float:
    smax = float(S_host[0]) if S_host.size else 0.0
    return max(m, n) * eps * smax


DECISION_BAND = 0.5
"""Half-width of the band around the rank tolerance ``tau`` inside which a decision counts in
:func:`basis_conditioning` (relative to ``tau``).  Exact structure (zero singular values, exact ties) computes to
within about one ulp of ``sigma_max``, ``tau / max(m, n)`` from zero; a value within ``tau / 2`` of ``tau`` is
closer to the threshold than to that structure, so the rank or cluster it decides is no longer robust."""


def basis_conditioning(S: Any, m: int, n: int, dtype: Any) -> float:
    """How well the canonical basis of an ``m x n`` matrix with singular values ``S`` is determined.

    Returns ``kappa = min(1, eps / delta)``, ``eps = eps(dtype)``: the relative change of the canonical
    ``P`` (and ``Q``) that a rounding-level change of the matrix (``eps ||G||``) can cause.  With ``S``
    sorted descending, ``sigma_max = S[0]``, ``tau = max(m, n) eps sigma_max`` (the rank and cluster
    tolerance of rules 2 and 3, docs/spec.md section 4) and ``r`` the numerical rank, ``delta`` is the
    smallest of, all relative to ``sigma_max``:

    * the **gaps next to each kept direction**: ``S[i] - S[i+1]`` for ``i < r`` (``i + 1 < min(m, n)``,
      so the last kept value's gap to the first dropped one counts); a singular vector moves by
      ``eps sigma_max / gap`` (Wedin).  Gaps ``<= tau`` are inside a cluster, which the canonical rules
      re-choose from its subspace (rule 3): they do not count;
    * the **decision margins**: ``|x - tau|`` for each quantity compared with ``tau`` (the rank margin:
      the smallest kept ``S[r-1]`` and the largest dropped ``S[r]``; and every gap ``S[i] - S[i+1]``,
      ``i + 1 < r``, which decides a cluster) that lies within ``DECISION_BAND * tau`` of ``tau``: rounding
      of ``eps sigma_max`` can flip such a decision and change the basis by O(1).  Exact structure (zero
      singular values, exact ties) lies about ``tau`` away and does not count.

    ``delta = 1`` when nothing counts (a zero matrix, a rank-1 one: ``kappa = eps``).  Examples (float64,
    3 x 5): ``S = (1, 0.5, 0.25)`` gives ``eps / 0.25``; ``S = (1, 1 - 1e-8, 0.5)`` gives ``eps / 1e-8``;
    ``S = (1, 1, 0.5)`` (a cluster) gives ``eps / 0.5``; ``S = (1, 0.5, 0)`` gives ``eps / 0.5``.
    :func:`adadiag_ref.replay.trajectory_conditioning` evaluates it at every refresh of a run, and
    ``docs/golden.md`` ("Tolerances") turns it into the tolerance two correct implementations meet.
    """
    eps = float(np.finfo(np.dtype(dtype)).eps)
    values = np.sort(np.abs(np.asarray(S, dtype=np.float64)).ravel())[::-1]
    if values.size == 0 or not values[0] > 0:
        return eps
    smax = float(values[0])
    tau = _tolerance(values, m, n, eps)
    k, rank = values.size, int(np.sum(values > tau))
    gaps = values[:-1] - values[1:]  # gaps[i] = S[i] - S[i+1]
    kept_gaps = gaps[: min(rank, k - 1)]
    counted = [kept_gaps[kept_gaps > tau]]
    decisions = [gaps[: max(rank - 1, 0)], values[max(rank - 1, 0) : rank + 1]]
    margins = np.abs(np.concatenate(decisions) - tau)
    counted.append(margins[margins < DECISION_BAND * tau])
    candidates = np.concatenate(counted)
    delta = float(np.min(candidates)) / smax if candidates.size else 1.0
    return 1.0 if delta <= eps else min(1.0, eps / delta)


def _first_near_max(values: Array, rtol: float, xp: Namespace) -> int:
    """Index of the first entry within ``rtol`` (relative) of the maximum."""
    vmax = xp.max(values)
    near = xp.astype(values >= vmax * (1.0 - rtol), xp.int32)
    return int(xp.argmax(near))


def sign_canonical(B: Array, rtol: float, *, xp: Namespace | None = None) -> Array:
    """Signs ``s_j`` in {+1, -1} making the largest-magnitude entry of column j positive.

    ``s_j = sign(B[i*, j])`` with ``i* = min{i : |B_ij| >= (1 - rtol) max_i |B_ij|}``.
    Returns the vector of signs (``+1`` for an all-zero column); for a stack ``B`` of shape ``(..., d, r)``,
    the signs of every matrix, shape ``(..., r)``.  Array-API operations only (a handful of launches on a
    device, no host read), and the same operations whatever the backend, so the same signs bit for bit.
    """
    xp = namespace(B, xp=xp)
    mag = xp.abs(B)
    colmax = xp.max(mag, axis=-2)
    near = xp.astype(mag >= xp.expand_dims(colmax, axis=-2) * (1.0 - rtol), xp.int32)
    first = xp.argmax(near, axis=-2)
    rows = xp.arange(B.shape[-2], device=creation_device(B))
    hit = rows[:, None] == xp.expand_dims(first, axis=-2)
    picked = xp.sum(xp.where(hit, B, xp.zeros_like(B)), axis=-2)
    return xp.where(picked < 0, -xp.ones_like(picked), xp.ones_like(picked))


def _pivoted_gram_schmidt(
    X: Array, count: int, against: Array | None, rtol: float, xp: Namespace, fast: bool = False
) -> Array:
    """``count`` orthonormal vectors chosen greedily from the columns of ``X``.

    Step k picks the column of the running residual ``R`` (``X`` with every chosen
    vector projected out) of largest norm, ties to the lowest index, normalises
    it, re-orthogonalises it against ``against`` and the vectors chosen so far,
    and projects it out of ``R``.  Returns a ``d x count`` matrix.

    ``fast`` (Gram refresh route only): the same steps with an in-place residual
    (:func:`adadiag_ref._kernels.pivoted_gram_schmidt`) for NumPy input.
    """
    if fast:
        from . import _kernels

        if _kernels.usable(xp, X, against):
            return _kernels.pivoted_gram_schmidt(X, count, against, rtol)
    residual = X
    chosen: list[Array] = []
    for _ in range(count):
        norms = xp.sum(residual * residual, axis=0)
        p = _first_near_max(norms, rtol, xp)
        v = residual[:, p]
        v = v / sqrt(xp.sum(v * v), xp)
        blocks = ([against] if against is not None else []) + ([xp.stack(chosen, axis=1)] if chosen else [])
        for B in blocks:  # second pass of Gram-Schmidt: "twice is enough"
            v = v - B @ (xp.matrix_transpose(B) @ v)
        v = v / sqrt(xp.sum(v * v), xp)
        chosen.append(v)
        residual = residual - v[:, None] * (v @ residual)[None, :]
    if not chosen:
        return xp.zeros((X.shape[0], 0), dtype=X.dtype, device=creation_device(X))
    return xp.stack(chosen, axis=1)


_CHOLESKY_MIN_COUNT = 24
"""Clusters this wide or wider take the projector's pivoted Cholesky on the fast routes (narrower ones the
in-place Gram-Schmidt, cheaper there: ``~d^2 m`` flops against the projector's ``~m^2 d``)."""

_CHOLESKY_MIN_FRACTION = 8
"""... and at least ``m / 8`` of the side ``m``: the projector costs ``~m^2 d`` against the loop's ``~d^2 m``,
so narrow clusters of a large side stay with the loop (measured on a 4096 x 4096 Gaussian gradient, 43 clusters
of 24-100 values: 50 s with the projector for every one of them, the loop's cost with this bound)."""


def _cholesky_pays(count: int, size: int) -> bool:
    """Whether ``count`` columns of a side of ``size`` take the projector's pivoted Cholesky (fast routes)."""
    return count >= max(_CHOLESKY_MIN_COUNT, size // _CHOLESKY_MIN_FRACTION)


def _projector_columns(
    span: np.ndarray | None, orthogonal: np.ndarray | None, size: int, count: int, rtol: float
) -> np.ndarray | None:
    """The ``count`` canonical columns of a subspace from its projector (fast routes, NumPy, numba).

    The subspace is ``span(span)`` (orthonormal columns ``W``, projector ``A = W W^T``)
    or the orthogonal complement of ``span(orthogonal)`` (``A = I - B B^T``); the
    caller passes the narrower of the two, since forming ``A`` costs
    ``size^2 x width``.  Pivoted Gram-Schmidt over the projections ``A e_1 .. A e_size``
    (rules 3 and 4 of the module docstring) is the pivoted Cholesky factorisation
    of ``A``: the residual norm of ``A e_j`` after k steps is the diagonal of the
    Schur complement ``A_k`` (the projector onto what is left), and the chosen
    vector ``A_k e_p / sqrt((A_k)_pp)`` is column k of the factor
    (:func:`adadiag_ref._kernels.pivoted_cholesky_columns`: same pivot rule,
    ``~size^2 count / 2`` flops in one pass per step, against ``~4 size^2 count``
    for Gram-Schmidt over the explicit residual).  ``A`` and the factorisation
    are float64 whatever the input's dtype, from the basis re-orthonormalised in
    float64 (``~4 size width^2`` flops), so that ``A`` is a projector to
    float64 rounding: its columns are then orthonormal to the input's own
    rounding, as the Gram-Schmidt loop's after its second pass.
    Returns ``size x count`` in float64, or ``None`` (numba missing, or fewer than
    ``count`` positive pivots: the caller takes the Gram-Schmidt loop).
    """
    from . import _kernels

    if not _kernels.AVAILABLE:
        return None
    basis = span if span is not None else orthogonal
    assert basis is not None
    # Re-orthonormalise in float64 first: a float32 basis is orthonormal only to ~1e-7, which makes W W^T a
    # projector only to ~1e-7, and the late pivots (small Schur complements, ~1/(size - k)) would magnify that
    # into the columns' orthogonality (observed 1.7e-5 on 600 x 600).  One Newton-Schulz step towards the polar
    # factor, W (3 I - W^T W) / 2, squares the error (1e-7 -> 1e-14) and keeps the span (a right factor); two
    # GEMMs, a third of the time of a QR here.
    W = basis.astype(np.float64)
    if W.shape[1]:
        W = W @ (1.5 * np.eye(W.shape[1]) - 0.5 * (W.T @ W))
    A = W @ W.T if span is not None else np.eye(size) - W @ W.T
    return _kernels.pivoted_cholesky_columns(A, count, rtol)


def canonical_complement(B: Array, size: int, rtol: float, *, xp: Namespace | None = None, fast: bool = False) -> Array:
    """Deterministic orthonormal completion of the columns of ``B`` (``size x r``).

    Returns ``size x (size - r)`` columns by pivoted Gram-Schmidt over ``e_1..e_size``
    projected on the orthogonal complement of ``span(B)``, with the sign rule applied.
    """
    xp = namespace(B, xp=xp)
    return _complement(B, None, size, rtol, xp, fast)


def _complement(B: Array, null: Array | None, size: int, rtol: float, xp: Namespace, fast: bool) -> Array:
    """:func:`canonical_complement`, given (fast routes) ``null``: any orthonormal basis of the complement, or None.

    A full basis (``r == size``) has an empty completion, returned before any
    product.  On the fast routes (NumPy with numba) the columns come from the
    pivoted Cholesky factorisation of the complement's projector
    (:func:`_projector_columns`), formed from ``null`` when it is the narrower
    side, else from ``I - B B^T``, when the completion is wide enough
    (:func:`_cholesky_pays`); a narrower one takes the in-place Gram-Schmidt.
    """
    r = B.shape[1]
    count = size - r
    if count == 0:
        return xp.zeros((size, 0), dtype=B.dtype, device=creation_device(B))
    C = None
    from_null = null is not None and count <= r  # the narrower basis of the complement's projector
    wide = _cholesky_pays(count, size)  # else the projector costs more than the in-place loop
    if fast and wide and type(B) is np.ndarray and B.dtype in (np.float32, np.float64):
        columns = _projector_columns(
            np.asarray(null) if from_null else None, None if from_null else B, size, count, rtol
        )
        if columns is not None:
            C = columns.astype(B.dtype)
    if C is None:
        eye = xp.eye(size, dtype=B.dtype, device=creation_device(B))
        complement = eye - B @ xp.matrix_transpose(B) if r else eye
        C = _pivoted_gram_schmidt(complement, count, B if r else None, rtol, xp, fast)
    return C * sign_canonical(C, rtol, xp=xp)[None, :]


def _clusters(S_host: np.ndarray, rank: int, tol: float) -> list[tuple[int, int]]:
    """Half-open index ranges of runs of singular values closer than ``tol``."""
    bounds: list[tuple[int, int]] = []
    start = 0
    for i in range(1, rank + 1):
        if i == rank or S_host[i - 1] - S_host[i] > tol:
            bounds.append((start, i))
            start = i
    return bounds


def _projector_source(m: int, k: int, a: int, b: int) -> tuple[np.ndarray, bool]:
    """The columns of ``U`` (``m x k``) whose projector gives the cluster ``[a, b)`` (:func:`_fast_cluster_columns`):
    ``(indices, True)`` for the cluster's own span, ``(indices, False)`` for the other columns of a square ``U``
    when they are the narrower basis (the cluster is then their orthogonal complement)."""
    if k == m and m - (b - a) < b - a:
        return np.concatenate([np.arange(a), np.arange(b, k)]), False
    return np.arange(a, b), True


def _fast_cluster_columns(U: Array, a: int, b: int, rtol: float) -> np.ndarray | None:
    """A wide cluster's canonical columns ``U_c A`` by :func:`_projector_columns` (fast routes), or None.

    The cluster's subspace is ``span(U[:, a:b])``; when ``U`` is square (the Gram
    route's ``m x m`` eigenvectors) it is also the orthogonal complement of the
    other columns, the narrower basis for the trailing cluster of a decaying
    spectrum (``m - (b - a)`` columns instead of ``b - a``): :func:`_projector_source`.
    """
    if type(U) is not np.ndarray or U.dtype not in (np.float32, np.float64):
        return None
    m, k = U.shape
    index, span = _projector_source(m, k, a, b)
    columns = _cluster_projector_columns(U[:, a:b] if span else np.take(U, index, axis=1), span, m, b - a, rtol)
    return None if columns is None else columns.astype(U.dtype)


def _cluster_projector_columns(source: np.ndarray, span: bool, m: int, width: int, rtol: float) -> np.ndarray | None:
    """:func:`_projector_columns` of a cluster from the columns :func:`_projector_source` chose (host arrays)."""
    return _projector_columns(source if span else None, None if span else source, m, width, rtol)


def canonicalize_svd(
    U: Array,
    S: Array,
    Vh: Array | None,
    shape: tuple[int, int],
    *,
    compute_p: bool = True,
    compute_q: bool = True,
    xp: Namespace | None = None,
    fast: bool = False,
) -> CanonicalSVD:
    """Apply the canonical rules to any thin SVD ``G = U diag(S) Vh``.

    ``U`` is ``m x k`` and ``Vh`` is ``k x n`` (``k <= min(m, n)``; ``Vh`` may be
    ``None`` when ``Q`` is not requested).  Any decomposition of the same ``G``
    (another library's signs, order within a cluster or null-space basis) maps to
    the same result, up to rounding.  ``fast`` (set only by the Gram refresh route,
    :func:`_gram_route`, for NumPy input) computes the same pivots and vectors by
    cheaper steps: clusters wide enough for :func:`_cholesky_pays` and the
    completion by the pivoted Cholesky factorisation of their projector
    (:func:`_projector_columns`), narrower clusters by an in-place Gram-Schmidt.

    Factors of any other backend than NumPy (CuPy, torch, JAX, ``array_api_strict``) stay on their device
    (:func:`_canonical_stack`): only ``S`` comes to the host, to decide the order, the rank and the clusters;
    the order, the signs and the basis are array-API operations on the device; the sequential rules
    (clusters, completion) run on the host on the columns involved only.  The same rules and the same
    operations, so the same bases to rounding (bit for bit where the backend computes as NumPy does).
    Device singular values holding NaN or Inf raise ``ValueError``.
    """
    xp = namespace(U, S, xp=xp)
    if not is_numpy_namespace(xp):
        if compute_q and Vh is None:
            raise ValueError("Q was requested but no right singular vectors were given")
        U1, S1 = xp.expand_dims(U, axis=0), xp.expand_dims(S, axis=0)
        Vh1 = xp.expand_dims(Vh, axis=0) if compute_q and Vh is not None else None
        (result,) = _canonical_stack(U1, S1, Vh1, shape, compute_p=compute_p, compute_q=compute_q, fast=fast, xp=xp)
        if result is None:
            raise ValueError("canonicalize_svd: the singular values contain NaN or Inf")
        return result
    m, n = shape
    dtype_eps = float(xp.finfo(U.dtype).eps)
    rtol = dtype_eps**0.5  # tie tolerance, see the module docstring
    order = xp.argsort(S, descending=True, stable=True)
    S = xp.take(S, order)
    U = xp.take(U, order, axis=1)
    if Vh is not None:
        Vh = xp.take(Vh, order, axis=0)
    S_host = to_numpy(S).astype(np.float64)
    tol = _tolerance(S_host, m, n, dtype_eps)
    rank = int(np.sum(S_host > tol)) if S_host.size and S_host[0] > 0 else 0

    p_cols: list[Array] = []
    q_cols: list[Array] = []
    for a, b in _clusters(S_host, rank, tol):
        Uc = U[:, a:b]
        columns = _fast_cluster_columns(U, a, b, rtol) if fast and _cholesky_pays(b - a, U.shape[0]) else None
        if b - a == 1:
            coeff = None
        elif columns is not None:  # G Q_c = P_c sigma needs the coefficients A = U_c^T P_c (U_c orthonormal)
            coeff = xp.matrix_transpose(Uc) @ columns if compute_q else None
            Uc = columns
        else:
            coeff = _pivoted_gram_schmidt(xp.matrix_transpose(Uc), b - a, None, rtol, xp, fast)
            Uc = Uc @ coeff
        p_cols.append(Uc)
        if compute_q:
            if Vh is None:
                raise ValueError("Q was requested but no right singular vectors were given")
            Vc = xp.matrix_transpose(Vh[a:b, :])
            q_cols.append(Vc if coeff is None else Vc @ coeff)

    device = creation_device(U)
    Pr = xp.concat(p_cols, axis=1) if p_cols else xp.zeros((m, 0), dtype=U.dtype, device=device)
    signs = sign_canonical(Pr, rtol, xp=xp) if rank else None
    P = Q = None
    if compute_p:
        P_rank = Pr * signs[None, :] if signs is not None else Pr
        null = U[:, rank:] if fast and U.shape[1] == m else None  # spans the completion: U is square
        P = xp.concat([P_rank, _complement(P_rank, null, m, rtol, xp, fast)], axis=1)
    if compute_q:
        Qr = xp.concat(q_cols, axis=1) if q_cols else xp.zeros((n, 0), dtype=U.dtype, device=device)
        Q_rank = Qr * signs[None, :] if signs is not None else Qr
        Q = xp.concat([Q_rank, _complement(Q_rank, None, n, rtol, xp, fast)], axis=1)
    return CanonicalSVD(P=P, S=S, Q=Q, rank=rank)


def canonical_svd(
    G: Array,
    /,
    *,
    compute_p: bool = True,
    compute_q: bool = True,
    method: str = "svd",
    label: str | None = None,
    xp: Namespace | None = None,
) -> CanonicalSVD:
    """Canonical full SVD ``G = P Sigma Q^T`` of an ``m x n`` matrix.

    ``P`` (``m x m``) and ``Q`` (``n x n``) are orthogonal and fixed by the rules in
    the module docstring, so every backend and every valid LAPACK output give the
    same bases up to rounding.  Only the requested sides are formed: a one-sided
    optimizer asks for ``P`` alone and never builds an ``n x n`` matrix.

    The thin SVD (``full_matrices=False``) is the only decomposition computed; the
    ``n - m`` null-space columns of ``Q`` come from the deterministic completion.

    ``method`` (the optimizer's ``basis_method``): ``"svd"`` (default here, the
    reference route), ``"gram"`` or ``"auto"``: ``P`` from the eigenvectors of
    the float64 Gram matrix ``G G^T`` where :func:`gram_route_applies` (float32,
    ``Q`` not requested; ``auto`` not on JAX), else the SVD.  See :func:`_gram_route`.

    Where the SVD runs under ``"gram"`` or ``"auto"`` (float64, two-sided), its canonical rules are
    computed by the fast routes' steps with numba (``canonicalize_svd(fast=True)``; NumPy arrays, and CPU
    torch tensors through zero-copy NumPy views of torch's factors): the same pivots
    and vectors as the reference loop to rounding (float64: a few ulps, within the golden tolerance), and a
    completion of ``n - m`` columns by one pivoted Cholesky of ``~n^2 (n - m) / 2`` flops instead of ``n - m``
    rebuilds of an ``n x n`` residual (two-sided refresh of 512 x 1376: 0.6-1.0 s against 9 s in float32,
    0.5 s against 15 s in float64).  ``"svd"`` always runs the reference loop.

    Failures (``docs/reliability.md``): a matrix holding NaN or Inf raises
    :class:`NonFiniteInputError` before any LAPACK call; a failing SVD walks
    :data:`DECOMPOSITION_LADDER` and raises :class:`DecompositionError` when every
    rung fails.  ``label`` (e.g. ``"gradient of 'fc.weight' at step 5"``) names
    the matrix in those messages.
    """
    xp = namespace(G, xp=xp)
    if G.ndim != 2:
        raise ValueError(f"canonical_svd expects a matrix, got shape {tuple(G.shape)}")
    m, n = (int(d) for d in G.shape)
    if m == 0 or n == 0:
        raise ValueError(f"canonical_svd needs a non-empty matrix, got shape {(m, n)}")
    _check_method(method)  # before any work: a typo must not silently select the reference
    where = f"{label} (matrix shape {(m, n)})" if label else f"matrix of shape {(m, n)}"
    if count_nonfinite(G, xp):  # the guard: LAPACK never sees NaN or Inf (it may loop on them)
        raise NonFiniteInputError(f"canonical_svd: the {where} contains NaN or Inf")
    if gram_route_applies(G, method, compute_q=compute_q, xp=xp):
        fast = _gram_route(G, m, n, compute_p, xp=xp)
        if fast is not None:
            return fast
    U, S, Vh = _thin_svd(G, where, xp)
    fast_steps = method != "svd"  # "svd": the reference canonicalisation, step by step
    return canonicalize_svd(U, S, Vh if compute_q else None, (m, n), compute_p=compute_p, compute_q=compute_q, xp=xp,
                            fast=fast_steps)  # fmt: skip


# ----------------------------------------------------------------------------- the rules on a device


def _nan_unless(finite: Array, S: Array, xp: Namespace) -> Array:
    """``S`` (a stack ``(c, k)``) with the rows of the matrices whose factors are not all finite set to NaN: the
    factors' finiteness travels to the host with the singular values, in the same copy."""
    return xp.where(xp.expand_dims(finite, axis=-1), S, xp.full_like(S, float("nan")))


def _gram_factors(lam: Array, vecs: Array, m: int, n: int, xp: Namespace) -> tuple[Array, Array]:
    """:func:`_gram_canonical`'s map on a device stack: ``eigh``'s ascending ``lambda`` ``(c, m)`` and
    eigenvectors ``(c, m, m)`` of ``G_i G_i^T`` to the float32 thin factors ``U`` ``(c, m, k)`` and
    ``S = sqrt(max(lambda, 0))`` ``(c, k)``, descending (``k = min(m, n)``), on the device; the rows of ``S``
    are NaN where ``lambda`` or the eigenvectors hold NaN or Inf (:func:`_nan_unless`)."""
    if TORCH_CPU_ON_NUMPY and _on_torch_cpu(vecs, xp):  # host memory: NumPy's kernels on the views
        lam_view, vecs_view = to_numpy(lam), to_numpy(vecs)
        U_host, S_host = _gram_factors(lam_view, vecs_view, m, n, namespace(vecs_view))
        return _shared_tensor(U_host), _shared_tensor(S_host)
    k = min(m, n)
    # the last k columns, last first: a cast and a flip (a copy each), 25x faster than a gather on torch CPU
    U = xp.flip(xp.astype(vecs[..., m - k :], xp.float32), axis=-1)
    sigma = sqrt(xp.clip(xp.flip(lam, axis=-1), min=0.0), xp)
    finite = xp.all(xp.isfinite(lam), axis=-1) & xp.all(xp.isfinite(vecs), axis=(-2, -1))
    return U, _nan_unless(finite, xp.astype(sigma[..., :k], xp.float32), xp)


class _Rules(NamedTuple):
    """What the host decides for one matrix from its singular values alone (rules 1-3)."""

    order: np.ndarray | None  # the permutation to descending order; None when the factors are already in it
    rank: int
    clusters: list[tuple[int, int]]


def _decide_rules(S_raw: np.ndarray, m: int, n: int, eps: float) -> _Rules | None:
    """Rules 1-3 from host singular values (in the factors' dtype, any order), exactly as
    :func:`canonicalize_svd` decides them on NumPy; ``None`` when they hold NaN or Inf."""
    if not bool(np.all(np.isfinite(S_raw))):
        return None
    order = np.asarray(namespace(S_raw).argsort(S_raw, descending=True, stable=True))
    S_host = np.take(S_raw, order).astype(np.float64)
    tol = _tolerance(S_host, m, n, eps)
    rank = int(np.sum(S_host > tol)) if S_host.size and S_host[0] > 0 else 0
    identity = bool(np.array_equal(order, np.arange(order.size)))
    return _Rules(None if identity else order, rank, _clusters(S_host, rank, tol))


def _host_copies(arrays: list[Array], xp: Namespace) -> list[np.ndarray]:
    """Writable host copies of device arrays of one dtype, in one transfer (one synchronisation on a GPU)."""
    if not arrays:
        return []
    flat = xp.concat([xp.reshape(a, (-1,)) for a in arrays])
    host = np.array(to_numpy(flat))  # a copy: the host rules may work in place
    copies, start = [], 0
    for a in arrays:
        shape = tuple(int(d) for d in a.shape)
        copies.append(host[start : start + math.prod(shape)].reshape(shape))
        start += math.prod(shape)
    return copies


def _canonical_stack(
    U: Array,
    S: Array,
    Vh: Array | None,
    shape: tuple[int, int],
    *,
    compute_p: bool,
    compute_q: bool,
    fast: bool,
    xp: Namespace,
) -> list[CanonicalSVD | None]:
    """The canonical rules on a stack of thin SVDs ``U (c, m, k), S (c, k), Vh (c, k, n)`` on their device.

    Only ``S`` comes to the host (one copy for the stack): the order, the numerical rank and the clusters are
    decided there (:func:`_decide_rules`).  A *plain* matrix (already in descending order, full rank, no
    cluster, and no completion of a requested side: every generic matrix of a one-sided refresh in the work
    frame or of a square one) is finished on the device, all plain matrices at once: the signs by
    :func:`sign_canonical` on the stack, ``P = U diag(s)``, ``Q = V diag(s)``.  The others take
    :func:`_canonical_involved`: the same rules as :func:`canonicalize_svd` on NumPy, with only the columns of
    the clusters and of the completions on the host.  Entry ``i`` is ``None`` where ``S[i]`` holds NaN or Inf.
    """
    if TORCH_CPU_ON_NUMPY and _on_torch_cpu(U, xp):
        return _torch_cpu_on_numpy(U, S, Vh, shape, compute_p=compute_p, compute_q=compute_q, fast=fast)
    m, n = shape
    count, k = int(U.shape[0]), int(U.shape[-1])
    eps = float(xp.finfo(U.dtype).eps)
    rtol = eps**0.5  # tie tolerance, see the module docstring
    rules = [_decide_rules(s, m, n, eps) for s in to_numpy(S)]  # the one read-back of every refresh
    results: list[CanonicalSVD | None] = [None] * count
    plain = [
        i
        for i, r in enumerate(rules)
        if r is not None
        and r.order is None
        and r.rank == k
        and all(b - a == 1 for a, b in r.clusters)
        and (not compute_p or k == m)
        and (not compute_q or k == n)
    ]
    if plain:
        index = None if len(plain) == count else xp.asarray(plain, device=creation_device(U))

        def members(x: Array) -> Array:
            return x if index is None else xp.take(x, index, axis=0)

        U_plain = members(U)
        signs = xp.expand_dims(sign_canonical(U_plain, rtol, xp=xp), axis=-2)
        P = U_plain * signs if compute_p else None
        Q = xp.matrix_transpose(members(Vh)) * signs if compute_q and Vh is not None else None
        S_plain = members(S)
        for j, i in enumerate(plain):
            results[i] = CanonicalSVD(None if P is None else P[j, ...], S_plain[j, ...],
                                      None if Q is None else Q[j, ...], k)  # fmt: skip
    involved = [(i, r) for i, r in enumerate(rules) if r is not None and i not in set(plain)]
    if involved:
        factors = [(U[i, ...], S[i, ...], None if Vh is None else Vh[i, ...], r) for i, r in involved]
        done = _canonical_involved(factors, shape, compute_p, compute_q, fast, rtol, xp)
        for (i, _), result in zip(involved, done, strict=True):
            results[i] = result
    return results


TORCH_CPU_ON_NUMPY = True
"""Torch tensors in CPU memory take :func:`_canonical_stack` with NumPy's kernels on zero-copy views (the
results shared back, nothing copied): the same operations and bases, but NumPy's single-threaded elementwise
kernels, which on a loaded 2-core machine were 2-5x faster than torch's 2-thread ones for these passes (and
1.2-2.6x slower with one torch thread; ``docs/performance.md``).  ``False`` runs torch's own operations (tests
use it to exercise the device route on CPU)."""


def _on_torch_cpu(U: Array, xp: Namespace) -> bool:
    """A float32/float64 torch tensor in CPU memory (it has a zero-copy NumPy view)."""
    return is_torch_namespace(xp) and U.device.type == "cpu" and U.dtype in (xp.float32, xp.float64)


def _torch_cpu_on_numpy(
    U: Array, S: Array, Vh: Array | None, shape: tuple[int, int], *, compute_p: bool, compute_q: bool, fast: bool
) -> list[CanonicalSVD | None]:
    """:func:`_canonical_stack` of CPU torch factors on their NumPy views; the bases back as torch tensors
    sharing the NumPy results' memory (:data:`TORCH_CPU_ON_NUMPY`)."""

    U_host, S_host = to_numpy(U), to_numpy(S)
    Vh_host = None if Vh is None else to_numpy(Vh)
    results = _canonical_stack(U_host, S_host, Vh_host, shape, compute_p=compute_p, compute_q=compute_q, fast=fast,
                               xp=namespace(U_host))  # fmt: skip

    def shared(a: Any) -> Any:
        return None if a is None else _shared_tensor(a)

    return [None if r is None else CanonicalSVD(shared(r.P), shared(r.S), shared(r.Q), r.rank) for r in results]


def _shared_tensor(a: np.ndarray) -> Array:
    """A C-contiguous CPU torch tensor of ``a``, sharing its memory where ``a`` already is C-contiguous (a copy
    otherwise: a flipped view, which torch cannot share, or LAPACK's column-major factors).  Contiguous, as the
    torch adapter stores its bases: a basis of another memory order would make ``P U~`` round differently in
    :func:`~adadiag_ref.step` than in the adapter (``tests/test_adapter_torch.py`` compares them bit for bit)."""
    import torch

    shareable = a.flags.c_contiguous and min(a.strides, default=0) >= 0  # size-1 arrays are "contiguous" at any stride
    return torch.from_numpy(a if shareable else a.copy(order="C"))


def _canonical_involved(
    factors: list[tuple[Array, Array, Array | None, _Rules]],
    shape: tuple[int, int],
    compute_p: bool,
    compute_q: bool,
    fast: bool,
    rtol: float,
    xp: Namespace,
) -> list[CanonicalSVD]:
    """:func:`canonicalize_svd`'s steps on device factors that need a host rule (a cluster, a completion, an
    order), each step the NumPy route's own operation on the same values: the permutation and every product on
    the device; on the host, the cluster rules on the cluster's columns (:func:`_cluster_rules`) and the
    completions on the rank's columns (:func:`_completions`), one copy each way per round for all matrices."""
    m, n = shape
    device = creation_device(factors[0][0])
    ordered = []
    for U, S, Vh, rules in factors:
        if rules.order is not None:
            order = xp.asarray(rules.order, device=device)
            U, S = xp.take(U, order, axis=1), xp.take(S, order)
            Vh = None if Vh is None else xp.take(Vh, order, axis=0)
        ordered.append((U, S, Vh, rules))
    wide = [(j, a, b) for j, (_, _, _, r) in enumerate(ordered) for a, b in r.clusters if b - a > 1]
    cluster_rules = _cluster_rules([(ordered[j][0], a, b) for j, a, b in wide], fast, rtol, xp)
    rank_parts = []
    for j, (U, _, Vh, rules) in enumerate(ordered):
        p_cols: list[Array] = []
        q_cols: list[Array] = []
        start = 0  # the first column of the current run of single values (copied as they are)
        for (w, a, b), (columns, coeff) in zip(wide, cluster_rules, strict=True):
            if w != j:
                continue
            if start < a:
                p_cols.append(U[:, start:a])
                q_cols += [xp.matrix_transpose(Vh[start:a, :])] if compute_q and Vh is not None else []
            if columns is not None:  # G Q_c = P_c sigma needs the coefficients A = U_c^T P_c (U_c orthonormal)
                columns = xp.asarray(columns, device=device)
                coeff = xp.matrix_transpose(U[:, a:b]) @ columns if compute_q else None
            else:
                coeff = xp.asarray(coeff, device=device)
                columns = U[:, a:b] @ coeff
            p_cols.append(columns)
            q_cols += [xp.matrix_transpose(Vh[a:b, :]) @ coeff] if compute_q and Vh is not None else []
            start = b
        if start < rules.rank:
            p_cols.append(U[:, start : rules.rank])
            q_cols += [xp.matrix_transpose(Vh[start : rules.rank, :])] if compute_q and Vh is not None else []
        Pr = xp.concat(p_cols, axis=1) if p_cols else xp.zeros((m, 0), dtype=U.dtype, device=device)
        signs = xp.expand_dims(sign_canonical(Pr, rtol, xp=xp), axis=0) if rules.rank else None
        P_rank = Pr * signs if signs is not None else Pr
        Q_rank = None
        if compute_q:
            Qr = xp.concat(q_cols, axis=1) if q_cols else xp.zeros((n, 0), dtype=U.dtype, device=device)
            Q_rank = Qr * signs if signs is not None else Qr
        null = U[:, rules.rank :] if fast and int(U.shape[1]) == m else None  # spans the completion: U is square
        rank_parts.append((P_rank if compute_p else None, null, Q_rank))
    completed = _completions(rank_parts, shape, fast, rtol, xp)
    return [CanonicalSVD(P, S, Q, rules.rank) for (P, Q), (_, S, _, rules) in zip(completed, ordered, strict=True)]


def _source_columns(U: Array, a: int, b: int, source: tuple[np.ndarray, bool] | None, xp: Namespace) -> Array:
    """The device columns :func:`_cluster_rules` needs on the host for the cluster ``[a, b)``: the cluster's own
    (``source`` None or a span), else the other columns :func:`_projector_source` chose."""
    if source is None or source[1]:
        return U[:, a:b]
    return xp.take(U, xp.asarray(source[0], device=creation_device(U)), axis=1)


def _cluster_rules(
    clusters: list[tuple[Array, int, int]], fast: bool, rtol: float, xp: Namespace
) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
    """Rule 3 on the host for the clusters ``U[:, a:b]`` of device factors: ``(columns, None)`` where the
    projector's pivoted Cholesky gives the canonical columns (fast routes, wide clusters: from the columns
    :func:`_projector_source` chooses, the narrower side), else ``(None, A)``, the pivoted Gram-Schmidt
    coefficients over the cluster's rows, as :func:`canonicalize_svd` on NumPy.  The columns each needs come
    to the host in one copy for all clusters (a second only for a projector that declined)."""
    from . import _kernels

    answers: list[tuple[np.ndarray | None, np.ndarray | None]] = [(None, None)] * len(clusters)
    sources: list[tuple[np.ndarray, bool] | None] = []
    for U, a, b in clusters:
        m, k = (int(d) for d in U.shape)
        projector = fast and _kernels.AVAILABLE and _cholesky_pays(b - a, m) and U.dtype in (xp.float32, xp.float64)
        sources.append(_projector_source(m, k, a, b) if projector else None)
    needed = [_source_columns(U, a, b, src, xp) for (U, a, b), src in zip(clusters, sources, strict=True)]
    fetched = _host_copies(needed, xp)
    spans: dict[int, np.ndarray] = {}
    for c, ((U, a, b), src, host) in enumerate(zip(clusters, sources, fetched, strict=True)):
        if src is not None:
            columns = _cluster_projector_columns(host, src[1], int(U.shape[0]), b - a, rtol)
            if columns is not None:
                answers[c] = (columns.astype(host.dtype), None)
                continue
        if src is None or src[1]:
            spans[c] = host
    missing = [c for c, (columns, _) in enumerate(answers) if columns is None and c not in spans]
    for c, host in zip(missing, _host_copies([clusters[c][0][:, clusters[c][1] : clusters[c][2]] for c in missing], xp),
                       strict=True):  # fmt: skip
        spans[c] = host
    for c, host in spans.items():
        hxp = namespace(host)
        answers[c] = (None, _pivoted_gram_schmidt(hxp.matrix_transpose(host), host.shape[1], None, rtol, hxp, fast))
    return answers


def _completions(
    parts: list[tuple[Array | None, Array | None, Array | None]],
    shape: tuple[int, int],
    fast: bool,
    rtol: float,
    xp: Namespace,
) -> list[tuple[Array | None, Array | None]]:
    """Rule 4 for device factors: ``(P, Q)`` from the rank's columns ``(P_rank, null, Q_rank)`` (``None`` where
    a side is not requested), each completed by :func:`_complement` on the host where it has fewer columns
    than rows; every completed side's columns (and ``null``, where the fast route uses it) come to the host
    in one copy for all matrices, the completions go back."""
    m, n = shape
    wanted: list[Array] = []
    for P_rank, null, Q_rank in parts:
        if P_rank is not None and int(P_rank.shape[1]) < m:
            from_null = null is not None and m - int(P_rank.shape[1]) <= int(P_rank.shape[1])
            wanted += [P_rank] + ([null] if from_null else [])
        if Q_rank is not None and int(Q_rank.shape[1]) < n:
            wanted.append(Q_rank)
    hosts = iter(_host_copies(wanted, xp))
    out: list[tuple[Array | None, Array | None]] = []
    for P_rank, null, Q_rank in parts:
        sides: list[Array | None] = []
        for B, size, use_null in ((P_rank, m, True), (Q_rank, n, False)):
            if B is None or int(B.shape[1]) == size:
                sides.append(B)
                continue
            r = int(B.shape[1])
            B_host = next(hosts)
            null_host = next(hosts) if use_null and null is not None and size - r <= r else None
            C = _complement(B_host, null_host, size, rtol, namespace(B_host), fast)
            sides.append(xp.concat([B, xp.asarray(C, device=creation_device(B))], axis=1))
        out.append((sides[0], sides[1]))
    return out


# ----------------------------------------------------------------------------- failures and the retry ladder


class NonFiniteInputError(ValueError):
    """A decomposition was asked for a matrix holding NaN or Inf (refused before any LAPACK call)."""


class DecompositionError(np.linalg.LinAlgError):
    """Every rung of :data:`DECOMPOSITION_LADDER` failed (raised, returned NaN/Inf or ran out of time)."""


class DecompositionWarning(RuntimeWarning):
    """A decomposition fell back to the next rung of the ladder, or a basis was kept."""


def _native_svd(G: Array, xp: Namespace) -> tuple[Array, Array, Array]:
    """Rung 1, the reference: the backend's own thin SVD in the input dtype."""
    return xp.linalg.svd(G, full_matrices=False)  # type: ignore[no-any-return]


def _host_svd(driver: str) -> Callable[[Array, Namespace], tuple[Array, Array, Array]]:
    """A rung computing the thin SVD on the host in float64 with scipy's LAPACK ``driver``, cast back."""

    def rung(G: Array, xp: Namespace) -> tuple[Array, Array, Array]:
        import scipy.linalg

        host = to_numpy(G).astype(np.float64)
        U, S, Vh = scipy.linalg.svd(host, full_matrices=False, lapack_driver=driver, check_finite=False)
        device = creation_device(G)
        return tuple(xp.asarray(a, dtype=G.dtype, device=device) for a in (U, S, Vh))  # type: ignore[return-value]

    rung.__name__ = f"float64-{driver}"
    return rung


DECOMPOSITION_LADDER: list[tuple[str, Callable[[Array, Namespace], tuple[Array, Array, Array]]]] = [
    ("native", _native_svd),
    ("float64-gesdd", _host_svd("gesdd")),
    ("float64-gesvd", _host_svd("gesvd")),
]
"""The thin-SVD attempts, in order (``docs/reliability.md``).

1. ``native``: the backend's SVD in the input dtype (the reference; the only
   rung that runs when nothing fails, so results are those of the plain call);
2. ``float64-gesdd``: scipy's divide-and-conquer driver on a float64 host copy;
3. ``float64-gesvd``: scipy's QR-iteration driver (slower, converges where
   ``gesdd`` does not).

A rung fails when it raises, returns NaN/Inf, or exceeds
:func:`decomposition_budget`; each fallback warns (:class:`DecompositionWarning`)
naming the matrix and the rung.  When all fail, :class:`DecompositionError`.
:func:`~adadiag_ref.refresh_basis` adds the last rung: keep the previous basis.
"""

_BUDGET_S: float | None = None  # set only through set_decomposition_budget (never from the environment)


def decomposition_budget() -> float | None:
    """Seconds one rung may take before the next is tried (``None``: no limit, the default)."""
    return _BUDGET_S


def set_decomposition_budget(seconds: float | None) -> float | None:
    """Set the per-rung time budget (``None`` turns it off); returns the previous one.

    With a budget each rung runs in a daemon worker thread and the caller waits
    at most ``seconds``; a rung over budget is abandoned (its thread finishes in
    the background, its result is discarded) and the next rung runs.
    """
    global _BUDGET_S
    if seconds is not None and not (isinstance(seconds, int | float) and 0 < seconds < float("inf")):
        raise ValueError(
            f"the decomposition budget must be a positive finite number of seconds or None, got {seconds!r}"
        )
    previous, _BUDGET_S = _BUDGET_S, None if seconds is None else float(seconds)
    return previous


def _call_with_budget(fn: Callable[[], Any], budget: float | None) -> Any:
    """``fn()``, or ``TimeoutError`` when it has not returned within ``budget`` seconds."""
    if budget is None:
        return fn()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=target, name="adadiag-ref-svd", daemon=True)
    worker.start()
    worker.join(budget)
    if worker.is_alive():
        raise TimeoutError(f"no result within the budget of {budget:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _thin_svd(G: Array, where: str, xp: Namespace) -> tuple[Array, Array, Array]:
    """``U, S, Vh`` from the first rung of :data:`DECOMPOSITION_LADDER` that succeeds."""
    failures: list[str] = []
    for index, (name, rung) in enumerate(DECOMPOSITION_LADDER):
        try:
            U, S, Vh = _call_with_budget(lambda rung=rung: rung(G, xp), _BUDGET_S)  # type: ignore[misc]
            if any(count_nonfinite(a, xp) for a in (U, S, Vh)):
                raise np.linalg.LinAlgError("the result contains NaN or Inf")
        except (np.linalg.LinAlgError, TimeoutError, RuntimeError, ValueError, MemoryError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            failures.append(f"{name} ({reason})")
            if index + 1 < len(DECOMPOSITION_LADDER):
                warn_at_caller(
                    f"SVD of the {where} failed with {name} ({reason}); "
                    f"retrying with {DECOMPOSITION_LADDER[index + 1][0]}",
                    DecompositionWarning,
                )
            continue
        return U, S, Vh
    raise DecompositionError(f"SVD of the {where} failed on every rung: " + "; ".join(failures))


# ----------------------------------------------------------------------------- fast one-sided refresh

REFRESH_METHODS = BASIS_METHODS
"""The routes of :func:`canonical_svd` (``method=``), chosen per optimizer by ``make_config(basis_method=...)``."""


def _check_method(method: str) -> None:
    """``ValueError`` unless ``method`` is one of :data:`REFRESH_METHODS`."""
    if method not in REFRESH_METHODS:
        raise ValueError(f"method must be one of {REFRESH_METHODS}, got {method!r}")


def gram_route_applies(G: Array, method: str, *, compute_q: bool, xp: Namespace | None = None) -> bool:
    """Whether :func:`canonical_svd` computes ``P`` by the Gram route for ``method`` (else the SVD).

    ``"svd"``: never.  ``"gram"`` and ``"auto"``: for a float32 one-sided refresh
    (``Q`` not requested).  Float64 input (the golden mode) always takes the SVD:
    the Gram route squares the condition number, so it is not exact to the golden
    tolerance there.  ``"auto"`` also keeps the SVD on JAX, where float64 (needed
    to form the Gram matrix) may be disabled, and for ``m > n`` (an ``m x m``
    eigenproblem for rank ``n``).  In the optimizer's work frame (``m <= n``) the
    Gram route is the faster one at every measured size (``docs/performance.md``).  A namespace without
    ``linalg.eigh`` (dask) takes the SVD.
    """
    _check_method(method)
    xp = namespace(G, xp=xp)
    if method == "svd" or compute_q or G.dtype != xp.float32 or not hasattr(getattr(xp, "linalg", None), "eigh"):
        return False
    return not (method == "auto" and ("jax" in getattr(xp, "__name__", "") or G.shape[0] > G.shape[1]))


def _gram_route(G: Array, m: int, n: int, compute_p: bool, *, xp: Namespace) -> CanonicalSVD | None:
    """``P`` from the eigenvectors of the float64 Gram matrix ``A = G G^T`` (``m x m``), float32 input.

    ``A = P diag(sigma^2) P^T``: the eigenvectors (eigenvalues ascending, so
    reversed) are the left singular vectors and ``sigma = sqrt(max(lambda, 0))``.
    The result goes through :func:`canonicalize_svd` with the input's dtype, so
    the order, rank, cluster, completion and sign rules are those of the SVD
    route (computed with ``fast=True``: wide clusters and the completion by the
    pivoted Cholesky factorisation of their projector, :func:`_projector_columns`).
    Accuracy: forming ``A`` in float64 resolves singular values down to
    ``sqrt(eps64) sigma_max ~ 1.5e-8 sigma_max``, below the float32 rank tolerance
    ``max(m, n) eps32 sigma_max``, and each vector is accurate to
    ``~eps64 sigma_max^2 / gap(sigma^2)``, better than float32's own SVD, whose
    vectors carry ``~eps32 sigma_max / gap(sigma)``.  The two routes agree on the
    leading half of the spectrum to 1e-3 (``tests/test_fast_refresh.py``); they
    can differ by O(1) on a cluster of singular values whose boundary gap lies
    within rounding of the cluster tolerance, where the float64 Gram route follows
    the exact singular values more closely than the float32 SVD.

    Returns ``None`` (the caller takes the SVD) when the backend cannot form a
    float64 Gram matrix or ``eigh`` fails or returns NaN/Inf.  The Gram matrix and
    ``eigh`` run on ``G``'s backend; on a device the eigenvectors stay there
    (:func:`_gram_factors`, :func:`_canonical_stack`: only the ``m`` singular values come to the host).
    """
    G64 = xp.astype(G, xp.float64)
    if G64.dtype != xp.float64:  # pragma: no cover - a backend without float64 (JAX with x64 off)
        return None
    gram = G64 @ xp.matrix_transpose(G64)
    try:
        lam, vecs = xp.linalg.eigh(gram)
    except np.linalg.LinAlgError:
        return None  # the SVD ladder decides
    if is_numpy_namespace(xp):
        return _gram_canonical(lam, vecs, m, n, compute_p)
    U, S = _gram_factors(xp.expand_dims(lam, axis=0), xp.expand_dims(vecs, axis=0), m, n, xp)
    (result,) = _canonical_stack(U, S, None, (m, n), compute_p=compute_p, compute_q=False, fast=True, xp=xp)
    return result


def _gram_canonical(lam: np.ndarray, vecs: np.ndarray, m: int, n: int, compute_p: bool) -> CanonicalSVD | None:
    """:func:`_gram_route` on NumPy: ``eigh``'s ascending ``lambda, V`` of ``G G^T`` to the canonical
    float32 ``P`` (``sigma = sqrt(max(lambda, 0))``, descending); ``None`` when they hold NaN or Inf.
    :func:`_gram_factors` is the same map on a device stack."""
    if not (bool(np.all(np.isfinite(lam))) and bool(np.all(np.isfinite(vecs)))):
        return None
    sigma = np.sqrt(np.clip(lam[::-1].copy(), 0.0, None))
    k = min(m, n)
    U = np.take(vecs, np.arange(m - 1, m - 1 - k, -1), axis=1).astype(np.float32)  # the route's input dtype
    S = sigma[:k].astype(np.float32)
    return canonicalize_svd(U, S, None, (m, n), compute_p=compute_p, compute_q=False, fast=True)


# ----------------------------------------------------------------------------- a batch of refreshes


def canonical_svd_batch(
    matrices: list[Array],
    /,
    *,
    compute_p: bool = True,
    compute_q: bool = True,
    method: str = "svd",
    xp: Namespace | None = None,
) -> list[CanonicalSVD | None]:
    """:func:`canonical_svd` of several matrices of one shape and dtype, with one decomposition call for all.

    On a device backend (CuPy, CUDA torch) a refresh is a handful of launches and host reads per matrix, and
    the decomposition libraries take stacks (cuSOLVER's batched ``syevj``/``gesvdj``, ``torch.linalg.eigh``):
    here the matrices are stacked once, their finiteness is read back once, the route's decomposition runs
    once over the stack (``eigh`` of the float64 Gram stack ``G_i G_i^T`` where :func:`gram_route_applies`,
    else the thin ``svd``), and the canonical rules run on the stack on the device (:func:`_canonical_stack`):
    the singular values come to the host in one copy (with the factors' finiteness), the signs and the bases
    of every plain matrix are computed at once on the device (entry ``i`` of the result holds views into
    those stacks), and the host rules run only on the columns of the clusters and completions, one copy
    each way per round for the whole stack.  The same rules on the same kind of factors, so the same bases
    as :func:`canonical_svd` of each matrix to rounding (bit for bit where the backend's stacked
    decomposition computes each matrix as its single one does, as NumPy's does).

    Entry ``i`` is ``None`` where the batch does not decide and :func:`canonical_svd` of matrix ``i`` must run
    (which then raises or falls back with its messages): the matrix holds NaN or Inf, or the stacked
    decomposition raised or returned NaN or Inf.  NumPy input, a single matrix and a set decomposition budget
    (:func:`set_decomposition_budget`, which times single calls) get ``None`` everywhere: a stack saves nothing
    on the host.
    """
    _check_method(method)
    if not matrices:
        return []
    xp = namespace(*matrices, xp=xp)
    shape, dtype = tuple(matrices[0].shape), matrices[0].dtype
    if any(tuple(G.shape) != shape or G.dtype != dtype for G in matrices):
        raise ValueError("canonical_svd_batch needs matrices of one shape and one dtype")
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"canonical_svd_batch expects non-empty matrices, got shape {shape}")
    undecided: list[CanonicalSVD | None] = [None] * len(matrices)
    if is_numpy_namespace(xp) or len(matrices) < 2 or _BUDGET_S is not None:
        return undecided
    m, n = shape
    stack = xp.stack(matrices)
    finite = to_numpy(xp.all(xp.isfinite(stack), axis=(1, 2)))  # the one read-back of the checks
    members = [i for i in range(len(matrices)) if finite[i]]
    if len(members) < len(matrices):
        stack = xp.stack([matrices[i] for i in members]) if members else None
    if stack is None:
        return undecided
    for i, result in zip(members, _decide_stack(stack, m, n, compute_p, compute_q, method, xp), strict=True):
        undecided[i] = result
    return undecided


def _decide_stack(
    stack: Array, m: int, n: int, compute_p: bool, compute_q: bool, method: str, xp: Namespace
) -> list[CanonicalSVD | None]:
    """The canonical SVD of every matrix of a finite device stack from one stacked decomposition of its backend,
    canonicalised on the device (:func:`_canonical_stack`); ``None`` for the whole stack when the decomposition
    raised, for one matrix when its factors hold NaN or Inf."""
    count = int(stack.shape[0])
    if gram_route_applies(stack[0, ...], method, compute_q=compute_q, xp=xp):
        G64 = xp.astype(stack, xp.float64)
        if G64.dtype == xp.float64:
            try:
                lam, vecs = xp.linalg.eigh(G64 @ xp.matrix_transpose(G64))
            except (np.linalg.LinAlgError, RuntimeError, ValueError):
                return [None] * count
            U, S = _gram_factors(lam, vecs, m, n, xp)
            return _canonical_stack(U, S, None, (m, n), compute_p=compute_p, compute_q=False, fast=True, xp=xp)
    try:
        U, S, Vh = xp.linalg.svd(stack, full_matrices=False)
    except (np.linalg.LinAlgError, RuntimeError, ValueError):
        return [None] * count
    finite = xp.all(xp.isfinite(U), axis=(-2, -1)) & xp.all(xp.isfinite(S), axis=-1)
    if compute_q:
        finite = finite & xp.all(xp.isfinite(Vh), axis=(-2, -1))
    return _canonical_stack(U, _nan_unless(finite, S, xp), Vh if compute_q else None, (m, n), compute_p=compute_p,
                            compute_q=compute_q, fast=method != "svd", xp=xp)  # fmt: skip
