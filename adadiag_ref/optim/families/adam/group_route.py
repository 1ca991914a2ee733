"""The Adam family's group kernels in host memory: the entrywise part of an engine group's step in one numba call
per kernel (or per guided piece, over torch's threads), whatever the number of parameters.

:class:`NumpyGroup` is the family's :class:`~adadiag_ref.optim.families.registry.GroupKernels` for NumPy arrays and
CPU torch tensors: the kernels receive the addresses of the parameters' and gradients' memory and walk them one
after the other, beside the engine's flat moments; each call covers the rows ``(member, lo, hi)`` of a chunk table
(:func:`chunk_table`), so that :func:`.torch_route.split_rows` can cut it between threads.  The arithmetic is the
reference's entry for entry (:func:`~.numba_route._adam_step_span`, :func:`~.numba_route.adam_moments_own_flat`,
:func:`~adadiag_ref._kernels.apply_direction_flat`), the root the correctly rounded one taken inside the kernels
(the library's, :func:`adadiag_ref._xp.sqrt`); so the engine's results are those of ``ar.step`` bit for bit
(``tests/test_optim_engine.py``, ``tests/test_adapter_torch.py``).

* :func:`engine_step`: an unrotated group's whole step in place: ``M``, ``V`` in the flat moments and
  ``W <- W + (-eta)(U + lambda W)`` in each member's memory (7 array passes per entry);
* :func:`engine_moments`: a rotated group's ``M <- M_t``, ``V <- V_t`` in place and ``U~`` over the flat ``G~``;
* :func:`engine_tail`: a rotated group's tail ``W <- W + (-eta)(D + lambda W)`` in each member's memory;
* :func:`nonfinite_at`: the number of NaN or Inf entries of the members' gradients (one read, before any write).

The callers guarantee what the kernels cannot check: every address is that of a dense array of the group's dtype
with ``sizes[i]`` entries, in the memory order of the member's span of the flat arrays.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from array_api_compat import is_numpy_namespace, is_torch_namespace

from .... import _kernels
from ...._kernels import is_host_number, prange, scalar
from ...._xp import Namespace, float_dtype_name, plain_cpu_tensors
from ....config import BaseConfig
from ...schedules import beta_hats
from ...tail import decays
from .numba_route import (
    _adam_step_span,
    adam_moments_own_flat,
    kernel_scalars,
)
from .torch_route import split_rows

__all__ = [
    "AVAILABLE",
    "NumpyGroup",
    "Prepared",
    "chunk_table",
    "disjoint",
    "engine_group",
    "prepare_members",
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


def _engine_moments(chunks, offsets, M, V, GU, b1, c1, b2, c2, eps):  # type: ignore[no-untyped-def]
    """A rotated flat group's moments in place: per chunk ``(member, lo, hi)``, at the member's offset,
    ``M <- M_t``, ``V <- V_t`` and ``U~`` over ``G~`` (:func:`~.numba_route.adam_moments_own_flat`, one pass)."""
    for c in prange(chunks.shape[0]):
        i, lo, hi = chunks[c, 0], chunks[c, 1], chunks[c, 2]
        o = offsets[i]
        adam_moments_own_flat(M[o + lo : o + hi], V[o + lo : o + hi], GU[o + lo : o + hi], b1, c1, b2, c2, eps)


def _nonfinite_at(g_at, chunks, like):  # type: ignore[no-untyped-def]
    """The number of NaN or Inf entries of the members' gradients (one read of each), per span the shared
    :func:`adadiag_ref._kernels._nonfinite_count_flat`."""
    total = 0
    for c in prange(chunks.shape[0]):
        i, lo, hi = chunks[c, 0], chunks[c, 1], chunks[c, 2]
        total += _kernels._nonfinite_count_flat(_array(g_at[i], hi, like)[lo:hi])
    return total


def _dense_address_of(a):  # type: ignore[no-untyped-def]
    """The address of a C-contiguous array's first entry, -1 for any other (numba reads both in a few ns)."""
    return a.ctypes.data if a.flags.c_contiguous else -1


if AVAILABLE:
    _dense_address: Any = numba.njit(cache=True, nogil=True)(_dense_address_of)
    engine_step, engine_step_parallel = _kernels._serial_and_parallel(_engine_step)
    engine_tail, engine_tail_parallel = _kernels._serial_and_parallel(_engine_tail)
    engine_moments, engine_moments_parallel = _kernels._serial_and_parallel(_engine_moments)
    nonfinite_at, nonfinite_at_parallel = _kernels._serial_and_parallel(_nonfinite_at)
