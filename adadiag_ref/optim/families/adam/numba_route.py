"""The Adam family's numba route (NumPy, float32/float64): its kernels, and the routes of every entry point.

The same formulas, in the same order, as :mod:`.reference` (``M_t = b1 M + (1 - b1) G~``,
``V_t = b2 V + (1 - b2) G~^2``, ``U~ = M_t / (sqrt(V_t) + eps)``), written once as :func:`_adam_entry` and
used by every kernel below; the update's tail ``delta = (-eta)(U + lambda W)`` is the shared
:func:`adadiag_ref._kernels.delta_entry`.  The routes:

* :func:`direction`: the functional direction (``M_t, V_t, U~`` in one pass, new arrays), for ``update`` of
  every configuration the routes below decline;
* :func:`update`: the whole functional update.  No rotation (AdamW, and any parameter whose bases are absent):
  one pass reads ``G, W, M_{t-1}, V_{t-1}`` and writes ``M_t, V_t`` and ``delta``: three new arrays (the
  reference makes four to six, in three to five passes).  With rotation: ``G~ = P^T G Q`` (BLAS), one pass
  writing ``M_t``, ``V_t`` and ``U~`` (into ``G~``'s buffer, which the call owns), ``P U~ Q^T`` (BLAS) and one
  pass scaling it in place into ``delta``.  Nothing passed in is modified;

Only the engine runs them (:class:`adadiag_ref.Engine`).  Bit-identical to the reference
(``tests/test_fused.py`` compares with ``array_equal``), except :func:`direction`, whose results agree to
rounding with it (``tests/test_kernels.py``).
Arrays of at least :data:`~adadiag_ref._kernels.PARALLEL_MIN_SIZE` entries are processed by numba's thread pool
between the BLAS calls when numba's threading layer is ``workqueue`` (``NUMBA_THREADING_LAYER=workqueue``;
``adadiag-ref bench`` sets it), whose idle threads do not spin next to OpenBLAS's; otherwise serially.
Elementwise work, so the result does not depend on the thread count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .... import _kernels, buffers
from ...._kernels import (
    _inline,
    _jit,
    _serial_and_parallel,
    alike,
    delta_entry,
    ema_coefficients,
    ema_entry,
    flat,
    prange,
    rows_in_memory_order,
    scalar,
)
from ...._xp import Array, Namespace
from ....config import BaseConfig
from ...schedules import beta_hats
from ..common import Moments
from .reference import AdamState

__all__ = ["adam_direction", "direction", "kernel_scalars", "update"]

# ----------------------------------------------------------------------------- kernels


@_inline
def _adam_entry(m0, v0, x, b1, c1, b2, c2, eps):  # type: ignore[no-untyped-def]
    """One entry of the Adam direction: ``m = b1 m0 + c1 x``, ``v = b2 v0 + c2 x^2``, ``u = m / (sqrt(v) + eps)``.

    The one place the kernels write the formula (same operations, same order as the family function); the root is
    the correctly rounded one (LLVM's ``sqrt``), the library's root (:func:`adadiag_ref._xp.sqrt`)."""
    m = ema_entry(m0, x, b1, c1)
    v = b2 * v0 + c2 * (x * x)
    return m, v, m / (math.sqrt(v) + eps)


def adam_direction(M0: np.ndarray, V0: np.ndarray, g: np.ndarray, b1_t: Any, b2_t: Any, eps: float) -> tuple:
    """``M = b1 M0 + (1 - b1) G~``, ``V = b2 V0 + (1 - b2) G~^2``, ``U = M / (sqrt(V) + eps)`` in one pass.

    The outputs keep ``G~``'s memory order (like the state, which keeps the parameter's).  Inputs alike in memory
    (:func:`~adadiag_ref._kernels.alike`: the engine's flat groups, handed over as one ``1 x N`` row) take one
    flat pass into pooled outputs, on numba's pool from :data:`~adadiag_ref._kernels.PARALLEL_MIN_SIZE` entries
    (a row kernel over one row runs serially: 242 -> 51 ms for LLaMA-60M's 58 M entries); others the row kernel."""
    dt = g.dtype
    if alike(g, M0, V0):
        M, V, U = buffers.empty_like(g), buffers.empty_like(g), buffers.empty_like(g)
        parallel = g.size >= _kernels.PARALLEL_MIN_SIZE and _kernels.pool_does_not_spin()
        kernel = adam_direction_flat_parallel if parallel else adam_direction_flat
        kernel(flat(M0), flat(V0), flat(g), *ema_coefficients(b1_t, b2_t, dt), scalar(eps, dt), flat(M), flat(V),
               flat(U))  # fmt: skip
        return M, V, U
    M, V, U = np.empty_like(g), np.empty_like(g), np.empty_like(g)
    M0, V0, g_rows, M_rows, V_rows, U_rows = rows_in_memory_order(M0, V0, g, M, V, U)
    adam_moments_inplace(M0, V0, g_rows, *ema_coefficients(b1_t, b2_t, dt), scalar(eps, dt), M_rows, V_rows, U_rows)
    return M, V, U


def _adam_moments_rows(M0, V0, g, b1, c1, b2, c2, eps, M, V, out):  # type: ignore[no-untyped-def]
    """``M = b1 M0 + c1 G~``, ``V = b2 V0 + c2 G~^2``, ``out = M / (sqrt(V) + eps)`` in one pass.

    Every entry is read before it is written, so ``M`` may alias ``M0``, ``V`` alias
    ``V0`` (in place) and ``out`` alias ``g``.
    """
    m, n = g.shape
    for i in prange(m):
        for j in range(n):
            M[i, j], V[i, j], out[i, j] = _adam_entry(M0[i, j], V0[i, j], g[i, j], b1, c1, b2, c2, eps)


def _adam_direction_flat(M0, V0, g, b1, c1, b2, c2, eps, M, V, U):  # type: ignore[no-untyped-def]
    """Flat views: ``M = b1 M0 + c1 G~``, ``V = b2 V0 + c2 G~^2``, ``U = M / (sqrt(V) + eps)`` (new arrays)."""
    for k in prange(g.shape[0]):
        M[k], V[k], U[k] = _adam_entry(M0[k], V0[k], g[k], b1, c1, b2, c2, eps)


def _adam_moments_over_flat(M0, V0, GU, b1, c1, b2, c2, eps, M, V):  # type: ignore[no-untyped-def]
    """Flat views: ``M = b1 M0 + c1 G~``, ``V = b2 V0 + c2 G~^2`` into new arrays, and ``U = M / (sqrt(V) + eps)``
    over ``G~`` itself (``GU`` is read, then overwritten).

    One argument for ``G~`` and ``U``, not two aliased ones: with two pointers to the same memory LLVM's runtime
    overlap check fails and the loop runs unvectorised (several times slower)."""
    for k in prange(GU.shape[0]):
        M[k], V[k], GU[k] = _adam_entry(M0[k], V0[k], GU[k], b1, c1, b2, c2, eps)


def _adam_moments_own_flat(M, V, GU, b1, c1, b2, c2, eps):  # type: ignore[no-untyped-def]
    """In place on flat views (the group kernels): ``M <- b1 M + c1 G~``, ``V <- b2 V + c2 G~^2``,
    ``GU <- M / (sqrt(V) + eps)``; each array is one argument (no aliased pointers, see above)."""
    for k in prange(GU.shape[0]):
        M[k], V[k], GU[k] = _adam_entry(M[k], V[k], GU[k], b1, c1, b2, c2, eps)


def _adam_delta_flat(M0, V0, g, w, b1, c1, b2, c2, eps, neg_lr, wd, decay, M, V, D):  # type: ignore[no-untyped-def]
    """The whole unrotated Adam update in one pass over flat views: ``M``, ``V`` and
    ``D = (-eta) (U + lambda W)`` (:func:`delta_entry`)."""
    for k in prange(g.shape[0]):
        M[k], V[k], u = _adam_entry(M0[k], V0[k], g[k], b1, c1, b2, c2, eps)
        D[k] = delta_entry(u, w[k], neg_lr, wd, decay)


@_inline
def _adam_step_span(W, g, M, V, b1, c1, b2, c2, eps, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """One span of the unrotated Adam step in place: ``M, V <- M_t, V_t`` and ``W <- W + (-eta)(U + lambda W)``
    (:func:`_adam_entry`, :func:`delta_entry`).  Every array is indexed alike from 0, so that LLVM vectorises the
    loop (an offset index into flat moments did not, and the square roots and divisions then ran one at a time:
    4x slower)."""
    for k in range(g.shape[0]):
        w = W[k]
        m, v, u = _adam_entry(M[k], V[k], g[k], b1, c1, b2, c2, eps)
        M[k] = m
        V[k] = v
        W[k] = w + delta_entry(u, w, neg_lr, wd, decay)


adam_moments_inplace, adam_moments_inplace_parallel = _serial_and_parallel(_adam_moments_rows)
adam_direction_flat, adam_direction_flat_parallel = _serial_and_parallel(_adam_direction_flat)


adam_moments_over_flat, adam_moments_over_flat_parallel = _serial_and_parallel(_adam_moments_over_flat)


adam_moments_own_flat = _jit(_adam_moments_own_flat)  # serial: group_route's engine_moments cuts the rows


adam_delta_flat, adam_delta_flat_parallel = _serial_and_parallel(_adam_delta_flat)


# ----------------------------------------------------------------------------- routes


def direction(state: Any, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments] | None:
    """``(U~, {"M": M_t, "V": V_t})`` of the reference direction by :func:`adam_direction`; ``None`` unless
    ``cfg.kernels`` selects numba and the arrays are NumPy float32/float64 of one dtype."""
    if not _kernels.selected(cfg, xp, g, state.M, state.V):
        return None
    b1_t, b2_t = beta_hats(cfg, t, xp)
    M, V, U = adam_direction(state.M, state.V, g, b1_t, b2_t, cfg.eps)
    return U, {"M": M, "V": V}


class _Scalars(NamedTuple):
    """The step's scalars in the state dtype, as the generic code rounds them, and the route's choices."""

    b1: Any
    c1: Any
    b2: Any
    c2: Any
    eps: Any
    neg_lr: Any
    wd: Any
    decay: bool
    parallel: bool
    rotated: bool


def _applies(
    state: AdamState, t: Array, g_rot: Array, w: Array, cfg: BaseConfig, lr: Any, xp: Namespace
) -> _Scalars | None:
    """The fused route's scalars, or ``None`` when it does not apply (see the module docstring)."""
    if not _kernels.is_host_number(lr):
        return None
    M0, V0 = state.M, state.V  # type: ignore[union-attr]
    if M0 is None or not _kernels.selected(cfg, xp, g_rot, M0, V0, w):
        return None
    rotated = state.P is not None or state.Q is not None
    if not alike(g_rot, M0, V0, *(() if rotated else (w,))):
        return None
    b1_t, b2_t = beta_hats(cfg, t, xp)
    parallel = g_rot.size >= _kernels.PARALLEL_MIN_SIZE and _kernels.pool_does_not_spin()
    return _Scalars(*kernel_scalars(b1_t, b2_t, cfg, lr, g_rot.dtype), parallel, rotated)


def kernel_scalars(
    b1_t: Any, b2_t: Any, cfg: BaseConfig, lr: Any, dtype: Any
) -> tuple[Any, Any, Any, Any, Any, Any, Any, bool]:
    """``(b1, 1 - b1, b2, 1 - b2, eps, -eta, lambda, decay)`` for the Adam kernels, rounded as the generic code
    rounds them: ``b * old + (1 - b) * new`` with ``1 - b`` in the state dtype, and the Python numbers eps,
    lambda and -eta entering its array arithmetic in the state dtype (NumPy's weak scalars); ``decay`` is
    ``lambda != 0``.  ``b1_t``, ``b2_t`` are the step's beta-hats (:func:`~adadiag_ref.optim.schedules.beta_hat`)."""
    b1, c1, b2, c2 = ema_coefficients(b1_t, b2_t, dtype)
    eps, neg_lr, wd = (scalar(x, dtype) for x in (cfg.eps, -lr, cfg.weight_decay))
    return b1, c1, b2, c2, eps, neg_lr, wd, bool(cfg.weight_decay)


def update(
    state: AdamState,
    layout: Any,
    t: Array,
    g_rot: Array,
    w: Array,
    cfg: BaseConfig,
    lr: Any,
    unrotate: Callable[..., Array],
    xp: Namespace,
) -> tuple[Array, dict[str, Array]] | None:
    """``(delta, {"M": M_t, "V": V_t})`` of ``update`` for the Adam family, or ``None`` when the route does not apply.

    ``delta = -eta_t (P U~ Q^T + lambda W_t)`` is returned in the work frame and the state dtype (the caller
    applies ``from_work`` and the parameter's dtype, as for the generic code).

    ``g_rot`` is ``G~`` as ``prepare_step`` made it (set to its structure on a refresh step): a new
    array whenever a basis exists, which this call then reuses for ``U~``.
    ``unrotate`` is the core's ``P U~ Q^T`` (passed in, so both routes share one
    implementation of the rotation).
    """
    sc = _applies(state, t, g_rot, w, cfg, lr, xp)
    if sc is None:
        return None
    M0, V0 = state.M, state.V  # type: ignore[union-attr]
    assert M0 is not None and V0 is not None  # _applies checked
    M = buffers.empty_like(g_rot)  # resident pages from the pool, not fresh ones (adadiag_ref.buffers)
    V = buffers.empty_like(g_rot)
    if not sc.rotated:
        D = buffers.empty_like(g_rot)
        kernel = adam_delta_flat_parallel if sc.parallel else adam_delta_flat
        kernel(flat(M0), flat(V0), flat(g_rot), flat(w), sc.b1, sc.c1, sc.b2, sc.c2, sc.eps, sc.neg_lr, sc.wd,
               sc.decay, flat(M), flat(V), flat(D))  # fmt: skip
    else:
        moments = adam_moments_over_flat_parallel if sc.parallel else adam_moments_over_flat
        moments(flat(M0), flat(V0), flat(g_rot), sc.b1, sc.c1, sc.b2, sc.c2, sc.eps, flat(M), flat(V))
        D = unrotate(g_rot, state.P, state.Q, xp, transposed=layout.transposed)
        if type(D) is np.ndarray and D.dtype == g_rot.dtype and alike(D, w):
            scale = _kernels.scale_direction_flat_parallel if sc.parallel else _kernels.scale_direction_flat
            scale(flat(D), flat(w), sc.neg_lr, sc.wd, sc.decay)
        else:  # pragma: no cover - BLAS outputs are contiguous; the generic expressions otherwise
            if sc.decay:
                D = D + cfg.weight_decay * w
            D = -lr * D
    return D, {"M": M, "V": V}
