r"""The Adam family's CuPy route (CUDA, float32/float64): the numba route's passes as ``cupy.ElementwiseKernel``\ s.

The same formulas, in the same order, as :mod:`.reference` (Algorithm 1 on the rotated gradient ``G~``)::

    M_t = b1 M_{t-1} + (1 - b1) G~,   V_t = b2 V_{t-1} + (1 - b2) G~^2,   U~ = M_t / (sqrt(V_t) + eps)
    delta = -eta (P U~ Q^T + lambda W_t)

with ``b1``, ``b2`` the step's bias-corrected beta-hats; one kernel per pass where the generic array-API code
launches one per operation (about ten per step).  Scalars and compilation as in
:mod:`adadiag_ref._kernels.cupy_kernels` (host coefficients as kernel scalars, device ones as 0-d arrays, no
multiply-add contraction).  The routes:

* :func:`direction`: ``M_t, V_t, U~`` in one kernel (new arrays in ``G~``'s memory order);
* :func:`update`: the whole functional update.  No rotation: one kernel reads ``G, W, M_{t-1}, V_{t-1}`` and
  writes ``M_t, V_t, delta``.  With rotation: one kernel writes ``M_t``, ``V_t`` and ``U~`` (over ``G~``, a
  product this call owns), the unrotation ``P U~ Q^T`` (cuBLAS), one kernel scales it in place into ``delta``;

Applies when ``cfg.kernels == "auto"`` and the arrays are CuPy float32/float64 of one dtype
(:func:`adadiag_ref._kernels.cupy_kernels.selected`); ``None`` / ``False`` otherwise, and the numba or
reference code runs.  Equal to the reference to rounding (``tests/test_cupy_kernels.py``: marked ``gpu``, not
run on a GPU yet; on the CPU, the kernel bodies evaluated by NumPy give the reference's bits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...._kernels import cupy_kernels as ck
from ...._kernels import is_host_number
from ...._xp import Array, Namespace
from ....config import BaseConfig
from ...schedules import beta_hats
from ...tail import decays
from ..common import Moments
from .reference import AdamState

__all__ = ["ADAM_ENTRY", "direction", "update"]

ADAM_SCALARS = "T b1, T c1, T b2, T c2, T eps"
"""The kernel arguments of one Adam entry (the EMA coefficients ``b``, ``1 - b`` and ``eps``)."""

ADAM_ENTRY = "\n".join(
    (
        "T m = b1 * m0 + c1 * x;",
        "T v = b2 * v0 + c2 * (x * x);",
        "T u = m / (sqrt(v) + eps);",
        "",
    )
)
"""One entry of the Adam direction over ``m0 = M_{t-1}``, ``v0 = V_{t-1}`` and ``x = G~`` (locals ``m, v, u``):
the reference's operations in its order, written once for every kernel below."""


def _direction_kernel() -> Any:
    """``(M0, V0, G~) -> (M_t, V_t, U~)``."""
    return ck.elementwise(
        "adadiag_adam_direction",
        f"T m0, T v0, T x, {ADAM_SCALARS}",
        "T M, T V, T U",
        ADAM_ENTRY + "M = m; V = v; U = u;",
    )


def _delta_kernel(decay: bool) -> Any:
    """``(M0, V0, G, W) -> (M_t, V_t, delta)``: the whole unrotated update."""
    return ck.elementwise(
        f"adadiag_adam_delta{'_decay' if decay else ''}",
        f"T m0, T v0, T x, T w, {ADAM_SCALARS}, T neg_lr, T wd",
        "T M, T V, T D",
        ADAM_ENTRY + f"M = m; V = v; D = {ck.tail_expression('u', 'w', decay)};",
    )


def _moments_over_kernel() -> Any:
    """``(M0, V0) -> (M_t, V_t)`` and ``GU: G~ -> U~`` (read, then overwritten)."""
    return ck.elementwise(
        "adadiag_adam_moments_over",
        f"T m0, T v0, {ADAM_SCALARS}",
        "T M, T V, T GU",
        "const T x = GU;\n" + ADAM_ENTRY + "M = m; V = v; GU = u;",
    )


