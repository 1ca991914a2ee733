"""Optimizer states: NamedTuples of arrays with fixed shapes and dtypes.

All arrays live in the *work frame* of the parameter (see
:mod:`adadiag_ref.optim.layout`): an ``m x n`` matrix with ``m <= n``.  A basis
field is ``None`` when that side is not rotated (baselines, 1-D parameters,
sides longer than ``max_basis_dim``); the structure is decided by the shape and
the config alone, so a basis refresh never changes it (required under
``jax.jit``).  ``count`` is the number of updates taken so far (int32 scalar).
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


class AdafactorState(NamedTuple):
    """Adafactor / AdafacDiag: row sums ``r`` (m,), column sums ``s`` (n,), optional ``M``."""

    count: Array
    P: Array | None
    Q: Array | None
    M: Array | None
    r: Array
    s: Array


class HfacState(NamedTuple):
    """Hfac / HfacDiag: factored first moment ``u`` (m,), ``v`` (n,) and second ``r``, ``s``."""

    count: Array
    P: Array | None
    Q: Array | None
    u: Array
    v: Array
    r: Array
    s: Array


State = AdamState | AdafactorState | HfacState
