r"""The Adam family's group kernels on CuPy: the engine's step of a flat group without rotation in one launch.

The CUDA counterpart of :class:`~.group_route.NumpyGroup` (:class:`~adadiag_ref.optim.families.registry.
GroupKernels`): a flat group of ``k`` unrotated parameters (AdamW, vectors) is stepped by one launch of
:func:`step_source`'s kernel, whatever ``k``, over the group's flat moments ``M``, ``V`` (``N`` entries): entry
``i`` finds its member ``s`` (``starts[s] <= i < starts[s + 1]``, a binary search over ``k + 1`` numbers that
stay in cache) and its place ``j = i - starts[s]``, reads ``G`` and ``W`` through the member's addresses, and
writes::

    M_t = b1 M + (1 - b1) G,   V_t = b2 V + (1 - b2) G^2,   U = M_t / (sqrt(V_t) + eps)
    W <- W_t + (-eta) (U [+ lambda W_t])

the arithmetic of :data:`~.cupy_route.ADAM_ENTRY` and :func:`~adadiag_ref._kernels.cupy_kernels.tail_expression`,
the very text of the CuPy route's in-place kernel (``_step_in_place_kernel``), whose bits the CPU stand-in checks
against the reference.  So 7 array passes per entry (read ``G, W, M, V``, write ``W, M, V``), nothing gathered,
nothing written back, and the coefficients are the step's host numbers as kernel scalars.  A second kernel
(:func:`nonfinite_source`) counts the gradients' NaN and Inf into a 0-d device integer (one read pass; no
read-back): the engine's verdict.  The step kernel takes the verdict as ``proceed``, a 0-d device boolean, and
writes nothing where it is false, so the engine reads it back once, after everything is queued.  A rotated
group's tail (:func:`tail_source`) writes ``W <- W + (-eta)(D + lambda W)`` through the members' addresses from
the group's flat direction ``D = P U~ Q^T``, gated the same way: its parameters are never gathered.

Compiled with :data:`~adadiag_ref._kernels.cupy_kernels.OPTIONS` (``--fmad=false``: no multiply-add
contraction), one kernel per dtype (``typedef float T`` or ``double``) and decay.  ``tests/test_cupy_group.py``
compiles the sources with NVRTC for ``compute_80`` and ``compute_90`` without a device and checks their PTX;
on a CUDA machine (marked ``gpu``) the engine's results against per-parameter ``ar.step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from array_api_compat import is_cupy_namespace

from ...._kernels import cupy_kernels as ck
from ....config import BaseConfig
from ...schedules import beta_hats
from ...tail import decays
from .cupy_route import ADAM_ENTRY
from .numba_route import kernel_scalars

__all__ = ["CupyGroup", "engine_group", "nonfinite_source", "step_source", "tail_source"]

THREADS = 256
"""Threads per block of both kernels."""

_CTYPE = {"float32": "float", "float64": "double"}

_LOCATE = """\
    int lo = 0, hi = members;  // the member s with starts[s] <= i < starts[s + 1]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (starts[mid] <= i) lo = mid; else hi = mid;
    }
    const long long j = i - starts[lo];
"""

_LOOP = "for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < size; i += (long long)blockDim.x * gridDim.x) {\n"  # noqa: E501


def _name(kind: str, dtype: str, decay: bool = False) -> str:
    return f"adadiag_adam_group_{kind}{'_decay' if decay else ''}_{dtype}"


def step_source(dtype: str, decay: bool) -> str:
    """The CUDA source of the group step kernel for ``dtype`` (``"float32"``, ``"float64"``) and ``decay``
    (``lambda != 0``: the reference adds ``lambda W`` only then)."""
    body = ADAM_ENTRY + f"M[i] = m; V[i] = v; wp[j] = w + {ck.tail_expression('u', 'w', decay)};\n"
    return (
        f"typedef {_CTYPE[dtype]} T;\n"
        f'extern "C" __global__ void {_name("step", dtype, decay)}(\n'
        "    const unsigned long long* w_at, const unsigned long long* g_at, const long long* starts,\n"
        "    const int members, const long long size, T* M, T* V, const bool* proceed,\n"
        "    const T b1, const T c1, const T b2, const T c2, const T eps, const T neg_lr, const T wd) {\n"
        "  if (!proceed[0]) return;  // the verdict: a non-finite gradient somewhere, nothing written\n"
        + _LOOP
        + _LOCATE
        + "    T* wp = reinterpret_cast<T*>(w_at[lo]);\n"
        "    const T x = reinterpret_cast<const T*>(g_at[lo])[j];\n"
        "    const T m0 = M[i]; const T v0 = V[i]; const T w = wp[j];\n"
        + "".join("    " + line + "\n" for line in body.splitlines() if line)
        + "  }\n}\n"
    )


def tail_source(dtype: str, decay: bool) -> str:
    """The CUDA source of a rotated group's tail: ``W <- W + (-eta)(D + lambda W)`` in each member's memory, ``D``
    the group's flat direction."""
    return (
        f"typedef {_CTYPE[dtype]} T;\n"
        f'extern "C" __global__ void {_name("tail", dtype, decay)}(\n'
        "    const unsigned long long* w_at, const long long* starts, const int members, const long long size,\n"
        "    const T* D, const bool* proceed, const T neg_lr, const T wd) {\n"
        "  if (!proceed[0]) return;\n" + _LOOP + _LOCATE + "    T* wp = reinterpret_cast<T*>(w_at[lo]);\n"
        f"    const T w = wp[j];\n    wp[j] = w + {ck.tail_expression('D[i]', 'w', decay)};\n"
        "  }\n}\n"
    )


