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
the very text of the CuPy route's update kernels, whose bits the CPU stand-in checks against the reference.
So 7 array passes per entry (read ``G, W, M, V``, write ``W, M, V``), nothing gathered,
nothing written back, and the coefficients are the step's host numbers as kernel scalars.  A second kernel
(:func:`nonfinite_source`) counts the gradients' NaN and Inf into a 0-d device integer (one read pass; no
read-back): the engine's verdict.  The step kernel takes the verdict as ``proceed``, a 0-d device boolean, and
writes nothing where it is false, so the engine reads it back once, after everything is queued.  A rotated
group's tail (:func:`tail_source`) writes ``W <- W + (-eta)(D + lambda W)`` through the members' addresses from
the group's flat direction ``D = P U~ Q^T``, gated the same way: its parameters are never gathered.

Launched through a *launcher* (:class:`CudaGroup` takes one): :class:`CupyLauncher` for CuPy arrays, and
:class:`TorchCudaLauncher` for torch CUDA tensors (an engine over torch parameters on CUDA, where CuPy is
installed: their ``data_ptr()`` as the pointers, the launch on torch's current stream).  Kernels written through
raw addresses do not bump torch's version counters.

Compiled with :data:`~adadiag_ref._kernels.cupy_kernels.OPTIONS` (``--fmad=false``: no multiply-add
contraction), one kernel per dtype (``typedef float T`` or ``double``) and decay.  ``tests/test_cupy_kernels.py``
compiles the sources with NVRTC for ``compute_80`` and ``compute_90`` without a device and checks their PTX, and
runs the engine on the very kernels compiled as C++ for the host through a launcher of its own (the bits of
``ar.step``; a NaN's device verdict gating the launches); on a CUDA machine (marked ``gpu``) the engine's results
against per-parameter ``ar.step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from array_api_compat import is_cupy_namespace, is_torch_namespace

from ...._kernels import cupy_kernels as ck
from ...._kernels import scalar
from ...._xp import warn_at_caller
from ....config import BaseConfig
from ...schedules import beta_hats, host_step
from ...tail import decayed_step, decays
from .cupy_route import ADAM_ENTRY
from .group_route import Prepared, disjoint, prepare_members
from .numba_route import kernel_scalars
from .reference import AdamState, direction

__all__ = [
    "CudaGroup",
    "CupyLauncher",
    "TorchCudaLauncher",
    "engine_group",
    "launcher_for",
    "moments_source",
    "nonfinite_source",
    "probe",
    "ready",
    "step_source",
    "tail_source",
]

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
    (``lambda != 0``: the reference adds ``lambda W`` only then): entry ``i`` of the group's flat ``M``, ``V`` (the
    engine's persistent buffers), entry ``j`` of its member's ``G`` and ``W``."""
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
        + "    const T x = reinterpret_cast<const T*>(g_at[lo])[j];\n"
        "    const T m0 = M[i]; const T v0 = V[i]; const T w = wp[j];\n"
        + "".join("    " + line + "\n" for line in body.splitlines() if line)
        + "  }\n}\n"
    )


def moments_source(dtype: str) -> str:
    """The CUDA source of a rotated group's moments in place: over the group's flat arrays, ``M_t``, ``V_t`` written
    over ``M``, ``V`` and ``U~ = M_t / (sqrt(V_t) + eps)`` over ``G~`` (the engine's own array), the arithmetic
    of :func:`step_source`: 6 array passes per entry (read ``G~, M, V``, write ``M, V, U~``)."""
    body = ADAM_ENTRY + "M[i] = m; V[i] = v; G[i] = u;\n"
    return (
        f"typedef {_CTYPE[dtype]} T;\n"
        f'extern "C" __global__ void {_name("moments", dtype)}(\n'
        "    T* G, T* M, T* V, const long long size, const bool* proceed, const T b1, const T c1, const T b2,\n"
        "    const T c2, const T eps) {\n"
        "  if (!proceed[0]) return;\n"
        + _LOOP
        + "    const T x = G[i]; const T m0 = M[i]; const T v0 = V[i];\n"
        + "".join("    " + line + "\n" for line in body.splitlines() if line)
        + "  }\n}\n"
    )


def tail_source(dtype: str, decay: bool) -> str:
    """The CUDA source of a rotated group's tail: ``W <- W + (-eta)(D + lambda W)`` in each member's memory, ``D``
    the group's flat direction at the entry's place ``i``."""
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


class CupyLauncher:
    """What :class:`CudaGroup` needs of a backend, for CuPy arrays: their addresses, small device arrays, and a
    kernel launch (``cupy.RawKernel``, compiled once per name) on CuPy's current stream."""

    def __init__(self, device: Any) -> None:
        import cupy

        self.cupy = cupy
        self.device_id = device.id if hasattr(device, "id") else int(device)

    def address(self, a: Any) -> int | None:
        """The address of ``a``'s first entry, or ``None`` unless it is a C-contiguous array on the device."""
        if not isinstance(a, self.cupy.ndarray) or not a.flags.c_contiguous or a.device.id != self.device_id:
            return None
        return int(a.data.ptr)

    def upload(self, table: np.ndarray) -> Any:
        with self.cupy.cuda.Device(self.device_id):
            return self.cupy.asarray(table)

    def zeros_int32(self) -> Any:
        with self.cupy.cuda.Device(self.device_id):
            return self.cupy.zeros((), dtype=self.cupy.int32)

    def true(self) -> Any:
        with self.cupy.cuda.Device(self.device_id):
            return self.cupy.ones((), dtype=self.cupy.bool_)

    def launch(self, name: str, source: str, grid: int, args: tuple[Any, ...]) -> None:
        with self.cupy.cuda.Device(self.device_id):
            _kernel(name, source)((grid,), (THREADS,), args)


class TorchCudaLauncher(CupyLauncher):
    """:class:`CupyLauncher` for torch CUDA tensors: their ``data_ptr()`` passed as the kernels' pointers, the
    launch on torch's current stream (``cupy.cuda.ExternalStream``), so it is ordered with torch's own work;
    the small arrays are torch tensors.  Needs CuPy for the compilation and the launch."""

    def __init__(self, device: Any) -> None:
        import torch

        super().__init__(device.index if device.index is not None else torch.cuda.current_device())
        self.torch = torch

    def address(self, a: Any) -> int | None:
        torch = self.torch
        if not isinstance(a, torch.Tensor) or not a.is_cuda or a.device.index != self.device_id:
            return None
        return int(a.data_ptr()) if a.is_contiguous() else None

    def upload(self, table: np.ndarray) -> Any:
        # from pinned memory, asynchronously: torch's copy from pageable memory waits for the stream's queued work
        # (the backward pass) before returning; torch's pinned allocator keeps the buffer until the copy is done
        host = self.torch.from_numpy(table.astype(np.int64, copy=False))
        return host.pin_memory().to(f"cuda:{self.device_id}", non_blocking=True)

    def zeros_int32(self) -> Any:
        return self.torch.zeros((), dtype=self.torch.int32, device=f"cuda:{self.device_id}")

    def true(self) -> Any:
        return self.torch.ones((), dtype=self.torch.bool, device=f"cuda:{self.device_id}")

    def launch(self, name: str, source: str, grid: int, args: tuple[Any, ...]) -> None:
        torch, cupy = self.torch, self.cupy
        pointers = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args)
        stream = torch.cuda.current_stream(self.device_id)
        with cupy.cuda.Device(self.device_id), cupy.cuda.ExternalStream(stream.cuda_stream, self.device_id):
            _kernel(name, source)((grid,), (THREADS,), pointers)


class CudaGroup:
    """:class:`~adadiag_ref.optim.families.registry.GroupKernels` of the Adam family in CUDA (module docstring),
    launched by ``launcher`` (:class:`CupyLauncher`, :class:`TorchCudaLauncher`; the tests run the same kernels
    compiled for the host through a launcher of their own)."""

    def __init__(self, cfg: BaseConfig, dtype: Any, sizes: list[int], launcher: Any) -> None:
        self.cfg, self.dtype, self.sizes, self.launcher = cfg, np.dtype(dtype), sizes, launcher
        self.size = int(sum(sizes))
        self.starts = launcher.upload(np.cumsum([0, *sizes], dtype=np.int64))
        self.always = launcher.true()
        self.grid = max(1, min(-(-self.size // THREADS), 65535))
        self._tables: dict[str, tuple[tuple[int, ...], Any]] = {}
        self.name = (f"{__name__} ({type(launcher).__name__}): one launch over the members' own memory "
                     f"({len(sizes)} arrays, {self.size} entries): moments and W in place, no gather; the check "
                     "one more launch")  # fmt: skip
        self.tail_name = (f"{__name__} ({type(launcher).__name__}): one launch over the members' own memory: "
                          "W <- W - eta (D + lambda W)")  # fmt: skip
        self.moments_name = (f"{__name__} ({type(launcher).__name__}): one launch over the flat M, V and G~: M_t, "
                             "V_t, U~ over G~, gated by the verdict")  # fmt: skip

    def _table(self, which: str, arrays: Sequence[Any]) -> Any:
        """The members' addresses on the device, or ``None`` unless the launcher can address each (dense, on the
        group's device; the engine has checked dtypes and shapes).  The last table is kept and reused while the
        addresses do not change (a model's parameters, and gradient buffers that are reused, keep theirs): no
        host-to-device copy then."""
        addresses = []
        for a in arrays:
            address = self.launcher.address(a)
            if address is None:
                return None
            addresses.append(address)
        key = tuple(addresses)
        kept = self._tables.get(which)
        if kept is None or kept[0] != key:
            if which == "W" and not disjoint(key, self.sizes, self.dtype.itemsize):
                return None  # arrays sharing memory: the gathering path
            kept = self._tables[which] = (key, self.launcher.upload(np.array(key, dtype=np.uint64)))
        return kept[1]

    def prepare(
        self, params: Sequence[Any] | None, grads: Sequence[Any] | None, eta: Any, cfg: BaseConfig
    ) -> Prepared | None:
        if decays(cfg) != decays(self.cfg):  # a step's weight decay on or off: a variant ready() did not probe
            return None
        return prepare_members(eta, cfg, None if params is None else lambda: self._table("W", params),
                               None if grads is None else lambda: self._table("G", grads))  # fmt: skip

    def _launch(self, name: str, source: str, *args: Any) -> None:
        self.launcher.launch(name, source, self.grid, (*args,))

    def _flag(self, proceed: Any) -> Any:
        """The kernels' ``proceed``: the caller's device verdict, or a device ``true``."""
        return self.always if proceed is None else proceed

    def _members(self) -> tuple[Any, Any, Any]:
        return self.starts, np.int32(len(self.sizes)), np.int64(self.size)

    def nonfinite(self, prepared: Prepared) -> Any:
        bad = self.launcher.zeros_int32()
        dtype = self.dtype.name
        self._launch(_name("nonfinite", dtype), nonfinite_source(dtype), prepared.g_at, *self._members(), bad)
        return bad

    def step(self, prepared: Prepared, moments: Mapping[str, Any], t: Any, proceed: Any = None) -> None:
        w_at, g_at, eta, cfg = prepared
        *sc, decay = kernel_scalars(*beta_hats(cfg, t, np), cfg, eta, self.dtype)
        dtype = self.dtype.name
        self._launch(_name("step", dtype, decay), step_source(dtype, decay), w_at, g_at, *self._members(),
                     moments["M"], moments["V"], self._flag(proceed), *sc)  # fmt: skip

    def tail(self, prepared: Prepared, direction: Any, proceed: Any = None) -> None:
        w_at, _, eta, cfg = prepared
        neg_lr, wd = scalar(-eta, self.dtype), scalar(cfg.weight_decay, self.dtype)
        decay, dtype = decays(cfg), self.dtype.name
        self._launch(_name("tail", dtype, decay), tail_source(dtype, decay), w_at, *self._members(), direction,
                     self._flag(proceed), neg_lr, wd)  # fmt: skip

    def moments(self, prepared: Prepared, moments: Mapping[str, Any], g_rot: Any, t: Any, proceed: Any = None) -> bool:
        """One launch of :func:`moments_source` over the flat ``G~`` and moments, gated by ``proceed``; ``False``,
        having launched nothing, unless the launcher can address the three."""
        arrays = (g_rot, moments["M"], moments["V"])
        if any(self.launcher.address(a) is None for a in arrays):
            return False
        cfg = prepared.cfg
        b1, c1, b2, c2, eps, *_ = kernel_scalars(*beta_hats(cfg, t, np), cfg, 0.0, self.dtype)
        dtype = self.dtype.name
        self._launch(_name("moments", dtype), moments_source(dtype), *arrays, np.int64(self.size),
                     self._flag(proceed), b1, c1, b2, c2, eps)  # fmt: skip
        return True


def _float_name(dtype: Any) -> str | None:
    """``"float32"`` or ``"float64"`` for a NumPy/CuPy or torch dtype, else ``None``."""
    name = str(dtype).rsplit(".", 1)[-1]
    return name if name in ("float32", "float64") else None


_READY: dict[tuple[Any, ...], bool] = {}
"""Probed once per process: (launcher type, dtype, device, decay) -> whether the kernels passed (:func:`ready`)."""


def probe(group: CudaGroup, xp: Any, device: Any) -> str | None:
    """Every launch of ``group``'s kernels (a group of two members of 1 and 2 entries, at step ``t = 3``) against the
    reference's arithmetic in ``xp``'s own operations on ``device`` (the family's :func:`~.reference.direction`, the
    tail :func:`~adadiag_ref.optim.tail.decayed_step`): ``None`` when every result is the same bit for bit, else
    what differed.  The launches: :meth:`CudaGroup.step`, :meth:`CudaGroup.moments` and :meth:`CudaGroup.tail`."""
    kind = getattr(xp, group.dtype.name)

    def arrays(*values: tuple[float, ...]) -> list[Any]:
        return [xp.asarray(v, dtype=kind, device=device) for v in values]

    W, G, M, V = (arrays(*pair) for pair in (((1.5,), (-0.5, 2.0)), ((0.25,), (-1.0, 0.5)), ((0.1,), (0.2, -0.3)),
                                              ((0.4,), (0.5, 0.6))))  # fmt: skip
    eta, cfg, t = 0.125, group.cfg, host_step(2, group.dtype, np)
    w, g = xp.concat(W), xp.concat(G)
    u, new = direction(AdamState(count=None, P=None, Q=None, M=xp.concat(M), V=xp.concat(V)), g, t, cfg, xp)
    wanted = {"step": (w + decayed_step(u, w, eta, cfg, owned=False), new["M"], new["V"]),
              "moments": (u, new["M"], new["V"]), "tail": (w + decayed_step(g, w, eta, cfg, owned=False),)}  # fmt: skip
    params, moments = [xp.asarray(x, copy=True) for x in W], {"M": xp.concat(M), "V": xp.concat(V)}
    group.step(group.prepare(params, G, eta, cfg), moments, t)  # type: ignore[arg-type]
    got: dict[str, tuple[Any, ...]] = {"step": (xp.concat(params), moments["M"], moments["V"])}
    g_rot, moments = xp.concat(G), {"M": xp.concat(M), "V": xp.concat(V)}
    group.moments(Prepared(None, None, eta, cfg), moments, g_rot, t)
    got["moments"] = (g_rot, moments["M"], moments["V"])
    params = [xp.asarray(x, copy=True) for x in W]
    group.tail(group.prepare(params, None, eta, cfg), g)  # type: ignore[arg-type]
    got["tail"] = (xp.concat(params),)
    for kernel, expected in wanted.items():
        for want, have in zip(expected, got[kernel], strict=True):
            if not bool(xp.all(want == have)):
                return f"{kernel} gave {[float(v) for v in have]} where {xp.__name__} gives {[float(v) for v in want]}"
    return None


def ready(cfg: BaseConfig, dtype: str, launcher: Any, xp: Any, device: Any) -> bool:
    """Whether the group kernels of ``cfg`` and ``dtype`` pass :func:`probe` through ``launcher`` on ``device``: run
    once per process, launcher type, dtype, device and decay.  A probe that raises (a compiler or a CuPy the device
    cannot use) or disagrees warns once (``RuntimeWarning``) and answers ``False``: the engine's gathering path
    steps instead."""
    key = (type(launcher), dtype, str(device), decays(cfg))
    found = _READY.get(key)
    if found is None:
        try:
            problem = probe(CudaGroup(cfg, dtype, [1, 2], launcher), xp, device)
        except Exception as exc:  # any failure of a device path means: not this route
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            warn_at_caller(
                f"adadiag_ref: the CUDA group kernels failed their probe on {device} ({dtype}): {problem}; the "
                "array route steps these parameters instead",
                RuntimeWarning,
            )
        found = _READY[key] = problem is None
    return found


def launcher_for(cfg: BaseConfig, dtype: Any, device: Any, xp: Any) -> CupyLauncher | None:
    """The launcher of the group kernels for ``xp``'s arrays of ``dtype`` on ``device``: :class:`CupyLauncher` for
    CuPy arrays, :class:`TorchCudaLauncher` for torch CUDA tensors where CuPy is installed; ``None`` otherwise, or
    when ``cfg.kernels != "auto"`` or ``dtype`` is not float32 or float64.  Not probed (:func:`ready`)."""
    if getattr(cfg, "kernels", "auto") != "auto" or _float_name(dtype) is None:
        return None
    if is_cupy_namespace(xp):
        return CupyLauncher(device)
    if is_torch_namespace(xp) and getattr(device, "type", None) == "cuda":
        try:
            import cupy  # noqa: F401  (compiles and launches the kernels)
        except ImportError:
            return None
        return TorchCudaLauncher(device)
    return None


def engine_group(cfg: BaseConfig, dtype: Any, sizes: list[int], device: Any, xp: Any) -> CudaGroup | None:
    """The Adam family's :attr:`~adadiag_ref.optim.families.registry.Routes.group` factory for CUDA: a
    :class:`CudaGroup` through :func:`launcher_for`'s launcher when there is one and the kernels pass their probe
    (:func:`ready`); else ``None``."""
    launcher = launcher_for(cfg, dtype, device, xp)
    name = _float_name(dtype)
    if launcher is None or name is None or not ready(cfg, name, launcher, xp, device):
        return None
    return CudaGroup(cfg, name, sizes, launcher)
