"""Checkpoints of the core's states with ``torch.save`` / ``torch.load``.

A core state is a NamedTuple (``AdamState``, ``AdafactorState``, ``HfacState``, a registered family's) of arrays.
``torch.load`` unpickles only allow-listed types by default (``weights_only=True`` since torch 2.6) and refuses
these: :func:`register_torch_safe_globals` adds them to the allow-list, once, before loading.
"""

from __future__ import annotations

from typing import Any

from .families import FAMILIES

__all__ = ["register_torch_safe_globals", "state_types"]


def state_types() -> list[type]:
    """The state NamedTuple of every registered family (the library's three, then any added by
    :func:`~adadiag_ref.optim.families.register_family`)."""
    return [spec.state_type for spec in FAMILIES.values()]


def register_torch_safe_globals() -> list[type]:
    """Allow ``torch.load(path)`` (``weights_only=True``) to rebuild the core's states: every family's state
    type (:func:`state_types`) added to ``torch.serialization.add_safe_globals``.  Returns the types added;
    call it again after registering a family.  Needs torch (``ImportError`` naming the extra otherwise).

    A state of torch tensors round-trips bit for bit::

        ar.register_torch_safe_globals()
        torch.save(state, path)
        state = torch.load(path)
    """
    try:
        import torch
    except ImportError as exc:  # name the extra instead of a bare "No module named 'torch'"
        raise ImportError('register_torch_safe_globals needs torch: pip install "adadiag-ref[torch]"') from exc
    types: list[Any] = state_types()
    torch.serialization.add_safe_globals(types)
    return types
