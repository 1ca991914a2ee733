"""The Adam family's group kernels: the entrywise part of a step of *many* CPU tensors in one numba call each.

The torch adapter's default CPU route (:mod:`adadiag_ref.adapters.pytorch`) steps every parameter of a group
(one dtype, one step ``t``, no refresh due) with four kernel calls in all, whatever the
number of parameters: the kernels receive the addresses of the parameters', gradients' and moments' memory
(``Tensor.data_ptr()``) and their sizes, and walk them one after the other.  The arithmetic is the torch CPU
route's (:mod:`.torch_route`), entry for entry: the same formulas (:func:`~.numba_route._second_moment_entry`,
:func:`~adadiag_ref._kernels.ema_entry`, :func:`~adadiag_ref._kernels.delta_entry`), the same coefficients,
``V_t`` in one flat scratch, its root the correctly rounded one taken inside the kernels (the library's,
:func:`adadiag_ref._xp.sqrt`); so the results are those of ``update_in_place`` bit for
bit (``tests/test_adapter_torch.py`` compares them with the core's ``ar.step``).

The callers guarantee what the kernels cannot check: every address is that of a dense tensor of the scratch's
dtype, with ``sizes[i]`` entries, and all arrays of one parameter lie in one memory order (the work frame's
strides alike, :func:`adadiag_ref._kernels.alike`).

* :func:`second_moment`: ``V_t = b2 V + c2 X^2`` into the flat scratch (``X = G~``, ``G`` itself without a
  basis) and the number of NaN or Inf entries of each gradient ``G`` (the step's finiteness check, read from
  host memory: no pass of its own);
* :func:`apply_unrotated`: ``M <- b1 M + c1 G``, ``V <- V_t``, ``W <- W + (-eta) (M_t / (sqrt(V_t) + eps)
  [+ lambda W])`` in place, given ``V_t`` in the scratch;
* :func:`direction_rotated`: ``M_t`` into the scratch's second row and ``U~ = M_t / (sqrt(V_t) + eps)``
  over ``G~`` (this step's own GEMM output); nothing of the state written;
* :func:`read_counters`, :func:`advance_counters`: the int32 host step counters read and advanced in place (one
  call each instead of a stack and a ``torch._foreach_add_`` over 0-d tensors, 0.2 ms for 75 of them);
* :func:`apply_rotated`: after the caller's GEMMs ``D = P U~ Q^T``: ``W <- W + (-eta) (D + lambda W)``,
  ``M <- M_t``, ``V <- V_t``.

The parameters above the group kernels' size (the adapter's large lane: one pass over each array, the root taken
inside the kernels, each call over the rows of a chunk table so that ``torch_route.split_rows`` can cut it between
threads):

* :func:`nonfinite_at`: the number of NaN or Inf entries of all their gradients (one read, before any write);
* :func:`step_at`: the unrotated ones' whole step in place;
* :func:`moments_at`: a rotated one's ``M <- M_t``, ``V <- V_t`` in place and ``U~`` over ``G~``; its tail
  ``W <- W + (-eta) (D + lambda W)`` is the engine's :func:`engine_tail`.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from array_api_compat import is_numpy_namespace, is_torch_namespace

from .... import _kernels
from ...._kernels import delta_entry, ema_entry, is_host_number, prange, scalar
from ...._xp import Namespace, float_dtype_name, plain_cpu_tensor
from ....config import BaseConfig
from ...schedules import beta_hats
from ...tail import decays
from .numba_route import (
    _adam_step_span,
    _second_moment_entry,
    adam_moments_own_flat,
    adam_step_in_place_flat,
    kernel_scalars,
)
from .torch_route import split_rows

__all__ = [
    "AVAILABLE",
    "NumpyGroup",
    "Prepared",
    "addresses",
    "advance_counters",
    "apply_rotated",
    "apply_unrotated",
    "chunk_table",
    "direction_rotated",
    "disjoint",
    "engine_group",
    "moments_at",
    "prepare_members",
    "read_counters",
    "second_moment",
    "step_at",
]

AVAILABLE = _kernels.AVAILABLE

_array: Any = None
"""``_array(address, size, like)``: the ``size`` entries at ``address`` as a 1-D array of ``like``'s dtype."""