def nonfinite_source(dtype: str) -> str:
    """The CUDA source of the kernel counting the NaN and Inf entries of the members' gradients into ``bad``."""
    return (
        f"typedef {_CTYPE[dtype]} T;\n"
        f'extern "C" __global__ void {_name("nonfinite", dtype)}(\n'
        "    const unsigned long long* g_at, const long long* starts, const int members, const long long size,\n"
        "    int* bad) {\n"
        + _LOOP
        + _LOCATE
        + "    if (!isfinite(reinterpret_cast<const T*>(g_at[lo])[j])) atomicAdd(bad, 1);\n"
        "  }\n}\n"
    )


_KERNELS: dict[str, Any] = {}


def _kernel(name: str, source: str) -> Any:
    kernel = _KERNELS.get(name)
    if kernel is None:
        import cupy

        kernel = _KERNELS[name] = cupy.RawKernel(source, name, options=ck.OPTIONS)
    return kernel


class CupyGroup:
    """:class:`~adadiag_ref.optim.families.registry.GroupKernels` of the Adam family on CuPy (module docstring)."""

    def __init__(self, cfg: BaseConfig, dtype: Any, sizes: list[int], device: Any) -> None:
        import cupy

        self.cfg, self.dtype, self.sizes = cfg, np.dtype(dtype), sizes
        self.size = int(sum(sizes))
        with cupy.cuda.Device(device.id if hasattr(device, "id") else device):
            self.starts = cupy.asarray(np.cumsum([0, *sizes], dtype=np.int64))
            self.always = cupy.ones((), dtype=cupy.bool_)
        self.device_id = self.starts.device.id
        self.grid = max(1, min(-(-self.size // THREADS), 65535))
        self._tables: dict[str, tuple[tuple[int, ...], Any]] = {}
        self.name = (f"{__name__}: one launch over the members' own memory ({len(sizes)} arrays, {self.size} "
                     "entries): moments and W in place, no gather; the check one more launch")  # fmt: skip

    def _table(self, which: str, arrays: Sequence[Any]) -> Any:
        """The members' addresses on the device, or ``None`` unless each is a C-contiguous CuPy array on the
        group's device (the engine has checked their dtypes and shapes).  The last table is kept and reused
        while the addresses do not change (a model's parameters, and gradient buffers that are reused, keep
        theirs): no host-to-device copy then."""
        import cupy

        if not all(
            isinstance(a, cupy.ndarray) and a.flags.c_contiguous and a.device.id == self.device_id for a in arrays
        ):
            return None
        addresses = tuple(int(a.data.ptr) for a in arrays)
        kept = self._tables.get(which)
        if kept is None or kept[0] != addresses:
            kept = self._tables[which] = (addresses, cupy.asarray(np.array(addresses, dtype=np.uint64)))
        return kept[1]

    def prepare(self, params: Sequence[Any], grads: Sequence[Any] | None, eta: Any) -> tuple[Any, Any, Any] | None:
        if isinstance(eta, bool) or not isinstance(eta, int | float):
            return None
        w_at = self._table("W", params)
        if w_at is None or grads is None:  # grads=None: the tail only
            return None if w_at is None else (w_at, None, eta)
        g_at = self._table("G", grads)
        return None if g_at is None else (w_at, g_at, eta)

    def _launch(self, kernel: Any, *args: Any) -> None:
        kernel((self.grid,), (THREADS,), (*args,))

    def nonfinite(self, prepared: tuple[Any, Any, Any]) -> Any:
        import cupy

        bad = cupy.zeros((), dtype=cupy.int32)
        kernel = _kernel(_name("nonfinite", self.dtype.name), nonfinite_source(self.dtype.name))
        self._launch(kernel, prepared[1], self.starts, np.int32(len(self.sizes)), np.int64(self.size), bad)
        return bad

    def step(self, prepared: tuple[Any, Any, Any], moments: Mapping[str, Any], t: Any, proceed: Any = None) -> None:
        w_at, g_at, eta = prepared
        b1_t, b2_t = beta_hats(self.cfg, t, np)
        *sc, decay = kernel_scalars(b1_t, b2_t, self.cfg, eta, self.dtype)
        kernel = _kernel(_name("step", self.dtype.name, decay), step_source(self.dtype.name, decay))
        flag = self.always if proceed is None else proceed
        self._launch(kernel, w_at, g_at, self.starts, np.int32(len(self.sizes)), np.int64(self.size),
                     moments["M"], moments["V"], flag, *sc)  # fmt: skip

    def tail(self, prepared: tuple[Any, Any, Any], direction: Any, proceed: Any = None) -> None:
        w_at, _, eta = prepared
        neg_lr, wd = np.asarray(-eta, self.dtype)[()], np.asarray(self.cfg.weight_decay, self.dtype)[()]
        decay = decays(self.cfg)
        kernel = _kernel(_name("tail", self.dtype.name, decay), tail_source(self.dtype.name, decay))
        flag = self.always if proceed is None else proceed
        self._launch(kernel, w_at, self.starts, np.int32(len(self.sizes)), np.int64(self.size), direction, flag,
                     neg_lr, wd)  # fmt: skip


def engine_group(cfg: BaseConfig, dtype: Any, sizes: list[int], device: Any, xp: Any) -> CupyGroup | None:
    """The Adam family's :attr:`~adadiag_ref.optim.families.registry.Routes.group` factory on CuPy: a
    :class:`CupyGroup` when ``xp`` is CuPy's, ``cfg.kernels == "auto"`` and ``dtype`` float32 or float64; else
    ``None``."""
    if not is_cupy_namespace(xp) or getattr(cfg, "kernels", "auto") != "auto":
        return None
    if np.dtype(dtype) not in (np.float32, np.float64):
        return None
    return CupyGroup(cfg, dtype, sizes, device)
