"""Array-namespace helpers shared by every module of the core.

The core is written against the Python array API standard.  Public functions take
``xp=None`` and resolve the namespace from their array arguments with
:func:`array_api_compat.array_namespace`, so NumPy, CuPy, PyTorch, JAX and
``array_api_strict`` arrays all run through the same code.
"""

from __future__ import annotations

import operator
import os
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from array_api_compat import (
    array_namespace,
    is_cupy_namespace,
    is_jax_namespace,
    is_numpy_namespace,
    is_torch_namespace,
)
from array_api_compat import device as array_device

Array = Any
Namespace = Any

__all__ = [
    "Array",
    "Namespace",
    "array_device",
    "as_namespace",
    "backend_name",
    "count_nonfinite",
    "creation_device",
    "float_dtype_name",
    "namespace",
    "native_module",
    "plain_cpu_tensors",
    "require_linalg",
    "sqrt",
    "state_dtype",
    "to_numpy",
    "warn_at_caller",
]


def namespace(*arrays: Array, xp: Namespace | None = None) -> Namespace:
    """Return ``xp`` if given (a plain module such as ``torch`` or ``numpy`` as its array-API namespace:
    :func:`as_namespace`), else the array-API namespace of ``arrays``."""
    if xp is not None:
        try:
            return _WRAPPED.get(xp) or as_namespace(xp)
        except TypeError:  # an unhashable namespace object: taken as it is
            return xp
    return array_namespace(*(a for a in arrays if a is not None))


_WRAPPED: dict[Any, Namespace] = {}
"""Each ``xp=`` seen by :func:`namespace`, as its array-API namespace (a module is wrapped once)."""


def as_namespace(xp: Namespace) -> Namespace:
    """The array-API namespace of the library ``xp``: ``array_api_compat``'s wrapper of a plain module
    (``xp=torch``, ``numpy``, ``cupy``, ``dask.array``): the namespace of a 0-d array it makes.  A module that
    already is one (``jax.numpy``, ``array_api_strict``, ``array_api_compat.torch``), and any other namespace
    object, is returned as it is."""
    wrapped = xp
    if isinstance(xp, types.ModuleType) and not xp.__name__.startswith("array_api_compat"):
        try:
            wrapped = array_namespace(xp.asarray(0.0))
        except Exception:  # not a library array_api_compat knows: the caller's own namespace
            wrapped = xp
    _WRAPPED[xp] = wrapped
    return wrapped


def backend_name(xp: Namespace) -> str:
    """The library behind namespace ``xp``, for messages (``numpy``, ``torch``, ``jax.numpy``, ...)."""
    name = str(getattr(xp, "__name__", type(xp).__name__))
    return name.removeprefix("array_api_compat.")


def require_linalg(xp: Namespace, what: str) -> None:
    """``TypeError`` unless ``xp`` has ``linalg.svd`` (every basis refresh decomposes ``G_t``; ``ndonnx`` has no
    ``linalg``): one line naming the missing piece and ``what`` needs it."""
    linalg = getattr(xp, "linalg", None)
    if linalg is None or not hasattr(linalg, "svd"):
        missing = "linalg" if linalg is None else "linalg.svd"
        raise TypeError(
            f"the array namespace {backend_name(xp)} has no {missing}, which {what} needs (the basis refresh "
            "decomposes the gradient); use an optimizer without rotation (adamw, adafactor, hfac) or another backend"
        )


def native_module(xp: Namespace) -> Any:
    """The backend module whose ufuncs take ``out=`` (numpy, cupy or torch), for in-place arithmetic; a
    ``TypeError`` for a backend whose arrays are immutable (JAX, ``array_api_strict``)."""
    if is_numpy_namespace(xp):
        return np
    if is_cupy_namespace(xp):
        import cupy

        return cupy
    if is_torch_namespace(xp):
        import torch

        return torch
    raise TypeError(f"update_in_place needs mutable arrays (numpy, cupy, torch), not {xp.__name__}")


