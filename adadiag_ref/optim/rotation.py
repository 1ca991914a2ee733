"""The rotation layer shared by the discrete updates and their continuous-time forms.

Every optimizer works on the rotated gradient ``G~ = P^T G Q`` and returns a
rotated direction ``U~``; only this layer knows the bases.  The discrete update
(:func:`adadiag_ref.optim.core.update`) applies ``W_{t+1} = W_t - eta_t (P U~ Q^T + lambda W_t)``,
the continuous form (:mod:`adadiag_ref.ode`) ``W' = -P U~ Q^T - lambda W``
(:func:`parameter_velocity`).  A missing basis (``None``) is the identity.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import buffers
from .._xp import Array, Namespace

__all__ = ["Basis", "parameter_velocity", "rotate", "unrotate"]


def _product(a: Array, b: Array, out: Array | None = None) -> Array:
    """``a @ b``; for NumPy matrices written into a pooled output (:func:`adadiag_ref.buffers.matmul`: the same BLAS
    call, so the same bits, without a fresh allocation per step).  A NumPy stack (``batch_dims > 0``, operands
    ``(*B, k, l)`` of equal ``B``) is one BLAS call per matrix: ``np.matmul`` over a stack of transposed views
    (a tall parameter's work frame) takes NumPy's loop without BLAS, 20x slower.  ``out`` (NumPy, C-contiguous,
    or a CPU torch matrix, of the product's shape and dtype): written there instead, the same BLAS calls (the
    engine's flat buffers); ignored by other backends (the caller copies)."""
    if type(a) is np.ndarray and type(b) is np.ndarray:
        if a.ndim == 2 and b.ndim == 2:
            return buffers.matmul(a, b) if out is None else np.matmul(a, b, out=out)
        if a.ndim == b.ndim and a.shape[:-2] == b.shape[:-2]:
            if out is None:
                out = np.empty((*a.shape[:-1], b.shape[-1]), dtype=np.result_type(a, b))
            for index in np.ndindex(*a.shape[:-2]):
                np.matmul(a[index], b[index], out=out[index])
            return out
    if out is not None and a.ndim == 2 and b.ndim == 2 and getattr(out, "is_cpu", False):
        import torch  # out is a torch tensor: torch is imported

        return torch.mm(a, b, out=out)  # a @ b of 2-D operands is mm: the same call, into out
    return a @ b


class Basis(NamedTuple):
    """The bases in force: ``P`` (``m x m``) and ``Q`` (``n x n``); ``None`` means identity."""

    P: Array | None
    Q: Array | None


def rotate(g: Array, P: Array | None, Q: Array | None, xp: Namespace, *, transposed: bool = False) -> Array:
    """``G~ = P^T G Q`` (a missing basis is the identity).

    ``transposed`` says that ``g`` is the transposed view of a tall parameter
    (:func:`~adadiag_ref.optim.layout.to_work`); the product is then formed as
    ``(Q^T G^T P)^T`` so that ``G~`` keeps the parameter's memory order, like the
    state's matrices (:func:`~adadiag_ref.optim.core.init`), and no elementwise operation mixes orders.
    """
    if P is None and Q is None:
        return g
    if transposed:
        gt = xp.matrix_transpose(g)
        if P is not None:
            gt = _product(gt, P)
        if Q is not None:
            gt = _product(xp.matrix_transpose(Q), gt)
        return xp.matrix_transpose(gt)
    if P is not None:
        g = _product(xp.matrix_transpose(P), g)
    if Q is not None:
        g = _product(g, Q)
    return g


def unrotate(u: Array, P: Array | None, Q: Array | None, xp: Namespace, *, transposed: bool = False) -> Array:
    """``P U~ Q^T``, the inverse of :func:`rotate` for orthogonal ``P`` and ``Q`` (``transposed`` as there).

    For any ``P`` and ``Q`` it is the adjoint of :func:`rotate`: ``<G, P X Q^T> = <P^T G Q, X>``.
    """
    if P is None and Q is None:
        return u
    if transposed:
        ut = xp.matrix_transpose(u)
        if P is not None:
            ut = _product(ut, xp.matrix_transpose(P))
        if Q is not None:
            ut = _product(Q, ut)
        return xp.matrix_transpose(ut)
    if P is not None:
        u = _product(P, u)
    if Q is not None:
        u = _product(u, xp.matrix_transpose(Q))
    return u


def parameter_velocity(u_rot: Array, W: Array, basis: Basis, weight_decay: float, xp: Namespace) -> Array:
    """``W' = -P U~ Q^T - lambda W``: the continuous form of the update ``-eta_t (P U~ Q^T + lambda W_t)``."""
    velocity = -unrotate(u_rot, basis.P, basis.Q, xp)
    return velocity - weight_decay * W if weight_decay else velocity