else:  # pragma: no cover
    engine_step = engine_step_parallel = nonfinite_at = nonfinite_at_parallel = _dense_address = None
    engine_tail = engine_tail_parallel = engine_moments = engine_moments_parallel = None


_DATA_PTR, _IS_CONTIGUOUS = operator.methodcaller("data_ptr"), operator.methodcaller("is_contiguous")
_DEREFERENCE = weakref.ref.__call__
"""Read by ``map`` over a group's tensors at every step: a loop in C, no Python frame per tensor."""


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
    tables (``g_at`` ``None`` for the tail only), the learning rate and the step's config (its betas and weight
    decay are the kernels' scalars: a scheduler's per-step values take the kernels too)."""

    w_at: Any
    g_at: Any
    eta: Any
    cfg: Any


def prepare_members(
    eta: Any, cfg: BaseConfig, params_at: Callable[[], Any] | None, grads_at: Callable[[], Any] | None
) -> Prepared | None:
    """:meth:`~adadiag_ref.optim.families.registry.GroupKernels.prepare`'s steps, whatever the address tables:
    ``None`` unless ``eta`` and ``cfg``'s betas and weight decay are host numbers and ``params_at()`` (unless
    ``None``: the gradients only, for the check) then ``grads_at()`` (unless ``None``: the tail only) gives a
    table (``None``: an array the kernels cannot walk)."""
    if not all(map(is_host_number, (eta, *cfg.betas, cfg.weight_decay))):
        return None
    w_at = None if params_at is None else params_at()
    if w_at is None and params_at is not None:
        return None
    if grads_at is None:
        return Prepared(w_at, None, eta, cfg)
    g_at = grads_at()
    return None if g_at is None else Prepared(w_at, g_at, eta, cfg)


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

    def __init__(self, dtype: Any, sizes: list[int], tensors: bool = False) -> None:
        self.dtype, self.tensors = np.dtype(dtype), tensors
        self.chunks = chunk_table(sizes)
        # the check scans the chunks last to first, so the step, which follows it first to last, finds the last
        # gradients the check read still in the cache
        self.chunks_backwards = np.ascontiguousarray(self.chunks[::-1])
        self.sizes = sizes
        self.offsets = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        self.parallel = sum(sizes) >= _kernels.PARALLEL_MIN_SIZE and _kernels.pool_does_not_spin()
        self.like = np.empty(1, dtype=self.dtype)
        self._params: tuple[list[weakref.ref[Any]], np.ndarray] | None = None
        self._grads: tuple[list[Any], np.ndarray] | None = None  # a check's table, for the step after it
        kind = ("guided pieces over torch's threads" if tensors
                else "parallel on numba's pool" if self.parallel else "serial")  # fmt: skip
        self.name = (f"{__name__}.engine_step over the members' own memory ({len(sizes)} arrays, "
                     f"{sum(sizes)} entries, {kind}): moments and W in place, no gather")  # fmt: skip
        self.tail_name = f"{__name__}.engine_tail over the members' own memory ({kind}): W <- W - eta (D + lambda W)"
        self.moments_name = f"{__name__}.engine_moments over the flat M, V and G~ ({kind}): M_t, V_t, U~ over G~"

    def _table(self, arrays: Sequence[Any]) -> np.ndarray | None:
        """The arrays' addresses, or ``None`` unless each is a C-contiguous ``numpy.ndarray`` (with ``tensors``: a
        dense CPU torch tensor; the engine has checked their dtypes and shapes against the group's)."""
        if self.tensors:
            if not (plain_cpu_tensors(arrays) and all(map(_IS_CONTIGUOUS, arrays))):
                return None
            return np.array(list(map(_DATA_PTR, arrays)), dtype=np.int64)
        out = np.empty(len(arrays), dtype=np.int64)
        for k, a in enumerate(arrays):
            if type(a) is not np.ndarray:
                return None
            address = _dense_address(a)
            if address < 0:
                return None
            out[k] = address
        return out

    @staticmethod
    def _same_memory(tensors: Sequence[Any], table: np.ndarray) -> bool:
        """Whether the tensors of a kept table still lie, dense, at its addresses (``t.data = ...`` and ``set_``
        give a tensor object other memory, or another layout over the same)."""
        return table.tolist() == list(map(_DATA_PTR, tensors)) and all(map(_IS_CONTIGUOUS, tensors))

    def _param_table(self, params: Sequence[Any]) -> np.ndarray | None:
        # a NumPy array's memory never moves; a torch tensor's may (``p.data = ...``, ``set_``): its address is read
        # every step, and the table checked again when an address changed
        kept = self._params
        same = (
            kept is not None
            and len(kept[0]) == len(params)
            and all(map(operator.is_, map(_DEREFERENCE, kept[0]), params))
        )
        if same and self.tensors:
            same = self._same_memory(params, kept[1])  # type: ignore[index]
        if same:
            w_at: np.ndarray | None = kept[1]  # type: ignore[index]
        else:
            w_at = self._table(params)
            if w_at is not None and not disjoint(w_at.tolist(), self.sizes, self.dtype.itemsize):
                w_at = None
            self._params = None if w_at is None else ([weakref.ref(p) for p in params], w_at)
        if w_at is None or not (self.tensors or all(p.flags.writeable for p in params)):
            return None
        return w_at

    def _grad_table(self, grads: Sequence[Any], keep: bool) -> np.ndarray | None:
        """:meth:`_table` of the gradients; the table of a check (``keep``) is kept for the step that follows it
        with the very same gradients, still at the same addresses, and dropped then."""
        kept, self._grads = self._grads, None
        if (
            kept is not None
            and len(kept[0]) == len(grads)
            and all(map(operator.is_, kept[0], grads))
            and (not self.tensors or self._same_memory(grads, kept[1]))
        ):
            table: np.ndarray | None = kept[1]
        else:
            table = self._table(grads)
        if keep and table is not None:
            self._grads = (list(grads), table)
        return table

    def prepare(
        self, params: Sequence[Any] | None, grads: Sequence[Any] | None, eta: Any, cfg: BaseConfig
    ) -> Prepared | None:
        if grads is None:  # a tail's members: a check's table (and the gradients it holds) is not kept past it
            self._grads = None
        return prepare_members(eta, cfg, None if params is None else lambda: self._param_table(params),
                               None if grads is None else lambda: self._grad_table(grads, params is None))  # fmt: skip

    def _run(
        self, serial: Any, parallel: Any, before: tuple[Any, ...], after: tuple[Any, ...], backwards: bool = False
    ) -> list[Any]:
        """``kernel(*before, chunks, *after)`` over the group's chunk table (last row first when ``backwards``:
        the same entries, so the same results): with ``tensors`` cut into guided
        pieces over ``torch.get_num_threads()`` threads of the caller's (:func:`.torch_route.split_rows`: numba's
        pool next to torch's spinning OpenMP threads ran slower), else on numba's pool where it does not spin, else
        serially; each call's result.  Each entry is computed alike whatever the cut: the same bits."""
        chunks = self.chunks_backwards if backwards else self.chunks
        if self.tensors:
            return split_rows(serial, before, chunks, after, self.dtype)
        return [(parallel if self.parallel else serial)(*before, chunks, *after)]

    def nonfinite(self, prepared: Prepared) -> int:
        counts = self._run(nonfinite_at, nonfinite_at_parallel, (prepared.g_at,), (self.like,), backwards=True)
        return sum(int(n) for n in counts)

    def step(self, prepared: Prepared, moments: Mapping[str, Any], t: Any, proceed: Any = None) -> None:
        _ungated(proceed)
        b1_t, b2_t = beta_hats(prepared.cfg, t, np)
        sc = kernel_scalars(b1_t, b2_t, prepared.cfg, prepared.eta, self.dtype)
        self._run(engine_step, engine_step_parallel, (prepared.w_at, prepared.g_at),
                  (self.offsets, _host(moments["M"]), _host(moments["V"]), *sc))  # fmt: skip

    def moments(self, prepared: Prepared, moments: Mapping[str, Any], g_rot: Any, t: Any, proceed: Any = None) -> bool:
        _ungated(proceed)
        cfg = prepared.cfg
        b1, c1, b2, c2, eps, *_ = kernel_scalars(*beta_hats(cfg, t, np), cfg, 0.0, self.dtype)
        arrays = (_host(moments["M"]), _host(moments["V"]), _host(g_rot))
        self._run(engine_moments, engine_moments_parallel, (), (self.offsets, *arrays, b1, c1, b2, c2, eps))
        return True

    def tail(self, prepared: Prepared, direction: Any, proceed: Any = None) -> None:
        _ungated(proceed)
        neg_lr, wd = scalar(-prepared.eta, self.dtype), scalar(prepared.cfg.weight_decay, self.dtype)
        self._run(engine_tail, engine_tail_parallel, (prepared.w_at,),
                  (self.offsets, _host(direction), neg_lr, wd, decays(prepared.cfg)))  # fmt: skip


def _ungated(proceed: Any) -> None:
    """Refuse a device verdict: in host memory the engine reads its verdict before any of these kernels runs."""
    if proceed is not None:
        raise ValueError("NumPy's group kernels run after the verdict is read: proceed must be None")


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
    return NumpyGroup(found[0], sizes, tensors=found[1])