if AVAILABLE:
    import numba
    from numba import types
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[misc]
    def _pointer(typingctx: Any, address: Any, like: Any) -> Any:
        """The address ``address`` (an int64) as a pointer to ``like``'s dtype (``numba.carray`` reads it)."""
        pointer = types.CPointer(like.dtype)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(pointer))

        return pointer(address, like), codegen

    def _carray(address: Any, size: Any, like: Any) -> Any:
        return numba.carray(_pointer(address, like), size)  # type: ignore[call-arg]

    _array = numba.njit(inline="always")(_carray)


def _second_moment(g_at, x_at, v_at, sizes, offsets, b2, c2, vt, bad):  # type: ignore[no-untyped-def]
    for i in range(sizes.shape[0]):
        n, o = sizes[i], offsets[i]
        g = _array(g_at[i], n, vt)
        count = 0
        for k in range(n):
            count += not np.isfinite(g[k])
        bad[i] = count
        x = _array(x_at[i], n, vt)
        v = _array(v_at[i], n, vt)
        for k in range(n):
            vt[o + k] = _second_moment_entry(v[k], x[k], b2, c2)


def _apply_unrotated(w_at, g_at, m_at, v_at, sizes, offsets, b1, c1, eps, neg_lr, wd, decay, vt):  # type: ignore[no-untyped-def]
    for i in range(sizes.shape[0]):
        n, o = sizes[i], offsets[i]
        W = _array(w_at[i], n, vt)
        g = _array(g_at[i], n, vt)
        M = _array(m_at[i], n, vt)
        V = _array(v_at[i], n, vt)
        new_V = vt[o : o + n]
        for k in range(n):
            w = W[k]
            m = ema_entry(M[k], g[k], b1, c1)
            v = new_V[k]
            M[k] = m
            V[k] = v
            W[k] = w + delta_entry(m / (math.sqrt(v) + eps), w, neg_lr, wd, decay)


def _direction_rotated(m_at, gu_at, sizes, offsets, b1, c1, eps, vt, mt):  # type: ignore[no-untyped-def]
    for i in range(sizes.shape[0]):
        n, o = sizes[i], offsets[i]
        M0 = _array(m_at[i], n, mt)
        GU = _array(gu_at[i], n, mt)
        new_V, new_M = vt[o : o + n], mt[o : o + n]
        for k in range(n):
            m = ema_entry(M0[k], GU[k], b1, c1)
            GU[k] = m / (math.sqrt(new_V[k]) + eps)
            new_M[k] = m


def _apply_rotated(w_at, d_at, m_at, v_at, sizes, offsets, neg_lr, wd, decay, mt, vt):  # type: ignore[no-untyped-def]
    for i in range(sizes.shape[0]):
        n, o = sizes[i], offsets[i]
        W = _array(w_at[i], n, vt)
        D = _array(d_at[i], n, vt)
        M = _array(m_at[i], n, vt)
        V = _array(v_at[i], n, vt)
        for k in range(n):
            w = W[k]
            W[k] = w + delta_entry(D[k], w, neg_lr, wd, decay)
            M[k] = mt[o + k]
            V[k] = vt[o + k]


def _read_counters(c_at, out):  # type: ignore[no-untyped-def]
    """``out[i]`` = the int32 counter at ``c_at[i]``; returns whether they are all equal."""
    same = True
    for i in range(c_at.shape[0]):
        out[i] = _array(c_at[i], 1, out)[0]
        same = same and out[i] == out[0]
    return same


