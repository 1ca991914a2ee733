"""The tail every update shares, whatever computed its direction: decay, step size, back to the parameter.

For the direction ``D = P U~ Q^T`` of step ``t`` (work frame, state dtype)::

    delta = -eta_t (D + lambda W_t),    W_{t+1} = W_t + delta

with decoupled weight decay ``lambda`` (added only when it is nonzero or an array, so a signed zero of ``D``
stays what it is) and ``eta_t`` the family's step size.  ``delta`` leaves the work frame
(:func:`~adadiag_ref.optim.layout.from_work`) in the parameter's dtype.  The functional update, the in-place one
and every fast route that does not fuse the tail into a kernel call :func:`parameter_delta`; the numba kernels
write the same entry expression once (:func:`adadiag_ref._kernels.delta_entry`).
"""

from __future__ import annotations

from typing import Any

from .._xp import Array, Namespace
from ..config import BaseConfig
from .layout import Layout, from_work

__all__ = ["commit", "decayed_step", "decays", "parameter_delta"]


def decays(cfg: BaseConfig) -> bool:
    """Whether ``lambda W_t`` is added: ``lambda != 0``, or an array (a traced ``lambda`` always adds)."""
    return not isinstance(cfg.weight_decay, int | float) or bool(cfg.weight_decay)


def parameter_delta(
    direction: Array, w: Array, eta: Any, cfg: BaseConfig, layout: Layout, dtype: Any, xp: Namespace, *, owned: bool
) -> Array:
    """``delta = -eta_t (D + lambda W_t)`` in the parameter's shape and ``dtype``.

    ``owned``: ``direction`` is scratch of this call's own (a fresh GEMM output or kernel buffer) and is
    overwritten instead of allocating two more arrays of its size; the same products either way (IEEE
    multiplication commutes), so the same bits.
    """
    return xp.astype(from_work(decayed_step(direction, w, eta, cfg, owned=owned), layout, xp), dtype, copy=False)


def decayed_step(direction: Array, w: Array, eta: Any, cfg: BaseConfig, *, owned: bool) -> Array:
    """``-eta_t (D + lambda W_t)`` entry by entry, in the state dtype, in any frame (``D`` and ``W`` in one order):
    the expressions of the tail, shared by :func:`parameter_delta` and the engine's flat groups
    (:class:`adadiag_ref.optim.engine.Engine`).  ``owned`` as in :func:`parameter_delta`."""
    if decays(cfg):
        if owned:
            direction += cfg.weight_decay * w
        else:
            direction = direction + cfg.weight_decay * w
    if owned:
        direction *= -eta
    else:
        direction = -eta * direction
    return direction


def commit(targets: dict[str, Array | None], values: dict[str, Array | None]) -> None:
    """Copy each new value into its target buffer (the last step of ``update_in_place``; nothing here can fail on
    buffers of matching shape and dtype)."""
    for name, target in targets.items():
        value = values.get(name)
        if target is None or value is None or value is target:
            continue
        target[...] = value
