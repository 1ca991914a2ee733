"""Small array-API helpers private to :mod:`adadiag_ref.ode`.

Everything numerical in the ODE package runs on the array namespace ``xp`` of
its inputs (NumPy, CuPy, ``array_api_strict``, ...).  Host-side bookkeeping
(times, step sizes, error norms, scalar diagnostics) uses Python floats and
NumPy, as a controller's accept/reject decision is a host decision anyway.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from array_api_compat import array_namespace

Array = Any
Namespace = Any

__all__ = ["Array", "Namespace", "inner", "namespace_of", "scalar", "to_host"]


def namespace_of(*arrays: Array, xp: Namespace | None = None) -> Namespace:
    """Return ``xp`` when given, else the array-API namespace shared by ``arrays`` (``None`` ignored)."""
    if xp is not None:
        return xp
    return array_namespace(*(a for a in arrays if a is not None))


def scalar(x: Array) -> float:
    """A 0-d array (or number) as a Python float (one host sync on a device backend)."""
    return float(x)


def inner(a: Array, b: Array, xp: Namespace) -> Array:
    """Frobenius inner product ``<A, B> = sum_ij A_ij B_ij`` as a 0-d array."""
    return xp.sum(a * b)


def to_host(x: Array) -> np.ndarray:
    """Copy an array of any backend to a float64 NumPy array on the host."""
    from .._xp import to_numpy

    return np.asarray(to_numpy(x), dtype=np.float64)
