"""The Adam family's in-place route on any backend with mutable arrays (NumPy, CuPy, torch).

``update_in_place`` computes what ``update`` followed by ``W += delta`` computes, bit for bit, overwriting
``W``, ``M`` and ``V`` instead of returning new arrays: ``M_t, V_t, U~`` by the numba kernel where it applies
(:func:`.numba_route.moments_in_place`), else by the backend's own ufuncs with at most two new arrays
(:func:`moments_with_ufuncs`); then ``P U~ Q^T`` and the shared tail
(:func:`adadiag_ref.optim.tail.parameter_delta`) on this call's scratch.  Everything that can fail runs before
the first write; torch tensors adopt their scratch's storage (:func:`adadiag_ref.optim.tail.commit`).  On CuPy
arrays with ``kernels="auto"`` the fused kernels of :mod:`.cupy_route` run first; this route takes what they
decline (``kernels="reference"`` or ``"numba"``, a parameter of another dtype than the state).
"""

from __future__ import annotations

from typing import Any

from array_api_compat import is_torch_namespace

from ...._xp import Array, Namespace, native_module, sqrt
from ....config import BaseConfig
from ...rotation import unrotate
from ...schedules import beta_hats
from ...tail import commit, parameter_delta
from .numba_route import moments_in_place
from .reference import AdamState

__all__ = ["in_place", "moments_with_ufuncs"]


def moments_with_ufuncs(
    M: Array, V: Array, g_rot: Array, owned: bool, b1_t: Array, b2_t: Array, eps: float, xp: Namespace
) -> tuple[Array, Array, Array]:
    """``(M_t, V_t, U~)`` of the Adam direction with backend ufuncs, at most two new arrays (``owned``: ``G~``
    may be overwritten).  The functional EMA is ``b * old + (1 - b) * new``; IEEE addition and multiplication
    commute exactly, and the root is the library's (:func:`adadiag_ref._xp.sqrt`), so the results are the family
    function's bit for bit."""
    native = native_module(xp)
    new_V = native.multiply(V, b2_t)
    buf = g_rot * g_rot  # G~^2, later the scratch for b1 * M, sqrt(V) and U~
    buf *= 1.0 - b2_t
    new_V += buf
    if owned:
        new_M = g_rot
        new_M *= 1.0 - b1_t
    else:
        new_M = native.multiply(g_rot, 1.0 - b1_t)
    native.multiply(M, b1_t, out=buf)
    new_M += buf
    sqrt(new_V, xp, out=buf)
    buf += eps
    native.divide(new_M, buf, out=buf)  # U~ = M / (sqrt(V) + eps)
    return new_M, new_V, buf


def in_place(state: AdamState, step_in: Any, cfg: BaseConfig, param: Array, eta: Any, xp: Namespace) -> bool:
    """``W += delta`` and ``M``, ``V`` overwritten (module docstring); always applies (returns ``True``)."""
    layout, t, g, w, g_rot = step_in
    owned = g_rot is not g  # a fresh GEMM output may serve as scratch space
    b1_t, b2_t = beta_hats(cfg, t, xp)
    M, V = state.M, state.V
    found = moments_in_place(M, V, g_rot, owned, b1_t, b2_t, cfg, xp)
    if found is None:
        found = moments_with_ufuncs(M, V, g_rot, owned, b1_t, b2_t, cfg.eps, xp)
    new_M, new_V, buf = found
    direction = unrotate(buf, state.P, state.Q, xp, transposed=layout.transposed)
    delta = parameter_delta(direction, w, eta, cfg, layout, param.dtype, xp, owned=True)
    # commit: nothing below can fail on writable buffers of matching shape and dtype
    param += delta
    commit({"M": M, "V": V}, {"M": new_M, "V": new_V}, adopt=is_torch_namespace(xp))
    return True
