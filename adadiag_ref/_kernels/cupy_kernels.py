r"""The CuPy foundation shared by every family's CuPy route (``optim/families/<family>/cupy_route.py``).

The GPU counterpart of the numba foundation (:mod:`adadiag_ref._kernels`): the families' entrywise formulas as
``cupy.ElementwiseKernel`` bodies, launched once per pass where the generic array-API code launches one kernel
per operation (``M_t = b1 M + (1 - b1) G~`` alone is three).  This module holds what the routes share:

* when they apply (:func:`selected`): ``cfg.kernels == "auto"``, a CuPy namespace, and CuPy arrays of one
  float32/float64 dtype.  ``"numba"`` names the NumPy kernels, so on CuPy it takes the reference, as
  ``"reference"`` does (:attr:`adadiag_ref.config.BaseConfig.kernels`);
* the kernels, built on first use and kept (:func:`elementwise`, :func:`sum_of_squares`); importing this module
  (or any family) never imports CuPy, and CuPy compiles each kernel once per dtype and device (and caches the
  binary on disk);
* the scalars (:func:`coefficient`, :func:`ema_coefficients`): a host coefficient (a Python number, the
  host-step case of :mod:`adadiag_ref.optim.schedules`) enters as a NumPy scalar of the state dtype, rounded as
  CuPy rounds the weak Python scalar of the generic code; a device one (a 0-d CuPy array of the state dtype,
  the device-counter case) enters as that array, broadcast by the kernel: nothing is read back from the device;
* the update's tail ``delta = (-eta)(U + lambda W)`` as a C expression (:func:`tail_expression`).

Every kernel is compiled with ``--fmad=false``: the generic code runs each ``*`` and ``+`` as a kernel of its
own, correctly rounded, so a fused multiply-add would change the rounding.  With contraction off, IEEE
``sqrt`` and division (NVRTC's defaults), and every constant written in the kernel's type ``T`` (a bare ``0.5``
would be a C ``double``), each entry is the same sequence of operations as the reference's.  The routes'
reductions are CuPy's (``cupy.sum``), or a summation kernel where the reference's ``mean(U * U)`` would form
an ``m x n`` temporary; their summation order may differ, so results agree with the reference to rounding
(``tests/test_cupy_kernels.py``, ``rtol = 1e-12`` in float64 and ``1e-5`` in float32).

Checked without a GPU (``tests/test_cupy_kernels.py``): CuPy's generated source of every kernel compiles with
NVRTC for ``compute_80`` and ``compute_90``, its PTX free of fused multiply-adds, with IEEE division and square
root, and no float64 in a float32 kernel; the bodies, evaluated by NumPy in the kernel's dtype, reproduce
``kernels="reference"`` bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from array_api_compat import is_cupy_array, is_cupy_namespace

from . import one_float_dtype

__all__ = [
    "OPTIONS",
    "coefficient",
    "elementwise",
    "ema_coefficients",
    "selected",
    "sum_of_squares",
    "tail_expression",
    "usable",
]

OPTIONS = ("--fmad=false",)
"""NVRTC options of every kernel: no multiply-add contraction (module docstring)."""

_KERNELS: dict[str, Any] = {}
"""The kernels built so far, by name (:func:`elementwise`)."""


def usable(xp: Any, *arrays: Any) -> bool:
    """True when ``xp`` is CuPy's namespace and every array (``None`` skipped) is a CuPy float32/float64 array,
    all of one dtype.  Never imports CuPy (:func:`array_api_compat.is_cupy_array` looks at the type's name)."""
    return is_cupy_namespace(xp) and one_float_dtype(arrays, is_cupy_array)


def selected(cfg: Any, xp: Any, *arrays: Any) -> bool:
    """Whether a step of ``cfg`` on ``arrays`` runs the CuPy kernels: ``cfg.kernels`` is ``"auto"`` (the fast
    kernels of the arrays' backend; ``"numba"`` and ``"reference"`` take the reference on CuPy) and
    :func:`usable` holds."""
    return getattr(cfg, "kernels", "auto") == "auto" and usable(xp, *arrays)


def coefficient(x: Any, dtype: Any) -> Any:
    """``x`` as a kernel argument of ``dtype``, or ``None`` when the generic code would not compute in ``dtype``.

    A Python number becomes a NumPy scalar of ``dtype`` (CuPy casts a weak Python scalar to the array's dtype
    the same way); a NumPy scalar or 0-d array must already have ``dtype``; a 0-d CuPy array of ``dtype`` is
    passed as it is (a device coefficient, broadcast by the kernel: no read-back).  Anything else (a bool, an
    array of another dtype or shape, a CuPy array of another dtype, which the generic code would promote)
    gives ``None``: the route declines and the reference runs.
    """
    dtype = np.dtype(dtype)
    if isinstance(x, bool):
        return None
    if isinstance(x, np.generic | np.ndarray):  # before float: numpy.float64 is a float, and not weak
        return np.asarray(x)[()] if x.dtype == dtype and x.ndim == 0 else None
    if isinstance(x, int | float):
        return np.asarray(x, dtype=dtype)[()]
    if is_cupy_array(x) and x.ndim == 0 and x.dtype == dtype:
        return x
    return None


def ema_coefficients(beta_t: Any, dtype: Any) -> tuple[Any, Any] | None:
    """``(b, 1 - b)`` of the reference EMA ``beta_t * old + (1.0 - beta_t) * new`` as kernel arguments
    (:func:`coefficient`), ``1 - b`` computed from ``beta_t`` itself as the reference computes it (in Python for a
    host number, by CuPy for a device one); ``None`` when either does not apply."""
    b = coefficient(beta_t, dtype)
    if b is None:
        return None
    c = coefficient(1.0 - beta_t, dtype)
    if c is None:
        return None
    return b, c


def tail_expression(u: str, w: str, decay: bool) -> str:
    """The C expression of one entry of ``delta = (-eta)(U + lambda W)`` over kernel arguments ``neg_lr`` and
    ``wd``: ``U + lambda W`` only when ``decay`` (the reference adds nothing when ``lambda = 0``, so a signed
    zero stays what it makes of it), as :func:`adadiag_ref._kernels.delta_entry` writes it for numba."""
    return f"neg_lr * ({u} + wd * {w})" if decay else f"neg_lr * {u}"


def elementwise(name: str, in_params: str, out_params: str, operation: str) -> Any:
    """The ``cupy.ElementwiseKernel`` ``name`` (built on the first call, then kept; CuPy compiles it per dtype).

    ``name`` identifies the kernel: two calls with one name must pass the same source.  Compiled with
    :data:`OPTIONS`.  Only called from a route that applies, so CuPy is already imported here."""
    kernel = _KERNELS.get(name)
    if kernel is None:
        import cupy

        kernel = cupy.ElementwiseKernel(in_params, out_params, operation, name, options=OPTIONS)
        _KERNELS[name] = kernel
    return kernel


def sum_of_squares(x: Any) -> Any:
    """``sum(x * x)`` over every entry, a 0-d CuPy array of ``x``'s dtype (accumulated in it, as ``cupy.sum``
    does), without the ``x * x`` temporary of ``mean(x * x)``.  Compiled with :data:`OPTIONS` as every kernel:
    without them NVRTC contracts the accumulation ``s + x * x`` into a fused multiply-add."""
    kernel = _KERNELS.get("adadiag_sum_of_squares")
    if kernel is None:
        import cupy

        kernel = cupy.ReductionKernel(
            "T x", "T y", "x * x", "a + b", "y = a", "0", "adadiag_sum_of_squares", options=OPTIONS
        )
        _KERNELS["adadiag_sum_of_squares"] = kernel
    return kernel(x)
