"""The Adam family's group kernels: the entrywise part of a step of *many* CPU tensors in one numba call each.

The torch adapter's default CPU route (:mod:`adadiag_ref.adapters.pytorch`) steps every parameter of a group
(one dtype, one step ``t``, no refresh due) with four kernel calls and one ``torch.sqrt`` in all, whatever the
number of parameters: the kernels receive the addresses of the parameters', gradients' and moments' memory
(``Tensor.data_ptr()``) and their sizes, and walk them one after the other.  The arithmetic is the torch CPU
route's (:mod:`.torch_route`), entry for entry: the same formulas (:func:`~.numba_route._second_moment_entry`,
:func:`~adadiag_ref._kernels.ema_entry`, :func:`~adadiag_ref._kernels.delta_entry`), the same coefficients,
``sqrt(V_t)`` by ``torch.sqrt`` over one flat scratch; so the results are those of ``update_in_place`` bit for
bit (``tests/test_adapter_torch.py`` compares them with the core's ``ar.step``).

The callers guarantee what the kernels cannot check: every address is that of a dense tensor of the scratch's
dtype, with ``sizes[i]`` entries, and all arrays of one parameter lie in one memory order (the work frame's
strides alike, :func:`adadiag_ref._kernels.alike`).

* :func:`second_moment`: ``V_t = b2 V + c2 X^2`` into the flat scratch (``X = G~``, ``G`` itself without a
  basis) and the number of NaN or Inf entries of each gradient ``G`` (the step's finiteness check, read from
  host memory: no pass of its own);
* :func:`apply_unrotated`: ``M <- b1 M + c1 G``, ``V <- V_t``, ``W <- W + (-eta) (M_t / (sqrt(V_t) + eps)
  [+ lambda W])`` in place (the torch route's ``_adam_apply_root_flat``);
* :func:`direction_rotated`: ``M_t`` into the scratch holding ``sqrt(V_t)`` and ``U~ = M_t / (sqrt(V_t) + eps)``
  over ``G~`` (this step's own GEMM output); nothing of the state written;
* :func:`read_counters`, :func:`advance_counters`: the int32 host step counters read and advanced in place (one
  call each instead of a stack and a ``torch._foreach_add_`` over 0-d tensors, 0.2 ms for 75 of them);
* :func:`apply_rotated`: after the caller's GEMMs ``D = P U~ Q^T``: ``W <- W + (-eta) (D + lambda W)``,
  ``M <- M_t``, ``V <- V_t``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .... import _kernels
from ...._kernels import delta_entry, ema_entry
from .numba_route import _second_moment_entry

__all__ = [
    "AVAILABLE",
    "addresses",
    "advance_counters",
    "apply_rotated",
    "apply_unrotated",
    "direction_rotated",
    "read_counters",
    "second_moment",
]

AVAILABLE = _kernels.AVAILABLE

_array: Any = None
"""``_array(address, size, like)``: the ``size`` entries at ``address`` as a 1-D array of ``like``'s dtype."""

if AVAILABLE:
    import numba
    from numba import types
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[misc]
    def _pointer(typingctx: Any, address: Any, like: Any) -> Any:
        """The address ``address`` (an int64) as a pointer to ``like``'s dtype (``numba.carray`` reads it)."""
        pointer = types.CPointer(like.dtype)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(pointer))

        return pointer(address, like), codegen

    def _carray(address: Any, size: Any, like: Any) -> Any:
        return numba.carray(_pointer(address, like), size)  # type: ignore[call-arg]

    _array = numba.njit(inline="always")(_carray)


def _second_moment(g_at, x_at, v_at, sizes, offsets, b2, c2, vt, bad):  # type: ignore[no-untyped-def]
    for i in range(sizes.shape[0]):
        n, o = sizes[i], offsets[i]
        g = _array(g_at[i], n, vt)
        count = 0
        for k in range(n):
            count += not np.isfinite(g[k])
        bad[i] = count
        x = _array(x_at[i], n, vt)
        v = _array(v_at[i], n, vt)
        for k in range(n):
            vt[o + k] = _second_moment_entry(v[k], x[k], b2, c2)


def _apply_unrotated(w_at, g_at, m_at, v_at, sizes, offsets, b1, c1, eps, neg_lr, wd, decay, vt, root):  # type: ignore[no-untyped-def]
    for i in range(sizes.shape[0]):
        n, o = sizes[i], offsets[i]
        W = _array(w_at[i], n, vt)
        g = _array(g_at[i], n, vt)
        M = _array(m_at[i], n, vt)
        V = _array(v_at[i], n, vt)
        for k in range(n):
            w = W[k]
            m = ema_entry(M[k], g[k], b1, c1)
            M[k] = m
            V[k] = vt[o + k]
            W[k] = w + delta_entry(m / (root[o + k] + eps), w, neg_lr, wd, decay)


def _direction_rotated(m_at, gu_at, sizes, offsets, b1, c1, eps, mr):  # type: ignore[no-untyped-def]
    for i in range(sizes.shape[0]):
        n, o = sizes[i], offsets[i]
        M0 = _array(m_at[i], n, mr)
        GU = _array(gu_at[i], n, mr)
        for k in range(n):
            m = ema_entry(M0[k], GU[k], b1, c1)
            GU[k] = m / (mr[o + k] + eps)
            mr[o + k] = m


def _apply_rotated(w_at, d_at, m_at, v_at, sizes, offsets, neg_lr, wd, decay, mt, vt):  # type: ignore[no-untyped-def]
    for i in range(sizes.shape[0]):
        n, o = sizes[i], offsets[i]
        W = _array(w_at[i], n, vt)
        D = _array(d_at[i], n, vt)
        M = _array(m_at[i], n, vt)
        V = _array(v_at[i], n, vt)
        for k in range(n):
            w = W[k]
            W[k] = w + delta_entry(D[k], w, neg_lr, wd, decay)
            M[k] = mt[o + k]
            V[k] = vt[o + k]


def _read_counters(c_at, out):  # type: ignore[no-untyped-def]
    """``out[i]`` = the int32 counter at ``c_at[i]``; returns whether they are all equal."""
    same = True
    for i in range(c_at.shape[0]):
        out[i] = _array(c_at[i], 1, out)[0]
        same = same and out[i] == out[0]
    return same


def _advance_counters(c_at, like):  # type: ignore[no-untyped-def]
    """Each int32 counter at ``c_at[i]`` += 1 (torch's ``"step"`` tensors, written in host memory)."""
    for i in range(c_at.shape[0]):
        c = _array(c_at[i], 1, like)
        c[0] += 1


if AVAILABLE:
    read_counters = _kernels._jit(_read_counters)
    advance_counters = _kernels._jit(_advance_counters)
    second_moment = _kernels._jit(_second_moment)
    apply_unrotated = _kernels._jit(_apply_unrotated)
    direction_rotated = _kernels._jit(_direction_rotated)
    apply_rotated = _kernels._jit(_apply_rotated)
else:  # pragma: no cover
    second_moment = apply_unrotated = direction_rotated = apply_rotated = None
    read_counters = advance_counters = None


def addresses(tensors: list[Any]) -> np.ndarray:
    """The ``data_ptr()`` of each tensor, as the kernels' int64 address array."""
    return np.array([t.data_ptr() for t in tensors], dtype=np.int64)
