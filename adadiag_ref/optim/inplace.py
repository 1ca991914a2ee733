"""In-place application of one update, for frameworks that own mutable buffers.

:func:`update_in_place` computes exactly what ``delta, new = update(state, G, cfg, W)``
followed by ``W += delta`` computes, bit for bit, but overwrites ``W`` and the
moment arrays of ``state`` instead of allocating new ones.  On a large parameter
the functional form allocates about ten temporaries of its size per step; the
in-place form of the Adam family allocates at most two.  It is how the torch
adapter applies updates.

The Adam-family arithmetic is the functional one reordered only where IEEE
arithmetic is exactly commutative (``b * M`` vs ``M * b``), so results are
identical; the tests compare with ``array_equal``.  On NumPy arrays, when the
config's ``kernels`` option selects numba (:mod:`adadiag_ref.optim.dispatch`),
the moments and ``U~`` come from the fused kernel that also serves the
functional Adam direction, in one pass.  The Adafactor and Hfac families use the
functional update (kernel or reference, as ``kernels`` says) and copy its
results into the buffers.

Only backends with mutable arrays qualify (NumPy, CuPy, PyTorch); JAX arrays are
immutable and get a ``TypeError``.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import is_cupy_namespace, is_numpy_namespace, is_torch_namespace

from .. import _kernels
from .._xp import Array, Namespace, namespace
from ..config import BaseConfig
from .core import prepare_step, unrotate, update
from .dispatch import uses_kernels
from .families import AdamState, State
from .layout import from_work
from .schedules import beta_hat

__all__ = ["supports_in_place", "update_in_place"]


def _native(xp: Namespace) -> Any:
    """The backend module whose ufuncs take ``out=`` (numpy, cupy or torch)."""
    if is_numpy_namespace(xp):
        import numpy

        return numpy
    if is_cupy_namespace(xp):
        import cupy

        return cupy
    if is_torch_namespace(xp):
        import torch

        return torch
    raise TypeError(f"update_in_place needs mutable arrays (numpy, cupy, torch), not {xp.__name__}")


def supports_in_place(x: Array) -> bool:
    """Whether :func:`update_in_place` accepts arrays like ``x``."""
    xp = namespace(x)
    return bool(is_numpy_namespace(xp) or is_cupy_namespace(xp) or is_torch_namespace(xp))


def _check_writable(arrays: dict[str, Array | None]) -> None:
    """Refuse read-only buffers before anything is written (the call must be all or nothing)."""
    for label, a in arrays.items():
        if a is None:
            continue
        flags = getattr(a, "flags", None)
        if flags is not None and not flags.writeable:
            raise ValueError(f"update_in_place needs writable arrays; the {label} is read-only (nothing was changed)")
        if getattr(a, "requires_grad", False) and getattr(a, "is_leaf", False):
            import torch

            if torch.is_grad_enabled():
                raise ValueError(
                    f"update_in_place: the {label} is a leaf tensor that requires grad; "
                    "call it under torch.no_grad() (nothing was changed)"
                )


def _adam_moments_ufuncs(
    M: Array, V: Array, g_rot: Array, owned: bool, b1_t: Array, b2_t: Array, eps: float, native: Any
) -> tuple[Array, Array, Array]:
    """``(M_t, V_t, U~)`` of the Adam direction with backend ufuncs, at most two new arrays (``owned``: ``G~``
    may be overwritten).  The functional EMA is ``b * old + (1 - b) * new``; IEEE addition and multiplication
    commute exactly, so the results are the family function's bit for bit."""
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
    native.sqrt(new_V, out=buf)
    buf += eps
    native.divide(new_M, buf, out=buf)  # U~ = M / (sqrt(V) + eps)
    return new_M, new_V, buf


def update_in_place(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    param: Array,
    *,
    lr: Any = None,
    refreshed: Any = False,
    xp: Namespace | None = None,
) -> State:
    """``W <- W + delta`` and the moments overwritten, as :func:`~adadiag_ref.optim.update` defines them.

    Returns the new state: the same moment arrays (now updated), the same bases
    and ``count + 1``.  ``grad`` is never modified.  Like ``update`` it never
    refreshes the basis and does not validate finiteness (see ``check_inputs``):
    NaN or Inf in ``G`` propagate into the moments and ``W`` as in Adam.

    All or nothing: every new value is computed into scratch buffers first and
    written to ``W``, ``M`` and ``V`` only at the end, after a check that they
    are writable; a call that raises leaves the parameter and the state bit-identical.
    On PyTorch the Adam family's ``M`` and ``V`` take over their scratch tensors'
    storage (``Tensor.set_``) instead of copying it: the same tensor objects, the
    same values, one pass over memory less each (views taken of them earlier keep
    the old values).
    """
    xp = namespace(grad, param, xp=xp)
    native = _native(xp)
    fields = {f"state field {k!r}": v for k, v in zip(state._fields[1:], state[1:])}
    _check_writable({"parameter": param, **fields})
    if not isinstance(state, AdamState):
        delta, new = update(state, grad, cfg, param, lr=lr, refreshed=refreshed, xp=xp)
        param += delta
        for old, fresh in zip(state[1:], new[1:]):
            if old is not None and old is not fresh:
                old[...] = fresh
        return state._replace(count=new.count)

    layout, t, g, w, g_rot = prepare_step(state, grad, cfg, param, refreshed, xp)
    owned = g_rot is not g  # a fresh GEMM output may serve as scratch space

    b1_t = beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction)
    b2_t = beta_hat(cfg.betas[1], t, xp, bias_correction=cfg.bias_correction)
    M, V = state.M, state.V
    if uses_kernels(cfg, xp, g_rot, M, V):  # one fused pass: the kernel of the functional Adam direction
        buf = native.empty_like(M)
        new_M = g_rot if owned else native.empty_like(M)  # the kernel reads each G~_ij before writing M_ij
        new_V = native.empty_like(V)
        _kernels.adam_moments_inplace(M, V, g_rot, *_kernels.adam_coefficients(b1_t, b2_t, M.dtype),
                                      _kernels.scalar(cfg.eps, M.dtype), new_M, new_V, buf)  # fmt: skip
    else:
        new_M, new_V, buf = _adam_moments_ufuncs(M, V, g_rot, owned, b1_t, b2_t, cfg.eps, native)
    direction = unrotate(buf, state.P, state.Q, xp, transposed=layout.transposed)
    if cfg.weight_decay:
        direction += cfg.weight_decay * w
    eta = cfg.lr if lr is None else lr
    direction *= -eta
    delta = xp.astype(from_work(direction, layout, xp), param.dtype, copy=False)
    # commit: nothing below can fail on writable buffers of matching shape and dtype
    param += delta
    if is_torch_namespace(xp):  # the tensors M and V adopt the scratch storage: O(1), no copy pass, same objects
        M.set_(new_M)
        V.set_(new_V)
    else:
        M[...] = new_M
        V[...] = new_V
    return state._replace(count=state.count + 1)