def _advance_counters(c_at, like):  # type: ignore[no-untyped-def]
    """Each int32 counter at ``c_at[i]`` += 1 (torch's ``"step"`` tensors, written in host memory)."""
    for i in range(c_at.shape[0]):
        c = _array(c_at[i], 1, like)
        c[0] += 1


def _engine_step(w_at, g_at, chunks, offsets, M, V, b1, c1, b2, c2, eps, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """The engine's unrotated flat group in place: per chunk ``(member, lo, hi)`` of the members' entries,
    ``M, V <- M_t, V_t`` at the member's offset in the flat moments and ``W <- W + (-eta)(U + lambda W)`` in the
    member's own memory (:func:`~.numba_route._adam_entry`, :func:`~adadiag_ref._kernels.delta_entry`)."""
    for c in prange(chunks.shape[0]):
        i, lo, hi = chunks[c, 0], chunks[c, 1], chunks[c, 2]
        o = offsets[i]
        W = _array(w_at[i], hi, M)
        g = _array(g_at[i], hi, M)
        _adam_step_span(W[lo:hi], g[lo:hi], M[o + lo : o + hi], V[o + lo : o + hi], b1, c1, b2, c2, eps, neg_lr, wd,
                   decay)  # fmt: skip


def _engine_tail(w_at, chunks, offsets, D, neg_lr, wd, decay):  # type: ignore[no-untyped-def]
    """The tail of a rotated flat group in place: ``W <- W + (-eta)(D + lambda W)`` in each member's own memory,
    ``D = P U~ Q^T`` the group's flat direction (the members' spans at their offsets), per span the shared
    :func:`adadiag_ref._kernels.apply_direction_flat`."""
    for c in prange(chunks.shape[0]):
        i, lo, hi = chunks[c, 0], chunks[c, 1], chunks[c, 2]
        o = offsets[i]
        _kernels.apply_direction_flat(_array(w_at[i], hi, D)[lo:hi], D[o + lo : o + hi], neg_lr, wd, decay)


def _nonfinite_at(g_at, chunks, like):  # type: ignore[no-untyped-def]
    """The number of NaN or Inf entries of the members' gradients (one read of each), per span the shared
    :func:`adadiag_ref._kernels._nonfinite_count_flat`."""
    total = 0
    for c in prange(chunks.shape[0]):
        i, lo, hi = chunks[c, 0], chunks[c, 1], chunks[c, 2]
        total += _kernels._nonfinite_count_flat(_array(g_at[i], hi, like)[lo:hi])
    return total


def _step_at(w_at, g_at, m_at, v_at, chunks, b1, c1, b2, c2, eps, neg_lr, wd, decay, like):  # type: ignore[no-untyped-def]
    """The unrotated Adam step in place over the members' own memory, row by row of ``chunks``
    (``(member, lo, hi)``), each span by :func:`~.numba_route.adam_step_in_place_flat` (one pass): one call for any
    number of large parameters instead of one per parameter.  ``like``: any array of the members' dtype."""
    for c in range(chunks.shape[0]):
        i, lo, hi = chunks[c, 0], chunks[c, 1], chunks[c, 2]
        adam_step_in_place_flat(_array(w_at[i], hi, like)[lo:hi], _array(g_at[i], hi, like)[lo:hi],
                                _array(m_at[i], hi, like)[lo:hi], _array(v_at[i], hi, like)[lo:hi], b1, c1, b2, c2,
                                eps, neg_lr, wd, decay)  # fmt: skip


def _moments_at(m_at, v_at, u_at, chunks, b1, c1, b2, c2, eps, like):  # type: ignore[no-untyped-def]
    """A rotated member's moments in place over its own memory, row by row of ``chunks`` (``(member, lo,
    hi)``): ``V <- V_t``, ``M <- M_t`` and ``U~`` over ``G~`` at ``u_at`` (the caller's GEMM output), each span by
    :func:`~.numba_route.adam_moments_own_flat` (one pass).  ``like``: any array of the member's dtype."""
    for c in range(chunks.shape[0]):
        i, lo, hi = chunks[c, 0], chunks[c, 1], chunks[c, 2]
        adam_moments_own_flat(_array(m_at[i], hi, like)[lo:hi], _array(v_at[i], hi, like)[lo:hi],
                              _array(u_at[i], hi, like)[lo:hi], b1, c1, b2, c2, eps)  # fmt: skip


def _dense_address_of(a):  # type: ignore[no-untyped-def]
    """The address of a C-contiguous array's first entry, -1 for any other (numba reads both in a few ns)."""
    return a.ctypes.data if a.flags.c_contiguous else -1


if AVAILABLE:
    _dense_address: Any = numba.njit(cache=True, nogil=True)(_dense_address_of)
    engine_step, engine_step_parallel = _kernels._serial_and_parallel(_engine_step)
    engine_tail, engine_tail_parallel = _kernels._serial_and_parallel(_engine_tail)
    nonfinite_at, nonfinite_at_parallel = _kernels._serial_and_parallel(_nonfinite_at)
    read_counters = _kernels._jit(_read_counters)
    advance_counters = _kernels._jit(_advance_counters)
    second_moment = _kernels._jit(_second_moment)
    apply_unrotated = _kernels._jit(_apply_unrotated)
    direction_rotated = _kernels._jit(_direction_rotated)
    apply_rotated = _kernels._jit(_apply_rotated)
    step_at = _kernels._jit(_step_at)
    moments_at = _kernels._jit(_moments_at)
else:  # pragma: no cover
    second_moment = apply_unrotated = direction_rotated = apply_rotated = None
    read_counters = advance_counters = step_at = moments_at = None
    engine_step = engine_step_parallel = nonfinite_at = nonfinite_at_parallel = _dense_address = None
    engine_tail = engine_tail_parallel = None


def addresses(tensors: list[Any]) -> np.ndarray:
    """The ``data_ptr()`` of each tensor, as the kernels' int64 address array."""
    return np.array([t.data_ptr() for t in tensors], dtype=np.int64)


CHUNK = 1 << 16
"""Entries per work item of the engine's group kernels: a member larger than this is cut into pieces, so that
the parallel kernels share a few large members as evenly as many small ones."""


def chunk_table(sizes: list[int], chunk: int = CHUNK) -> np.ndarray:
    """``(member, lo, hi)`` rows covering entries ``[0, sizes[i])`` of every member in pieces of at most
    ``chunk`` entries (a member of no entries has none), as the kernels' int64 table."""
    rows = [(i, lo, min(lo + chunk, n)) for i, n in enumerate(sizes) for lo in range(0, n, chunk)]
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def disjoint(addresses: Sequence[int], sizes: Sequence[int], itemsize: int) -> bool:
    """Whether the memory spans ``[address, address + size * itemsize)`` are pairwise disjoint: the group kernels
    write each parameter through its address, so two parameters sharing memory (one array handed over twice)
    would be written twice, in an order the threads decide; such a step takes the gathering path instead."""
    spans = sorted(zip(addresses, sizes, strict=True))
    return all(a + n * itemsize <= b for (a, n), (b, _) in itertools.pairwise(spans))


class Prepared(NamedTuple):
    """One step's members (:meth:`~adadiag_ref.optim.families.registry.GroupKernels.prepare`): their address
    tables (``g_at`` ``None`` for the tail only) and the learning rate."""

    w_at: Any
    g_at: Any
    eta: Any


def prepare_members(eta: Any, params_at: Callable[[], Any], grads_at: Callable[[], Any] | None) -> Prepared | None:
    """:meth:`~adadiag_ref.optim.families.registry.GroupKernels.prepare`'s steps, whatever the address tables:
    ``None`` unless ``eta`` is a host number and ``params_at()`` (then ``grads_at()``, unless ``None``: the tail
    only) gives a table (``None``: an array the kernels cannot walk)."""
    if not is_host_number(eta):
        return None
    w_at = params_at()
    if w_at is None:
        return None
    if grads_at is None:
        return Prepared(w_at, None, eta)
    g_at = grads_at()
    return None if g_at is None else Prepared(w_at, g_at, eta)


class NumpyGroup:
    """:class:`~adadiag_ref.optim.families.registry.GroupKernels` of the Adam family in host memory (numba), over
    NumPy arrays or, with ``tensors``, CPU torch tensors (their memory by ``data_ptr()``; the engine's flat moments
    and direction as zero-copy NumPy views): one kernel call reads every member's ``G`` and ``W`` and the flat
    ``M``, ``V`` and writes ``W``, ``M``, ``V`` (seven array passes per entry, the bound), one more call counts the
    gradients' NaN and Inf (one pass).  The arithmetic is :func:`~.numba_route._adam_entry` and
    :func:`~adadiag_ref._kernels.delta_entry` with :func:`~.numba_route.kernel_scalars`: the bits of the reference
    update plus ``W + delta``.

    The parameters' address table is kept while the same arrays come back (held by weak references: a model's
    parameters are the same arrays every step); the gradients' is made per step, by a numba call per array
    (0.2 us, against 1.5 us for ``ndarray.ctypes.data``)."""

    def __init__(self, cfg: BaseConfig, dtype: Any, sizes: list[int], tensors: bool = False) -> None:
        self.cfg, self.dtype, self.tensors = cfg, np.dtype(dtype), tensors
        self.chunks = chunk_table(sizes)
        self.sizes = sizes
        self.offsets = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        self.parallel = sum(sizes) >= _kernels.PARALLEL_MIN_SIZE and _kernels.pool_does_not_spin()
        self.like = np.empty(1, dtype=self.dtype)
        self._params: tuple[list[weakref.ref[Any]], np.ndarray] | None = None
        kind = ("guided pieces over torch's threads" if tensors
                else "parallel on numba's pool" if self.parallel else "serial")  # fmt: skip
        self.name = (f"{__name__}.engine_step over the members' own memory ({len(sizes)} arrays, "
                     f"{sum(sizes)} entries, {kind}): moments and W in place, no gather")  # fmt: skip
        self.tail_name = f"{__name__}.engine_tail over the members' own memory ({kind}): W <- W - eta (D + lambda W)"

    def _table(self, arrays: Sequence[Any]) -> np.ndarray | None:
        """The arrays' addresses, or ``None`` unless each is a C-contiguous ``numpy.ndarray`` (with ``tensors``: a
        dense CPU torch tensor; the engine has checked their dtypes and shapes against the group's)."""
        out = np.empty(len(arrays), dtype=np.int64)
        if self.tensors:
            for k, a in enumerate(arrays):
                if not (plain_cpu_tensor(a) and a.is_contiguous()):
                    return None
                out[k] = a.data_ptr()
            return out
        for k, a in enumerate(arrays):
            if type(a) is not np.ndarray:
                return None
            address = _dense_address(a)
            if address < 0:
                return None
            out[k] = address
        return out

    def _param_table(self, params: Sequence[Any]) -> np.ndarray | None:
        # a NumPy array's memory never moves; a torch tensor's may (``p.data = ...``, ``set_``): read every step
        kept = None if self.tensors else self._params
        if kept is not None and all(r() is p for r, p in zip(kept[0], params, strict=True)):
            w_at: np.ndarray | None = kept[1]
        else:
            w_at = self._table(params)
            if w_at is not None and not disjoint(w_at.tolist(), self.sizes, self.dtype.itemsize):
                w_at = None
            self._params = None if w_at is None else ([weakref.ref(p) for p in params], w_at)
        if w_at is None or not (self.tensors or all(p.flags.writeable for p in params)):
            return None
        return w_at

    def prepare(self, params: Sequence[Any], grads: Sequence[Any] | None, eta: Any) -> Prepared | None:
        return prepare_members(eta, lambda: self._param_table(params),
                               None if grads is None else lambda: self._table(grads))  # fmt: skip

    def _run(self, serial: Any, parallel: Any, before: tuple[Any, ...], after: tuple[Any, ...]) -> list[Any]:
        """``kernel(*before, chunks, *after)`` over the group's chunk table: with ``tensors`` cut into guided
        pieces over ``torch.get_num_threads()`` threads of the caller's (:func:`.torch_route.split_rows`: numba's
        pool next to torch's spinning OpenMP threads ran slower), else on numba's pool where it does not spin, else
        serially; each call's result.  Each entry is computed alike whatever the cut: the same bits."""
        if self.tensors:
            return split_rows(serial, before, self.chunks, after, self.dtype)
        return [(parallel if self.parallel else serial)(*before, self.chunks, *after)]

    def nonfinite(self, prepared: Prepared) -> int:
        return sum(int(n) for n in self._run(nonfinite_at, nonfinite_at_parallel, (prepared.g_at,), (self.like,)))

    def step(self, prepared: Prepared, moments: Mapping[str, Any], t: Any, proceed: Any = None) -> None:
        if proceed is not None:  # the engine reads the verdict first in host memory
            raise ValueError("NumPy's group kernels run after the verdict is read: proceed must be None")
        b1_t, b2_t = beta_hats(self.cfg, t, np)
        sc = kernel_scalars(b1_t, b2_t, self.cfg, prepared.eta, self.dtype)
        self._run(engine_step, engine_step_parallel, (prepared.w_at, prepared.g_at),
                  (self.offsets, _host(moments["M"]), _host(moments["V"]), *sc))  # fmt: skip

    def tail(self, prepared: Prepared, direction: Any, proceed: Any = None) -> None:
        if proceed is not None:
            raise ValueError("NumPy's group kernels run after the verdict is read: proceed must be None")
        neg_lr, wd = scalar(-prepared.eta, self.dtype), scalar(self.cfg.weight_decay, self.dtype)
        self._run(engine_tail, engine_tail_parallel, (prepared.w_at,),
                  (self.offsets, _host(direction), neg_lr, wd, decays(self.cfg)))  # fmt: skip


def _host(a: Any) -> Any:
    """A NumPy array as it is; a CPU torch tensor (the engine's own flat arrays) as a zero-copy NumPy view."""
    return a if isinstance(a, np.ndarray) else a.detach().numpy()


def _host_dtype(dtype: Any, device: Any, xp: Namespace) -> tuple[Any, bool] | None:
    """``(NumPy dtype, tensors)`` of a group the kernels can step in host memory: NumPy float32/float64 arrays,
    or CPU torch float32/float64 tensors (``tensors``); ``None`` otherwise."""
    tensors = is_torch_namespace(xp) and getattr(device, "type", None) == "cpu"
    if not (tensors or is_numpy_namespace(xp)):
        return None
    try:
        name = float_dtype_name(dtype, xp)
    except ValueError:
        return None
    return (np.dtype(name), tensors) if name in ("float32", "float64") else None


def engine_group(cfg: BaseConfig, dtype: Any, sizes: list[int], device: Any, xp: Namespace) -> NumpyGroup | None:
    """The Adam family's :attr:`~adadiag_ref.optim.families.registry.Routes.group` factory in host memory: a
    :class:`NumpyGroup` when numba is installed, ``cfg.kernels`` is not ``"reference"`` and the group's arrays are
    NumPy or CPU torch float32/float64; else ``None``."""
    found = _host_dtype(dtype, device, xp) if AVAILABLE else None
    if found is None or not _kernels.selected(cfg, np, np.empty(1, dtype=found[0])):
        return None
    return NumpyGroup(cfg, found[0], sizes, tensors=found[1])