def sqrt(x: Array, xp: Namespace, out: Array | None = None) -> Array:
    """``sqrt(x)`` entrywise, correctly rounded (IEEE 754's square root) on every backend: the library's root.

    NumPy, CuPy (CUDA's ``sqrt``), JAX and torch on CUDA already round the root correctly, and so does a compiled
    torch graph (Inductor's loops); eager ``torch.sqrt`` of a CPU tensor does not always: on MKL builds it is
    VML's ``vm?Sqrt``, whose results differ from the correctly rounded root by one ulp in about 17 % of random
    float32 entries and 1.4 % of float64 ones on an AMD EPYC, and may differ between processors.  So a dense
    float32/float64 CPU torch tensor (outside autograd and outside a graph being traced) takes NumPy's root on a
    zero-copy view of its memory; every other array takes its backend's.  A trajectory on torch's CPU then has the
    bits of the same trajectory on NumPy (docs/spec.md, "The square root").

    ``out``: an array of ``x``'s shape and dtype to write the root into (a mutable backend: NumPy, CuPy or torch),
    returned; else a new array (for a torch tensor in the layout ``torch.sqrt`` would give it).
    """
    if is_torch_namespace(xp) and _numpy_may_root(x, out):
        with np.errstate(invalid="ignore"):  # a negative entry gives NaN, as torch.sqrt, without a warning
            return _numpy_root(x, out)
    if out is not None:
        native_module(xp).sqrt(x, out=out)
        return out
    return xp.sqrt(x)


def _numpy_root(x: Any, out: Any) -> Any:
    """NumPy's root of a CPU torch tensor into ``out`` (a new tensor of torch's layout when ``None``)."""
    import torch

    result = torch.empty_like(x) if out is None else out
    np.sqrt(x.detach().numpy(), out=result.detach().numpy())
    return result


def plain_cpu_tensors(xs: Sequence[Any]) -> bool:
    """Whether every one of ``xs`` is a plain strided float32/float64 CPU torch tensor (no subclass such as a
    DTensor, no lazily negated or conjugated view): one whose memory NumPy and the numba kernels may read as it
    is.  Each property is read by ``map`` over all of them, a loop in C: the engine asks it of every gradient at
    every step, where a Python frame per tensor cost more than a tiny tensor's arithmetic."""
    torch = sys.modules.get("torch")  # no tensor among xs unless torch is imported (and this is called per step)
    if torch is None:
        return False
    plain = {torch.Tensor, torch.nn.Parameter}
    return (
        set(map(type, xs)) <= plain
        and all(map(_IS_CPU, xs))
        and set(map(_DTYPE, xs)) <= {torch.float32, torch.float64}
        and set(map(_LAYOUT, xs)) <= {torch.strided}
        and not any(map(_IS_NEG, xs))
        and not any(map(_IS_CONJ, xs))
    )


_IS_CPU, _DTYPE, _LAYOUT = operator.attrgetter("is_cpu"), operator.attrgetter("dtype"), operator.attrgetter("layout")
_IS_NEG, _IS_CONJ = operator.methodcaller("is_neg"), operator.methodcaller("is_conj")


def _numpy_may_root(*tensors: Any) -> bool:
    """Whether NumPy may take the root of these torch tensors (``None`` entries aside): :func:`plain_cpu_tensors`
    with no autograd graph to record, and no graph being traced."""
    import torch

    present = [x for x in tensors if x is not None]
    if not plain_cpu_tensors(present) or (torch.is_grad_enabled() and any(x.requires_grad for x in present)):
        return False
    return not torch.compiler.is_compiling()


