"""The pieces of a refresh under ``jax.jit``, for one's own jitted training loop (and the optax adapter's).

A step of a rotated optimizer refreshes its bases when due (``t = 1`` or ``(t - 1) mod T == 0``, ``t = count + 1``)::

    due      = traced_refresh_due(count, cfg)                        # traced: no Python branch on the counter
    S, flags = refresh_when_due(S, G, cfg)                           # lax.cond(due, host refresh, identity)
    delta, S = update(S, G, cfg, W, refreshed=flag)                  # per parameter, traceable

The canonical SVD decides the rank and the clusters on host values (``docs/spec.md``, section 4) and does not
trace, so :func:`refresh_when_due` runs the core's :func:`~adadiag_ref.refresh_bases` on the host through one
``jax.pure_callback`` for every rotated parameter, inside one ``jax.lax.cond`` on the traced counter: the step jits
once and never recompiles.  :func:`adadiag_ref.step` itself is the eager driver (a Python ``if`` on the counter)
and says so under ``jax.jit``.  JAX is imported only when these functions run.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..config import BaseConfig
from .batched_refresh import refresh_bases
from .core import init
from .families import State

__all__ = ["default_fp_environment", "refresh_when_due", "traced_refresh_due"]


def traced_refresh_due(count: Any, cfg: BaseConfig | Any) -> Any:
    """Traced :func:`adadiag_ref.refresh_due`: ``t == 1`` or ``(t - 1) mod T == 0`` with ``t = count + 1``.

    ``count`` is the steps taken (a traced integer array, e.g. ``state.count``); ``cfg`` a config
    (``T = cfg.update_freq``) or the period ``T`` itself: a Python int, ``None`` (T = infinity) or a traced
    integer array (``optax.inject_hyperparams``).  Returns a boolean array (no Python ``bool``: it traces).
    """
    period = cfg.update_freq if isinstance(cfg, BaseConfig) else cfg
    t = count + 1
    due = t == 1
    if period is not None:
        due = due | ((t - 1) % period == 0)
    return due


class _RotatedLeaf(NamedTuple):
    """What the host refresh needs of one rotated leaf: its tree path (for messages), the parameter's shape, the
    state dtype, whether ``Q`` is rotated too, and where its ``P`` sits among the callback's bases."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    two_sided: bool
    first: int


def _host_refresh(cfg: BaseConfig, leaves: list[_RotatedLeaf]) -> Callable[..., tuple[np.ndarray, ...]]:
    """Host callback of one step's refresh: the core's :func:`adadiag_ref.refresh_bases` over every leaf due.

    Called as ``callback(due, count, *grads, *bases)`` with, for each rotated leaf in order, its gradient, then
    the previous bases ``P_{t-1}[, Q_{t-1}]`` of every rotated leaf; returns ``(*bases, refreshed)`` with the
    bases in the same order and ``refreshed`` a bool per leaf.  Under ``jax.vmap`` (``vmap_method=
    "broadcast_all"``) every argument carries the same leading batch dimensions (``due``'s shape): each
    member whose ``due`` is true refreshes its own bases from its own gradient, the others keep theirs, and the
    whole batch is one :func:`adadiag_ref.refresh_bases` call.

    Only the gradients and the bases cross to the host (the moments stay on the device); each host state is a
    fresh ``ar.init`` of the state dtype carrying the previous bases, so that a refresh that keeps them (a NaN or
    Inf gradient, a decomposition that fails on every rung; ``docs/reliability.md``) returns ``P_{t-1}[,
    Q_{t-1}]`` bit for bit, as the eager core does, never the identity of a fresh state.  ``refreshed`` is
    False when the basis was kept: the step's update must then not apply the refresh-step structure, whose
    premise (``G~`` computed with the bases of this very ``G``) does not hold, exactly as
    :func:`adadiag_ref.step` passes ``refreshed=False`` (``new.P is not state.P``).  The leaves' tree paths
    and the step label the core's messages.  The callback runs on an XLA thread whose floating-point
    environment is not Python's; the refresh therefore runs with the default environment restored
    (:func:`default_fp_environment`).
    """

    def callback(due: np.ndarray, count: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        due, count = np.asarray(due), np.asarray(count)
        grads, previous = arrays[: len(leaves)], arrays[len(leaves) :]
        bases = [np.array(b) for b in previous]  # writable copies: the members not due keep their bases
        refreshed = np.zeros((*due.shape, len(leaves)), dtype=np.bool_)
        jobs: list[tuple[tuple[int, ...], int, Any]] = []
        with default_fp_environment():
            for member in np.ndindex(due.shape):  # () without vmap: the one member
                if not due[member]:
                    continue
                for j, leaf in enumerate(leaves):
                    P = bases[leaf.first][member]
                    Q = bases[leaf.first + 1][member] if leaf.two_sided else None
                    host = init(np.zeros(leaf.shape, dtype=leaf.dtype), cfg)._replace(P=P, Q=Q)
                    jobs.append((member, j, host))
            new = refresh_bases(
                [host for _, _, host in jobs],
                [np.asarray(grads[j][member]) for member, j, _ in jobs],
                cfg,
                names=[leaves[j].name for _, j, _ in jobs],
                count=[int(count[member]) for member, _, _ in jobs],
            )
        for (member, j, host), state in zip(jobs, new, strict=True):
            leaf = leaves[j]
            if state.P is not host.P:  # a kept basis comes back as the very object passed in
                refreshed[(*member, j)] = True
                bases[leaf.first][member] = state.P
                if leaf.two_sided:
                    bases[leaf.first + 1][member] = state.Q
        return (*bases, refreshed)

    return callback


def _libc() -> Any:
    """The C library's ``fegetenv``/``fesetenv`` (glibc), or ``None`` where they cannot be loaded."""
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "fegetenv") and hasattr(libc, "fesetenv") else None
    except OSError:  # pragma: no cover - no C library symbols in the process
        return None


