"""The optimizer families, one module each, discrete update and continuous-time form side by side.

:mod:`.adam`, :mod:`.adafactor` and :mod:`.hfac` each hold their state types, their
moment update and direction (:class:`~.common.Family`, used by :mod:`adadiag_ref.optim.core`)
and beside them their continuous-time vector field, Hamiltonian ``H`` and ``dH/dt``
(:class:`~.common.Flow`, used by :mod:`adadiag_ref.ode`); :mod:`.momentum` is the
continuous-only reference system.  Both forms work on the rotated gradient
``G~ = P^T G Q`` and return a rotated direction ``U~``: rotation, decay and step size are
shared (:mod:`adadiag_ref.optim.rotation`, :mod:`adadiag_ref.optim.core`), so a baseline
is the same code with the identity basis.
"""

from __future__ import annotations

from types import ModuleType

from ...config import AdafactorConfig, AdamConfig, HfacConfig
from . import adafactor, adam, hfac, momentum
from .adafactor import AdafactorODEState, AdafactorState
from .adam import AdamODEState, AdamState
from .common import Constants, Family, Flow, FlowField, Moments, paper_defaults
from .hfac import HfacODEState, HfacState
from .momentum import MomentumODEState

__all__ = [
    "FAMILIES",
    "FLOWS",
    "AdafactorODEState",
    "AdafactorState",
    "AdamODEState",
    "AdamState",
    "Constants",
    "Family",
    "Flow",
    "FlowField",
    "HfacODEState",
    "HfacState",
    "Moments",
    "MomentumODEState",
    "ODEState",
    "State",
]

FAMILIES: dict[str, Family] = {"adam": adam.FAMILY, "adafactor": adafactor.FAMILY, "hfac": hfac.FAMILY}
"""Discrete forms, by ``cfg.family``."""


def _flow(module: ModuleType, state_type: type, default_eps: float, max_sides: int) -> Flow:
    """A family module's continuous-time functions (the same names in every module) as a :class:`Flow`."""
    return Flow(
        state_type,
        default_eps,
        max_sides,
        module.fields,
        module.update_order,
        module.vector_field,
        module.hamiltonian,
        module.hamiltonian_rate,
        module.initial_moments,
    )


FLOWS: dict[str, Flow] = {
    "momentum": _flow(momentum, MomentumODEState, 0.0, 0),
    "adam": _flow(adam, AdamODEState, *paper_defaults(AdamConfig)),
    "adafactor": _flow(adafactor, AdafactorODEState, *paper_defaults(AdafactorConfig)),
    "hfac": _flow(hfac, HfacODEState, *paper_defaults(HfacConfig)),
}
"""Continuous-time forms, by family (momentum SGD has no discrete form here)."""

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
existed) skips the orientation check.
"""

ODEState = MomentumODEState | AdamODEState | AdafactorODEState | HfacODEState
"""A continuous-time state (``W`` and the moments, work frame)."""
