"""The Adam-family update fused into one or two numba passes (NumPy, float32/float64).

:func:`~adadiag_ref.optim.core.update` takes this route when it applies (the
family is Adam, the arrays are NumPy arrays of one float dtype laid out alike,
``lr`` is a Python number, numba is installed and ``cfg.kernels`` is not
``"reference"``); otherwise it runs the generic code.  Same
formulas, same operation order, same BLAS calls as the generic code, so the
results are bit-identical (``tests/test_fused.py`` compares with
``array_equal``); only the number of passes over memory and of temporaries
changes:

* no rotation (AdamW, and any parameter whose bases are absent): one pass reads
  ``G, W, M_{t-1}, V_{t-1}`` and writes ``M_t, V_t`` and
  ``delta = -eta_t (U + lambda W_t)``, ``U = M_t / (sqrt(V_t) + eps)``: three
  new arrays (the generic code makes four to six, in three to five passes);
* with rotation: ``G~ = P^T G Q`` (BLAS, a new array), one pass writing ``M_t``,
  ``V_t`` and ``U~`` (into ``G~``'s buffer, which this call owns), ``P U~ Q^T``
  (BLAS, a new array) and one pass scaling it in place into ``delta``.

Nothing passed in is modified: every output lives in memory allocated here.
The exception is :func:`adam_step_owned`, for a driver that owns the state
(``replay``): it updates the moments in place and writes ``W_{t+1}`` into the
driver's array, ten array passes per rotated step instead of thirteen.
Arrays of at least :data:`PARALLEL_MIN_SIZE` entries are processed by numba's
thread pool between the BLAS calls when numba's threading layer is
``workqueue`` (``NUMBA_THREADING_LAYER=workqueue``; ``adadiag-ref bench`` sets
it), whose idle threads do not spin next to OpenBLAS's; otherwise serially.
Elementwise work, so the result does not depend on the thread count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import _kernels, buffers
from .._xp import Array, Namespace
from ..config import BaseConfig
from .families import State
from .schedules import beta_hat

__all__ = ["PARALLEL_MIN_SIZE", "adam_step_owned", "adam_update", "kernel_scalars"]

#: Arrays with at least this many entries use the parallel kernels (smaller ones: the pool's start-up dominates).
PARALLEL_MIN_SIZE = 1 << 18


def alike(*arrays: np.ndarray) -> bool:
    """Same shape and strides, and contiguous: entry ``k`` of every ``ravel(order="K")`` view is the same ``(i, j)``."""
    first = arrays[0]
    if not (first.flags.c_contiguous or first.flags.f_contiguous):
        return False
    return all(a.shape == first.shape and a.strides == first.strides for a in arrays[1:])


def flat(a: np.ndarray) -> np.ndarray:
    """The 1-D view of a contiguous array in memory order (no copy)."""
    return a.ravel(order="K")


class _Scalars(NamedTuple):
    """The step's scalars in the state dtype, as the generic code rounds them, and the route's choices."""

    b1: Any
    c1: Any
    b2: Any
    c2: Any
    eps: Any
    neg_lr: Any
    wd: Any
    decay: bool
    parallel: bool
    rotated: bool


def _applies(
    state: State, t: Array, g_rot: Array, w: Array, cfg: BaseConfig, lr: Any, xp: Namespace
) -> _Scalars | None:
    """The fused route's scalars, or ``None`` when it does not apply (see the module docstring)."""
    if cfg.family != "adam" or isinstance(lr, bool) or not isinstance(lr, int | float):
        return None
    M0, V0 = state.M, state.V  # type: ignore[union-attr]
    if M0 is None or not _kernels.usable(xp, g_rot, M0, V0, w):
        return None
    rotated = state.P is not None or state.Q is not None
    if not alike(g_rot, M0, V0, *(() if rotated else (w,))):
        return None
    b1_t = beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction)
    b2_t = beta_hat(cfg.betas[1], t, xp, bias_correction=cfg.bias_correction)
    parallel = g_rot.size >= PARALLEL_MIN_SIZE and _kernels.pool_does_not_spin()
    return _Scalars(*kernel_scalars(b1_t, b2_t, cfg, lr, g_rot.dtype), parallel, rotated)


def kernel_scalars(
    b1_t: Any, b2_t: Any, cfg: BaseConfig, lr: Any, dtype: Any
) -> tuple[Any, Any, Any, Any, Any, Any, Any, bool]:
    """``(b1, 1 - b1, b2, 1 - b2, eps, -eta, lambda, decay)`` for the Adam kernels, rounded as the generic code
    rounds them: ``b * old + (1 - b) * new`` with ``1 - b`` in the state dtype, and the Python numbers eps,
    lambda and -eta entering its array arithmetic in the state dtype (NumPy's weak scalars); ``decay`` is
    ``lambda != 0``.  ``b1_t``, ``b2_t`` are the step's beta-hats (:func:`~adadiag_ref.optim.schedules.beta_hat`)."""
    b1, c1, b2, c2 = _kernels.adam_coefficients(b1_t, b2_t, dtype)
    eps, neg_lr, wd = (_kernels.scalar(x, dtype) for x in (cfg.eps, -lr, cfg.weight_decay))
    return b1, c1, b2, c2, eps, neg_lr, wd, bool(cfg.weight_decay)


