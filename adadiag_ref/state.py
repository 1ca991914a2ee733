"""Optimizer states: NamedTuples of arrays with fixed shapes and dtypes.

All arrays live in the *work frame* of the parameter (see
:mod:`adadiag_ref.optim.layout`): an ``m x n`` matrix with ``m <= n``.  A basis
field is ``None`` when that side is not rotated (baselines, 1-D parameters,
sides longer than ``max_basis_dim``); the structure is decided by the shape and
the config alone, so a basis refresh never changes it (required under
``jax.jit``).  ``count`` is the number of updates taken so far (int32 scalar).

``param_shape`` records the parameter's own shape, which the work frame loses:
a ``(7, 9)`` and a ``(9, 7)`` parameter (or a ``(4, 3, 3)`` and a ``(4, 9)`` one)
share one ``7 x 9`` work frame, so their states have the same field shapes.  It
is a zero-size array of shape ``(0, *param.shape)`` (no memory, any backend, an
ordinary pytree leaf) whose *static* shape is read, so the check also runs while
``jax.jit`` traces.  ``None`` (a state built by hand, or saved before the field
existed) skips the orientation check.
"""

from __future__ import annotations

from typing import NamedTuple

from ._xp import Array

__all__ = ["AdafactorState", "AdamState", "HfacState", "State"]


class AdamState(NamedTuple):
    """AdamW / AdaDiag / AdaDiag++: ``M`` and ``V`` are ``m x n`` rotated moments."""

    count: Array
    P: Array | None
    Q: Array | None
    M: Array
    V: Array
    param_shape: Array | None = None  # zero-size, shape (0, *param.shape): see the module docstring


class AdafactorState(NamedTuple):
    """Adafactor / AdafacDiag: row sums ``r`` (m,), column sums ``s`` (n,), optional ``M``."""

    count: Array
    P: Array | None
    Q: Array | None
    M: Array | None
    r: Array
    s: Array
    param_shape: Array | None = None  # zero-size, shape (0, *param.shape): see the module docstring


class HfacState(NamedTuple):
    """Hfac / HfacDiag: factored first moment ``u`` (m,), ``v`` (n,) and second ``r``, ``s``."""

    count: Array
    P: Array | None
    Q: Array | None
    u: Array
    v: Array
    r: Array
    s: Array
    param_shape: Array | None = None  # zero-size, shape (0, *param.shape): see the module docstring


State = AdamState | AdafactorState | HfacState