def count_nonfinite(x: Array, xp: Namespace) -> int:
    """The number of NaN or Inf entries of ``x``: ``sum(~isfinite(x))`` (``0`` for a finite array).

    The guard of every input check (a step's gradient, the matrix handed to LAPACK).  Float32/float64 NumPy
    arrays are scanned by a numba kernel that only reads ``x`` (:func:`adadiag_ref._kernels.nonfinite_count`);
    other arrays by ``all(isfinite(x))``, counted only when that fails.
    """
    from . import _kernels  # a sibling on the foundation floor; lazily, so that importing _xp stays light

    count = _kernels.nonfinite_count(x)
    if count is not None:
        return count
    if bool(xp.all(xp.isfinite(x))):
        return 0
    return int(xp.sum(xp.astype(~xp.isfinite(x), xp.int32)))


def creation_device(x: Array) -> Any:
    """The ``device=`` to create new arrays next to ``x``.

    A JAX array sharded over several devices reports its sharding as its device;
    that sharding fits only arrays of its own rank, so new arrays (a 0-d counter,
    an ``m x m`` basis) are created with ``device=None`` and left to JAX's placement.
    An uncommitted JAX array (made without a device) also gets ``device=None``:
    committed state beside uncommitted parameters would make ``jax.jit`` compile
    a second time once its outputs (committed) come back as inputs.
    """
    try:
        committed = getattr(x, "committed", True)
    except Exception:  # a jax tracer has no commitment: XLA places what it creates
        committed = True
    if committed is False:
        return None
    dev = array_device(x)
    device_set = getattr(dev, "device_set", None)
    if device_set is not None and len(device_set) > 1:
        return None
    return dev


def float_dtype_name(dtype: Any, xp: Namespace) -> str:
    """Name of a real floating dtype, or raise ``ValueError`` for anything else.

    ``bfloat16`` (torch, jax) is not an array-API dtype, so it is recognised by name.
    """
    for name in ("float64", "float32", "float16"):
        if hasattr(xp, name) and dtype == getattr(xp, name):
            return name
    text = str(dtype)
    if "bfloat16" in text:
        return "bfloat16"
    if "complex" in text:
        raise ValueError(f"complex dtype {text} is not supported: AdaDiag is defined for real parameters")
    raise ValueError(f"dtype {text} is not a supported real floating dtype")


def state_dtype(param_dtype: Any, xp: Namespace, override: str | None = None) -> Any:
    """Dtype of the optimizer state for a parameter of ``param_dtype``.

    float64 parameters keep float64 state (the golden mode); float32, float16 and
    bfloat16 parameters get float32 state, as in mixed-precision training.
    """
    if override is not None:
        return getattr(xp, override)
    name = float_dtype_name(param_dtype, xp)
    return xp.float64 if name == "float64" else xp.float32


def to_numpy(x: Array) -> np.ndarray:
    """Copy an array of any supported backend to a host NumPy array."""
    if isinstance(x, np.ndarray | np.generic):
        return np.asarray(x)
    xp = array_namespace(x)
    if is_numpy_namespace(xp) or is_jax_namespace(xp):
        return np.asarray(x)
    if is_cupy_namespace(xp):
        return x.get()  # type: ignore[no-any-return]
    if is_torch_namespace(xp):
        t = x.detach().cpu()
        if "bfloat16" in str(t.dtype):
            t = t.float()
        return t.numpy()  # type: ignore[no-any-return]
    # array_api_strict and other namespaces: DLPack on the CPU; a library whose arrays have no __dlpack__ (dask,
    # whose arrays are lazy) through NumPy's conversion (for dask: computed)
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return np.asarray(x)


_PACKAGES = ("adadiag_ref", "adadiag_ref.adapters", "torch", "jax", "jaxlib", "optax", "cupy")
"""The packages whose frames :func:`warn_at_caller` steps over (each only when imported already)."""


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside this library, its adapters and
    the frameworks they call back through (torch's optimizer hooks and ``torch.compile``, JAX's callbacks): the
    user's line that called the public function, the optimizer's ``step()`` or the jitted update, however deep the
    library warned.  A fixed ``stacklevel`` names a frame of the library whenever the call came through another of
    its functions (an adapter, the engine, a refresh)."""
    dirs = []
    for name in _PACKAGES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    inside = tuple(dirs)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