def adam_update(
    state: State,
    layout: Any,
    t: Array,
    g_rot: Array,
    w: Array,
    cfg: BaseConfig,
    lr: Any,
    unrotate: Callable[..., Array],
    xp: Namespace,
) -> tuple[Array, dict[str, Array]] | None:
    """``(delta, {"M": M_t, "V": V_t})`` of ``update``'s Adam family, or ``None`` when the route does not apply.

    ``delta = -eta_t (P U~ Q^T + lambda W_t)`` is returned in the work frame and the state dtype (the caller
    applies ``from_work`` and the parameter's dtype, as for the generic code).

    ``g_rot`` is ``G~`` as ``prepare_step`` made it (with its noise floor): a new
    array whenever a basis exists, which this call then reuses for ``U~``.
    ``unrotate`` is the core's ``P U~ Q^T`` (passed in, so both routes share one
    implementation of the rotation).
    """
    sc = _applies(state, t, g_rot, w, cfg, lr, xp)
    if sc is None:
        return None
    M0, V0 = state.M, state.V  # type: ignore[union-attr]
    assert M0 is not None and V0 is not None  # _applies checked
    M = buffers.empty_like(g_rot)  # resident pages from the pool, not fresh ones (adadiag_ref.buffers)
    V = buffers.empty_like(g_rot)
    if not sc.rotated:
        D = buffers.empty_like(g_rot)
        kernel = _kernels.adam_delta_flat_parallel if sc.parallel else _kernels.adam_delta_flat
        kernel(flat(M0), flat(V0), flat(g_rot), flat(w), sc.b1, sc.c1, sc.b2, sc.c2, sc.eps, sc.neg_lr, sc.wd,
               sc.decay, flat(M), flat(V), flat(D))  # fmt: skip
    else:
        moments = _kernels.adam_moments_over_flat_parallel if sc.parallel else _kernels.adam_moments_over_flat
        moments(flat(M0), flat(V0), flat(g_rot), sc.b1, sc.c1, sc.b2, sc.c2, sc.eps, flat(M), flat(V))
        D = unrotate(g_rot, state.P, state.Q, xp, transposed=layout.transposed)
        if type(D) is np.ndarray and D.dtype == g_rot.dtype and alike(D, w):
            scale = _kernels.scale_direction_flat_parallel if sc.parallel else _kernels.scale_direction_flat
            scale(flat(D), flat(w), sc.neg_lr, sc.wd, sc.decay)
        else:  # pragma: no cover - BLAS outputs are contiguous; the generic expressions otherwise
            if sc.decay:
                D = D + cfg.weight_decay * w
            D = -lr * D
    return D, {"M": M, "V": V}


def adam_step_owned(
    state: State,
    layout: Any,
    t: Array,
    g_rot: Array,
    w: Array,
    cfg: BaseConfig,
    lr: Any,
    unrotate: Callable[..., Array],
    xp: Namespace,
    out: Array,
) -> int | None:
    """A rotated Adam-family step for a driver that owns ``state`` (``replay``): the moments updated in place and
    ``W_{t+1} = W_t + delta`` written into ``out``; ``None`` (nothing written) when the route does not apply.

    Returns the number of NaN or Inf entries of ``G~`` the moments pass read (the same pass, no extra read):
    zero proves ``G`` finite (``_kernels._adam_moments_own_counted_flat``), so the driver needs no separate scan
    of ``G`` on a step without refresh.

    The same kernels' formulas as :func:`adam_update`, so the same bits: ``M, V <- b M + c G~, ...`` and ``U~``
    over ``G~``'s fresh buffer in one pass, ``D = P U~ Q^T`` (BLAS), then one pass reading ``W_t`` and ``D`` and
    writing ``out`` (``out`` must not overlap ``W_t``).  Ten array passes per step where the functional form and
    a separate ``W + delta`` make thirteen, and no moment-sized allocation.  Applies to rotated parameters only
    (``G~`` must be this call's own array); ``out`` is the work-frame view of the parameter-shaped destination,
    of the state dtype.
    """
    sc = _applies(state, t, g_rot, w, cfg, lr, xp)
    if sc is None or not sc.rotated or type(out) is not np.ndarray or not alike(out, w) or out.dtype != w.dtype:
        return None
    moments = _kernels.adam_moments_own_counted_flat_parallel if sc.parallel else _kernels.adam_moments_own_counted_flat
    M, V = state.M, state.V  # type: ignore[union-attr]
    assert M is not None and V is not None  # _applies checked
    nonfinite = int(moments(flat(M), flat(V), flat(g_rot), sc.b1, sc.c1, sc.b2, sc.c2, sc.eps))
    D = unrotate(g_rot, state.P, state.Q, xp, transposed=layout.transposed)
    if type(D) is np.ndarray and D.dtype == w.dtype and alike(D, w):
        apply = _kernels.apply_direction_into_flat_parallel if sc.parallel else _kernels.apply_direction_into_flat
        apply(flat(w), flat(D), sc.neg_lr, sc.wd, sc.decay, flat(out))
    else:  # pragma: no cover - BLAS outputs are contiguous; the generic expressions otherwise
        np.add(w, -lr * (D + cfg.weight_decay * w if sc.decay else D), out=out)
    return nonfinite
