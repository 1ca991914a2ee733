"""torch's own CPU square root, callable from numba kernels: MKL VML's ``vmsSqrt``/``vmdSqrt`` in ``libtorch_cpu``.

On MKL builds (the x86-64 Linux and Windows wheels) eager ``torch.sqrt`` of a CPU float32/float64 tensor is
``at::vml::vsqrt``, i.e. MKL VML's ``vm?Sqrt(n, a, r, VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE)`` over the
chunks of torch's ``parallel_for``.  That root is not always the correctly rounded one (on an AMD EPYC, 17 % of
random float32 entries and 1.3 % of float64 ones differ from NumPy's by one ulp), so a kernel that takes its
own ``sqrt`` is not bit-identical to the torch reference route.  This module finds those two functions in the
library torch has already loaded, checks once, on a probe spanning the exponent range, subnormals, zeros and
``inf``, that they give ``torch.sqrt``'s bits, and then exposes them to numba as :data:`vms_sqrt`,
:data:`vmd_sqrt` (external symbols registered with LLVM, so the kernels that call them stay in numba's
on-disk cache).  VML's results are elementwise: they do not depend on how an array is cut into chunks
(``tests/test_kernels.py`` checks that too).

:func:`available` is ``False`` (and the callers keep ``torch.sqrt``) when torch is not imported, the build has
no MKL (macOS, aarch64), the symbols are not exported, numba is missing, or the probe differs.  Never imports
torch itself.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import numpy as np

__all__ = ["MODE", "available", "vmd_sqrt", "vms_sqrt"]

#: ``VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE``: the mode ``at::vml`` passes (aten/src/ATen/cpu/vml.h).
MODE = 0x00000002 | 0x00140000 | 0x00000100

_SYMBOLS = {
    np.dtype(np.float32): ("vmsSqrt", "adadiag_ref_vms_sqrt"),
    np.dtype(np.float64): ("vmdSqrt", "adadiag_ref_vmd_sqrt"),
}

try:
    import numba
    from llvmlite import binding as _llvm

    # void vm?Sqrt(MKL_INT n, const T *a, T *r, MKL_INT64 mode), LP64 (MKL_INT = int, as torch uses it); the
    # pointers are passed as integers (``array.ctypes.data``), the same registers in the x86-64 and Win64 ABIs
    _SIGNATURE = numba.types.void(numba.types.intc, numba.types.uintp, numba.types.uintp, numba.types.int64)
    vms_sqrt: Any = numba.types.ExternalFunction("adadiag_ref_vms_sqrt", _SIGNATURE)
    vmd_sqrt: Any = numba.types.ExternalFunction("adadiag_ref_vmd_sqrt", _SIGNATURE)
    # int MKL_Set_Num_Threads_Local(int): the calling thread's MKL thread count (0: back to the global one)
    local_threads: Any = numba.types.ExternalFunction(
        "adadiag_ref_mkl_local_threads", numba.types.intc(numba.types.intc)
    )
except ImportError:  # pragma: no cover - exercised only without numba
    numba = None  # type: ignore[assignment]
    vms_sqrt = vmd_sqrt = local_threads = None

_state: dict[str, Any] = {}


def _library() -> Any:
    """``libtorch_cpu`` as torch loaded it, or ``None``."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.__file__:
        return None
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path)
            except OSError:  # pragma: no cover - a library torch itself loaded
                return None
    return None  # pragma: no cover - every torch wheel ships one of them


def probe(dtype: Any) -> np.ndarray:
    """Inputs on which ``torch.sqrt`` and VML must agree: zeros, subnormals, ``inf``, the largest finite value,
    and random mantissas over the whole exponent range (the checked values of :func:`available`)."""
    dt = np.dtype(dtype)
    info = np.finfo(dt)
    rng = np.random.default_rng(31)
    exponents = rng.uniform(np.log2(float(info.smallest_subnormal)), np.log2(float(info.max)) - 1, 1 << 14)
    random = np.exp2(exponents) * rng.uniform(1.0, 2.0, exponents.size)
    special = [0.0, -0.0, float(info.smallest_subnormal), float(info.smallest_normal), float(info.max), np.inf]
    special += [1.0, 2.0]
    return np.concatenate([np.asarray(special, dtype=dt), random.astype(dt)])


def _check(fn: Any, dtype: Any) -> bool:
    """Whether ``fn`` gives ``torch.sqrt``'s bits on :func:`probe`, called whole and in odd chunks."""
    torch = sys.modules["torch"]
    x = probe(dtype)
    expected = torch.sqrt(torch.from_numpy(x)).numpy()
    for chunk in (x.size, 1237):
        out = np.full_like(x, np.nan)
        for start in range(0, x.size, chunk):
            stop = min(start + chunk, x.size)
            fn(stop - start, x[start:].ctypes.data, out[start:].ctypes.data, MODE)
        if not np.array_equal(out.view(f"u{x.itemsize}"), expected.view(f"u{x.itemsize}")):
            return False
    return True


def available() -> bool:
    """Whether the kernels may call :data:`vms_sqrt` and :data:`vmd_sqrt`: torch imported, its MKL square roots
    found and registered with LLVM, and bit-identical to ``torch.sqrt`` on :func:`probe` (decided once)."""
    if "ok" in _state:
        return bool(_state["ok"])
    if numba is None or "torch" not in sys.modules:
        return False  # not cached: torch may be imported later
    ok = False
    lib = _library()
    if lib is not None:
        try:
            functions = {dt: getattr(lib, symbol) for dt, (symbol, _) in _SYMBOLS.items()}
            threads = lib.MKL_Set_Num_Threads_Local  # the C interface (lower case is the Fortran one)
        except AttributeError:  # a build without MKL: torch.sqrt is not VML's
            functions = {}
        if functions:
            for fn in functions.values():
                fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
                fn.restype = None
            ok = all(_check(fn, dt) for dt, fn in functions.items())
            if ok:
                for dt, fn in functions.items():
                    _llvm.add_symbol(_SYMBOLS[dt][1], ctypes.cast(fn, ctypes.c_void_p).value)
                _llvm.add_symbol("adadiag_ref_mkl_local_threads", ctypes.cast(threads, ctypes.c_void_p).value)
    _state["ok"] = ok
    return ok


def sqrt_into(src: Any, dst: Any) -> None:
    """``dst = sqrt(src)`` by torch's VML root, on contiguous 1-D float32/float64 arrays of one size and dtype;
    callable only from numba kernels (and only once :func:`available` returned ``True``)."""
    raise NotImplementedError("sqrt_into is called from numba kernels")


if numba is not None:
    from numba.extending import overload

    @overload(sqrt_into)
    def _sqrt_into(src: Any, dst: Any) -> Any:
        if src.dtype == numba.types.float32:
            fn = vms_sqrt
        elif src.dtype == numba.types.float64:
            fn = vmd_sqrt
        else:  # pragma: no cover - the kernels take float32/float64 only
            return None
        mode = MODE

        def impl(src: Any, dst: Any) -> None:
            fn(np.int32(src.shape[0]), src.ctypes.data, dst.ctypes.data, mode)

        return impl