_LIBC = _libc()
_FE_DFL_ENV = ctypes.c_void_p(-1)  # glibc's FE_DFL_ENV: ((const fenv_t *) -1), the program's start-up environment
_FENV_BYTES = 256  # room for any platform's fenv_t (x86-64: 32 bytes, aarch64: 8)


@contextlib.contextmanager
def default_fp_environment() -> Iterator[None]:
    """Run the block with the C default floating-point environment, then restore the thread's own.

    XLA's CPU threads compute with denormals flushed to zero (FTZ/DAZ set in
    MXCSR on x86, FZ in FPCR on ARM), and ``jax.pure_callback`` runs Python on
    such a thread.  LAPACK's SVD is not written for that mode: on a rank-deficient
    float32 gradient (e.g. a first step's ``(softmax - onehot)^T X`` of rank
    B < m) the trailing singular values pass through the denormal range,
    ``DLASCL`` sees a scale that reads as zero, prints ``DLASCL parameter number
    4 had an illegal value`` and the SVD does not converge.  The same matrix
    decomposes on the Python thread.  Restoring the default environment (IEEE
    gradual underflow) makes the callback compute exactly what the eager core
    computes.  Without glibc's ``fesetenv`` this is a no-op.
    """
    if _LIBC is None:  # pragma: no cover - not glibc
        yield
        return
    saved = ctypes.create_string_buffer(_FENV_BYTES)
    _LIBC.fegetenv(saved)
    _LIBC.fesetenv(_FE_DFL_ENV)
    try:
        yield
    finally:
        _LIBC.fesetenv(saved)


def refresh_when_due(
    states: Sequence[State],
    grads: Sequence[Any],
    cfg: BaseConfig,
    *,
    names: Sequence[str] | None = None,
    period: Any = None,
) -> tuple[list[State], list[Any]]:
    """Every rotated parameter's bases ``P_t, _, Q_t^T = canonical_svd(G_t)`` when step ``t`` is due, in one
    ``jax.lax.cond`` and one ``jax.pure_callback`` (traceable under ``jax.jit``; JAX arrays).

    ``states`` are core states (:func:`adadiag_ref.init`) of parameters that step together (one counter: ``due``
    is read from the first rotated state's ``count``, :func:`traced_refresh_due` with ``period``, default
    ``cfg``), ``grads`` their gradients.  Returns ``(states, refreshed)``: the states with the bases of the step
    (moments and counts untouched) and, per parameter, the ``refreshed`` to pass to :func:`adadiag_ref.update`: a
    traced bool, true only when a due refresh computed new bases from that gradient (a NaN or Inf gradient, or a
    decomposition failing on every rung, keeps the previous bases with a warning, as the eager core does), or
    ``False`` for a parameter without a basis (no callback at all when none has one).  ``names`` label the
    parameters in warnings.  Under ``jax.vmap`` with a batched counter the ``cond`` becomes a ``select``: the
    callback then runs at every step and refreshes only the members that are due.
    """
    import jax
    import jax.numpy as jnp

    states_l: list[Any] = list(states)
    grads_l = list(grads)
    names_l = [str(i) for i in range(len(states_l))] if names is None else [str(n) for n in names]
    rotated = [i for i, state in enumerate(states_l) if state.P is not None]
    refreshed: list[Any] = [False] * len(states_l)
    if not rotated:  # baselines and vectors only: nothing to refresh, no callback
        return states_l, refreshed
    leaves: list[_RotatedLeaf] = []
    bases: list[Any] = []
    for i in rotated:
        state = states_l[i]
        dtype = np.dtype(state.P.dtype)
        leaves.append(_RotatedLeaf(names_l[i], tuple(grads_l[i].shape), dtype, state.Q is not None, len(bases)))
        bases.extend(b for b in (state.P, state.Q) if b is not None)
    count = states_l[rotated[0]].count
    due = traced_refresh_due(count, cfg if period is None else period)
    shapes = (
        *(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bases),
        jax.ShapeDtypeStruct((len(rotated),), jnp.bool_),
    )
    callback = _host_refresh(cfg, leaves)

    def do_refresh(operands: Any) -> tuple[list[Any], Any]:
        *new, flags = jax.pure_callback(callback, shapes, *operands, vmap_method="broadcast_all")
        return new, flags

    def keep(operands: Any) -> tuple[list[Any], Any]:
        return list(operands[2 + len(rotated) :]), jnp.zeros((len(rotated),), jnp.bool_)

    operands = (due, count, *(grads_l[i] for i in rotated), *bases)
    new_bases, flags = jax.lax.cond(due, do_refresh, keep, operands)
    out = list(states_l)
    for j, (i, leaf) in enumerate(zip(rotated, leaves, strict=True)):
        P, Q = new_bases[leaf.first], new_bases[leaf.first + 1] if leaf.two_sided else None
        out[i], refreshed[i] = states_l[i]._replace(P=P, Q=Q), flags[j]
    return out, refreshed
