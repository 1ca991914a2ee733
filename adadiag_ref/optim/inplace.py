"""In-place application of one update, for frameworks that own mutable buffers.

:func:`update_in_place` computes exactly what ``delta, new = update(state, G, cfg, W)`` followed by
``W += delta`` computes, bit for bit, but overwrites ``W`` and the moment arrays of ``state`` instead of
allocating new ones.  It is how the torch adapter applies a per-parameter update.

The arithmetic is the reference's (:func:`~adadiag_ref.optim.core.update_prepared`), its results copied into the
buffers once everything that can fail has run; no route is tried here (the fast executor is
:class:`~adadiag_ref.Engine`).

Only backends with mutable arrays qualify (NumPy, CuPy, PyTorch); JAX arrays are immutable and get a
``TypeError``.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import is_cupy_namespace, is_numpy_namespace, is_torch_namespace

from .._xp import Array, Namespace, namespace, native_module
from ..config import BaseConfig
from .core import host_count, prepare_step, update_prepared
from .families import State, family_of
from .layout import Layout
from .tail import commit

__all__ = ["supports_in_place", "update_in_place"]


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
        if flags is not None and not getattr(flags, "writeable", True):  # CuPy's flags have no writeable field
            raise ValueError(f"update_in_place needs writable arrays; the {label} is read-only (nothing was changed)")
        if getattr(a, "requires_grad", False) and getattr(a, "is_leaf", False):
            import torch

            if torch.is_grad_enabled():
                raise ValueError(
                    f"update_in_place: the {label} is a leaf tensor that requires grad; "
                    "call it under torch.no_grad() (nothing was changed)"
                )


def update_in_place(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    param: Array,
    *,
    lr: Any = None,
    refreshed: Any = False,
    count: int | None = None,
    xp: Namespace | None = None,
    block: Layout | None = None,
    whole_grad: Array | None = None,
) -> State:
    """``W <- W + delta`` and the moments overwritten, as :func:`~adadiag_ref.optim.update` defines them.

    Returns the new state: the same moment arrays (now updated), the same bases
    and ``count + 1``.  ``grad`` is never modified.  Like ``update`` it never
    refreshes the basis and does not validate finiteness (see ``check_inputs``):
    NaN or Inf in ``G`` propagate into the moments and ``W`` as in Adam.

    All or nothing: everything that can fail (shapes, writability, GEMMs,
    allocations) runs before the first write to ``W`` and the moments; a call
    that raises leaves the parameter and the state bit-identical.  The new values are computed by
    :func:`~adadiag_ref.update` into new arrays and then copied into the state's own arrays (views taken of them
    earlier see the new values, as with ``torch.optim.AdamW``).

    ``count`` (the steps taken, a host int) as in :func:`~adadiag_ref.step`: the step's coefficients are then
    host numbers and nothing is read back from the device.  ``block`` and ``whole_grad``: a block of a sharded
    parameter, as in :func:`~adadiag_ref.optim.core.prepare_step`.
    """
    xp = namespace(grad, param, xp=xp)
    native_module(xp)  # TypeError for immutable arrays (JAX), before anything else
    fields = {f"state field {k!r}": v for k, v in zip(state._fields[1:], state[1:])}
    _check_writable({"parameter": param, **fields})
    step_in = prepare_step(
        state, grad, cfg, param, refreshed, xp, host_count(count), block=block, whole_grad=whole_grad
    )
    delta, new = update_prepared(state, step_in, cfg, param, lr, xp)
    param += delta
    moments = family_of(cfg).moment_fields
    commit({k: getattr(state, k) for k in moments}, {k: getattr(new, k) for k in moments})
    return state._replace(count=new.count)
