"""The Adam family's torch route: ``update_in_place`` on float32/float64 CPU torch tensors (the torch adapter).

The Adam kernels of :mod:`.numba_route` run on zero-copy NumPy views of the tensors, one pass per array, with the
correctly rounded square root (LLVM's), the library's root on every backend (:func:`adadiag_ref._xp.sqrt`: the
torch reference route takes it too, where eager ``torch.sqrt`` would take MKL VML's).  No parameter-sized array
is allocated for an unrotated parameter (:func:`_adam_torch_cpu`).  Declines (``False``, nothing written) for
every other backend, device or layout; :mod:`.inplace` then runs the backend's own ufuncs.

Threads (issue 31): a kernel's flat arrays of at least ``2 x`` :data:`SPLIT_MIN_SIZE` entries are cut into
``torch.get_num_threads()`` contiguous parts run at once, one on the calling thread and the others on
persistent helper threads (:func:`_split`; the kernels release the GIL).  numba's thread pool is never used
here: next to torch's OpenMP threads, which spin after each parallel region, it ran slower than one thread.  The
group kernels' chunk tables go the same way in guided pieces that each thread takes as it finishes
(:func:`split_rows`).  Every entry is computed by the same code whatever the cut, so the bits do not depend on the
threads.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from array_api_compat import is_torch_namespace

from .... import _kernels
from ...._kernels import alike, flat
from ...._xp import Array
from ....config import BaseConfig
from ...blas_threads import Workers
from ...layout import from_work
from ...rotation import unrotate
from ...schedules import beta_hats
from . import numba_route
from .numba_route import kernel_scalars
from .reference import AdamState

__all__ = ["guided_cuts", "in_place", "split_rows"]


def _host_views(*tensors: Any) -> list[Any] | None:
    """Zero-copy NumPy views of dense CPU torch tensors of one float32/float64 dtype (the same memory: writing a
    view writes the tensor), or ``None`` when any tensor cannot be viewed that way; ``None`` entries stay ``None``."""
    import numpy
    import torch

    views: list[Any] = []
    for x in tensors:
        if x is None:
            views.append(None)
            continue
        if (
            not isinstance(x, torch.Tensor)
            or x.device.type != "cpu"
            or x.layout != torch.strided
            or x.dtype not in (torch.float32, torch.float64)
            or x.is_neg()  # a lazily negated view has no NumPy form
            or x.is_conj()
        ):
            return None
        try:
            view = x.detach().numpy()
        except (RuntimeError, TypeError):  # subclasses without host storage (fake, meta-like wrappers)
            return None
        if type(view) is not numpy.ndarray:
            return None
        views.append(view)
    dtypes = {v.dtype for v in views if v is not None}
    return views if len(dtypes) == 1 else None


#: Flat arrays with at least this many entries per thread are split across ``torch.get_num_threads()`` threads.
SPLIT_MIN_SIZE = 1 << 16


_WORKERS = Workers()  # helper threads for _alongside
_COMPILED: set[tuple[Any, Any]] = set()


def _part(kernel: Any, arrays: tuple[Any, ...], scalars: tuple[Any, ...], outputs: tuple[Any, ...]) -> None:
    kernel(*arrays, *scalars, *outputs)


def _alongside(helpers: Sequence[Callable[[], Any]], own: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """``own()`` on this thread while ``helpers`` run on the helper threads; returns ``own()``'s result and the
    helpers' results, in order.  Waits for every helper before it returns or raises (no thread may still be
    writing then); an error of ``own()`` is raised as it is, before any helper's."""
    pool = _WORKERS.get(len(helpers))
    futures = [pool.submit(job) for job in helpers]
    try:
        mine = own()
    finally:
        concurrent.futures.wait(futures)
    return mine, [future.result() for future in futures]


