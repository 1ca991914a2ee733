"""The optimizer families, one package each, and the one registry every other module reads.

Each family package (:mod:`.adam`, :mod:`.adafactor`, :mod:`.hfac`) holds its reference (``reference.py``:
state types, the discrete direction, the continuous-time vector field, ``H`` and ``dH/dt``, in array-API code)
and beside it one module per fast route (``numba_route.py``, ``torch_route.py``, ...), and ends in its registry
entry ``SPEC`` (:class:`~.registry.FamilySpec`).  :mod:`.momentum` is the continuous-only reference system.
Both forms work on the rotated gradient ``G~ = P^T G Q`` and return a rotated direction ``U~``: rotation, decay
and step size are shared (:mod:`adadiag_ref.optim.rotation`, :mod:`adadiag_ref.optim.tail`), so a baseline is
the same code with the identity basis.

:data:`FAMILIES` (and :data:`adadiag_ref.config.OPTIMIZERS` for the optimizers) is the single source of truth;
:func:`register_family` adds a family from outside the package (``docs/extending.md``).
"""

from __future__ import annotations

from . import adafactor, adam, hfac
from .adafactor import AdafactorODEState, AdafactorState
from .adam import AdamODEState, AdamState
from .common import Constants, Flow, FlowField, Moments, flow_of
from .hfac import HfacODEState, HfacState
from .momentum import MomentumODEState
from .registry import FAMILIES, FamilySpec, Routes, family_of, flows, register_family

__all__ = [
    "FAMILIES",
    "MOMENTUM_FLOW",
    "AdafactorODEState",
    "AdafactorState",
    "AdamODEState",
    "AdamState",
    "Constants",
    "FamilySpec",
    "Flow",
    "FlowField",
    "HfacODEState",
    "HfacState",
    "Moments",
    "MomentumODEState",
    "ODEState",
    "Routes",
    "State",
    "family_of",
    "flow_of",
    "flows",
    "register_family",
]

for _spec in (adam.SPEC, adafactor.SPEC, hfac.SPEC):
    FAMILIES[_spec.name] = _spec  # their optimizers are config.OPTIMIZERS' own entries

from . import momentum  # noqa: E402

MOMENTUM_FLOW = flow_of(momentum, MomentumODEState, 0.0, 0)
"""Momentum SGD's continuous-time form (the ODE's reference system; no discrete form here)."""

State = AdamState | AdafactorState | HfacState
"""A discrete optimizer state: NamedTuple of arrays with fixed shapes and dtypes.

All arrays live in the *work frame* of the parameter (:mod:`adadiag_ref.optim.layout`): an
``m x n`` matrix with ``m <= n``.  A basis field is ``None`` when that side is not rotated
(baselines, 1-D parameters, sides longer than ``max_basis_dim``); the structure is decided by
the shape and the config alone, so a basis refresh never changes it (required under
``jax.jit``).  ``count`` is the number of updates taken so far (int32 scalar).

``param_shape`` records the parameter's own shape, which the work frame loses:
a ``(7, 9)`` and a ``(9, 7)`` parameter (or a ``(4, 3, 3)`` and a ``(4, 9)`` one)
share one ``7 x 9`` work frame, so their states have the same field shapes.  It
is a zero-size array of shape ``(0, *param.shape)`` (no memory, any backend, an
ordinary pytree leaf) whose *static* shape is read, so the check also runs while
``jax.jit`` traces.  ``None`` (a state built by hand, or saved before the field
existed) skips the orientation check.  A registered family's state has the same
layout (``count, P, Q, *moments, param_shape``).
"""

ODEState = MomentumODEState | AdamODEState | AdafactorODEState | HfacODEState
"""A continuous-time state (``W`` and the moments, work frame)."""