def _scale_kernel(decay: bool) -> Any:
    """``D <- (-eta)(D + lambda W)`` in place (the tail over a fresh unrotated direction)."""
    return ck.elementwise(
        f"adadiag_scale_direction{'_decay' if decay else ''}",
        "T w, T neg_lr, T wd",
        "T D",
        f"D = {ck.tail_expression('D', 'w', decay)};",
    )


def _adam_scalars(t: Any, cfg: BaseConfig, dtype: Any, xp: Namespace) -> tuple[Any, ...] | None:
    """``(b1, 1 - b1, b2, 1 - b2, eps)`` of step ``t`` as kernel arguments
    (:func:`adadiag_ref._kernels.cupy_kernels.coefficient`); ``None`` when a coefficient is not of the state dtype."""
    b1_t, b2_t = beta_hats(cfg, t, xp)
    first, second = ck.ema_coefficients(b1_t, dtype), ck.ema_coefficients(b2_t, dtype)
    eps = ck.coefficient(cfg.eps, dtype)
    if first is None or second is None or eps is None:
        return None
    return (*first, *second, eps)


def _tail_scalars(cfg: BaseConfig, lr: Any, dtype: Any) -> tuple[Any, Any, bool] | None:
    """``(-eta, lambda, decay)`` as the reference's ``-eta * (D + lambda W)`` rounds them; ``None`` for a
    weight decay or learning rate the kernels do not take (an array ``lambda``, an ``eta`` of another dtype)."""
    if not is_host_number(cfg.weight_decay) or isinstance(lr, bool):
        return None
    neg_lr, wd = ck.coefficient(-lr, dtype), ck.coefficient(cfg.weight_decay, dtype)
    if neg_lr is None or wd is None:
        return None
    return neg_lr, wd, decays(cfg)


def direction(state: Any, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments] | None:
    """``(U~, {"M": M_t, "V": V_t})`` of the reference direction in one kernel; ``None`` unless the CuPy kernels
    are selected (module docstring)."""
    if not ck.selected(cfg, xp, g, state.M, state.V):
        return None
    sc = _adam_scalars(t, cfg, g.dtype, xp)
    if sc is None:
        return None
    import cupy

    M, V, U = cupy.empty_like(g), cupy.empty_like(g), cupy.empty_like(g)
    _direction_kernel()(state.M, state.V, g, *sc, M, V, U)
    return U, {"M": M, "V": V}


def update(
    state: AdamState,
    layout: Any,
    t: Array,
    g_rot: Array,
    w: Array,
    cfg: BaseConfig,
    lr: Any,
    unrotate: Callable[..., Array],
    xp: Namespace,
) -> tuple[Array, dict[str, Array]] | None:
    """``(delta, {"M": M_t, "V": V_t})`` of ``update`` for the Adam family on CuPy, or ``None`` when the route does
    not apply; ``delta`` in the work frame and the state dtype (the caller applies ``from_work`` and the
    parameter's dtype).  ``g_rot`` is ``prepare_step``'s ``G~``: a new array whenever a basis exists, reused here
    for ``U~``."""
    M0, V0 = state.M, state.V
    if not ck.selected(cfg, xp, g_rot, M0, V0, w):
        return None
    dtype = g_rot.dtype
    sc, tail = _adam_scalars(t, cfg, dtype, xp), _tail_scalars(cfg, lr, dtype)
    if sc is None or tail is None:
        return None
    neg_lr, wd, decay = tail
    import cupy

    M, V = cupy.empty_like(g_rot), cupy.empty_like(g_rot)
    if state.P is None and state.Q is None:
        D = cupy.empty_like(g_rot)
        _delta_kernel(decay)(M0, V0, g_rot, w, *sc, neg_lr, wd, M, V, D)
    else:
        _moments_over_kernel()(M0, V0, *sc, M, V, g_rot)
        D = unrotate(g_rot, state.P, state.Q, xp, transposed=layout.transposed)
        _scale_kernel(decay)(w, neg_lr, wd, D)
    return D, {"M": M, "V": V}