def _split(
    kernel: Any, arrays: tuple[Any, ...], scalars: tuple[Any, ...], size: int, outputs: tuple[Any, ...] = ()
) -> None:
    """``kernel(*arrays, *scalars, *outputs)`` over flat arrays of ``size`` entries, cut into contiguous parts run
    at once on ``torch.get_num_threads()`` threads (this one and helpers; the numba kernels release the GIL).  Each
    entry is computed by the same code whatever the cut, so the bits do not depend on the thread count."""
    import torch

    parts = min(torch.get_num_threads(), size // SPLIT_MIN_SIZE)
    key = (kernel, arrays[0].dtype)
    if parts <= 1 or key not in _COMPILED:  # numba compiles (or loads) a kernel on one thread, at its first call
        _part(kernel, arrays, scalars, outputs)
        _COMPILED.add(key)
        return
    step = -(-size // parts)
    step += -step % 64  # cache-line aligned cuts
    bounds = [(start, min(start + step, size)) for start in range(0, size, step)]
    jobs = [
        functools.partial(_part, kernel, tuple(a[lo:hi] for a in arrays), scalars, tuple(a[lo:hi] for a in outputs))
        for lo, hi in bounds
    ]
    _alongside(jobs[1:], jobs[0])


def guided_cuts(entries: Any, parts: int, least: int) -> list[int]:
    """Row indices cutting a chunk table's rows (``entries[i]`` entries each) into contiguous pieces for ``parts``
    threads, guided: each piece about ``1 / (2 parts)`` of the entries not yet given out, and at least ``least``
    entries (one row at least), so the first pieces are large and the last ones small.  Threads that take the next
    piece as they finish balance themselves when one of them runs slower (a core shared with torch's spinning
    OpenMP workers); the small last pieces bound the wait at the end.  Returns ``[0, ..., len(entries)]``."""
    import numpy

    ends = numpy.cumsum(entries)
    total = int(ends[-1]) if len(ends) else 0
    cuts, given = [0], 0
    while given < total:
        piece = max((total - given) // (2 * parts), least)
        stop = int(numpy.searchsorted(ends, given + piece)) + 1
        stop = min(max(stop, cuts[-1] + 1), len(ends))
        cuts.append(stop)
        given = int(ends[stop - 1])
    return cuts


def split_rows(
    kernel: Any,
    before: tuple[Any, ...],
    rows: Any,
    after: tuple[Any, ...],
    dtype: Any,
    threads: int | None = None,
) -> list[Any]:
    """``kernel(*before, piece, *after)`` over the rows of a chunk table ``rows`` (``(member, lo, hi)``,
    :func:`~.group_route.chunk_table`) on ``threads`` threads (``torch.get_num_threads()`` when ``None``): this one
    and helpers, each taking the next piece of :func:`guided_cuts` as it finishes (pieces of at least ``4 x``
    :data:`SPLIT_MIN_SIZE` entries); returns each call's result, in the pieces' order.  Each entry is computed by
    the same code whatever the cut, so the bits do not depend on the thread count.

    A static cut into one part per thread lost time when a thread shared its core: right after a multi-threaded
    ``torch.mm`` (as after a backward pass), the large lane's VML-root step kernel over LLaMA-60M's 4-block set on 2
    threads took 22.2 and 21.9 ms cut statically, 20.1 and 18.7 ms guided (11 alternated rounds, two runs); back
    to back 15.5/17.9 against 15.6/16.9 ms."""
    import numpy
    import torch

    entries = rows[:, 2] - rows[:, 1]
    total = int(entries.sum())
    parts = min(torch.get_num_threads() if threads is None else threads, total // SPLIT_MIN_SIZE, len(rows))
    key = (kernel, numpy.dtype(dtype))

    def call(piece: Any) -> Any:
        return kernel(*before, piece, *after)

    if parts <= 1 or key not in _COMPILED:  # numba compiles (or loads) a kernel on one thread, at its first call
        _COMPILED.add(key)
        return [call(rows)]
    cuts = guided_cuts(entries, parts, 4 * SPLIT_MIN_SIZE)
    pieces = itertools.count()  # next() is atomic under the GIL: each piece is taken once

    def take() -> list[tuple[int, Any]]:
        done = []
        while (i := next(pieces)) < len(cuts) - 1:
            done.append((i, call(rows[cuts[i] : cuts[i + 1]])))
        return done

    mine, theirs = _alongside([take] * (parts - 1), take)
    done = mine + [pair for pairs in theirs for pair in pairs]
    return [result for _, result in sorted(done, key=lambda pair: pair[0])]


def _adam_torch_cpu(
    state: AdamState,
    layout: Any,
    betas_t: tuple[Array, Array],
    g_rot: Array,
    w: Array,
    param: Array,
    cfg: BaseConfig,
    eta: Any,
    xp: Any,
) -> bool:
    """The Adam-family step of CPU torch tensors through the numba kernels, on zero-copy NumPy views.

    Returns ``False``, having written nothing, when the route does not apply (``cfg.kernels == "reference"``,
    numba missing, ``eta`` not a Python number, the parameter's dtype not the state dtype or the parameter
    not contiguous, tensors that are not plain dense CPU float32/float64 ones or not laid out alike); the
    caller then runs the backend ufuncs.

    Bit-identical to the reference on torch: the same formulas in the same order, the coefficients
    ``b_hat`` the host's as there, the same torch GEMMs, and the correctly rounded root, which is the
    library's (:func:`adadiag_ref._xp.sqrt`); kernels compiled without fastmath.  One pass per array: one kernel
    call per part (:func:`_split`).

    * no rotation: ``M``, ``V`` and ``W <- W + (-eta) (U + lambda W)`` are written in place
      (:func:`~.numba_route.adam_step_in_place_flat`); nothing of the parameter's size is allocated (the
      embedding and LM head of a language model: fresh arrays of their size cost page faults of the order of the
      arithmetic).  Everything that can fail is checked before the kernel runs.
    * with rotation: ``M_t``, ``V_t`` go into two new tensors and ``U~`` over ``G~`` (this call's own GEMM
      output), ``D = P U~ Q^T`` (torch GEMM, new), one pass ``W <- W + (-eta) (D + lambda W)``, then ``M``
      and ``V`` adopt the new tensors' storage (``Tensor.set_``): the state is written only after the GEMM.
    """
    if cfg.kernels == "reference" or not _kernels.AVAILABLE or not _kernels.is_host_number(eta):
        return False
    M, V = state.M, state.V
    if param.dtype != M.dtype or not param.is_contiguous() or w.data_ptr() != param.data_ptr():
        return False  # W must be the parameter's own memory, in the state dtype, to be written in place
    rotated = state.P is not None or state.Q is not None
    views = _host_views(g_rot, w, M, V)
    if views is None:
        return False
    g_np, w_np, M_np, V_np = views
    if not alike(g_np, M_np, V_np, *(() if rotated else (w_np,))):
        return False
    # the host coefficients (Python floats: docs/spec.md, "The step's coefficients"), or a 0-d tensor's in host memory
    coefficients = betas_t if all(isinstance(b, float) for b in betas_t) else _host_views(*betas_t)
    if coefficients is None:
        return False
    b1, c1, b2, c2, eps, neg_lr, wd, decay = kernel_scalars(coefficients[0], coefficients[1], cfg, eta, M_np.dtype)
    import torch

    size = M_np.size
    fg, fM, fV = flat(g_np), flat(M_np), flat(V_np)
    if not rotated:
        scalars = (b1, c1, b2, c2, eps, neg_lr, wd, decay)
        _split(numba_route.adam_step_in_place_flat, (flat(w_np), fg, fM, fV), scalars, size)
        return True
    new_M, new_V = torch.empty_like(M), torch.empty_like(V)  # dense inputs: the same strides
    new_views = _host_views(new_M, new_V)
    if new_views is None or not alike(M_np, *new_views):  # pragma: no cover - empty_like keeps dense strides
        return False
    fnM, fnV = (flat(v) for v in new_views)
    _split(numba_route.adam_moments_over_flat, (fM, fV, fg), (b1, c1, b2, c2, eps), size, (fnM, fnV))
    D = unrotate(g_rot, state.P, state.Q, xp, transposed=layout.transposed)  # U~ lives in G~'s buffer now
    D_views = _host_views(D)
    if D_views is not None and alike(D_views[0], w_np):  # commit: nothing below fails
        _split(_kernels.apply_direction_flat, (flat(w_np), flat(D_views[0])), (neg_lr, wd, decay), size)
    else:  # pragma: no cover - torch GEMM outputs are dense in G~'s order; the reference expressions otherwise
        if decay:
            D = D + cfg.weight_decay * w
        param += from_work(D * -eta, layout, xp)
    M.set_(new_M)
    V.set_(new_V)
    return True


def in_place(state: AdamState, step_in: Any, cfg: BaseConfig, param: Array, eta: Any, xp: Any) -> bool:
    """``update_in_place``'s Adam step on CPU torch tensors (:func:`_adam_torch_cpu`); ``False`` when it does not
    apply (not torch, not CPU, ``kernels="reference"``, numba missing, another layout)."""
    if not is_torch_namespace(xp):
        return False
    betas_t = _step_beta_hats(cfg, step_in.t, xp)
    return _adam_torch_cpu(state, step_in.layout, betas_t, step_in.g_rot, step_in.w, param, cfg, eta, xp)


_BETA_HATS: dict[Any, Any] = {}


def _step_beta_hats(cfg: BaseConfig, t: Any, xp: Any) -> Any:
    """``beta_hats(cfg, t, xp)`` (torch ops on the 0-d step ``t``, as the reference computes them), computed once
    for all the parameters of a step: kept for the last ``(betas, bias_correction, dtype and value of t)``, which is
    all they depend on (the same torch ops on the same inputs give the same bits).  Computed afresh for anything
    else (array betas, a ``t`` that is not a 0-d CPU tensor)."""
    import torch

    betas = tuple(cfg.betas)
    if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.ndim == 0) or any(
        type(b) is not float for b in betas
    ):
        return beta_hats(cfg, t, xp)
    key = (betas, bool(cfg.bias_correction), t.dtype, t.detach().numpy().item())
    found = _BETA_HATS.get(key)
    if found is None:
        found = beta_hats(cfg, t, xp)
        _BETA_HATS.clear()
        _BETA_HATS[key] = found
    return found
