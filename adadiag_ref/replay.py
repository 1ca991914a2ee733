"""``replay``: feed one gradient stream to an optimizer and record the trajectory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from array_api_compat import is_numpy_namespace

from . import buffers
from ._xp import Array, namespace
from .config import make_config
from .optim import init, step

__all__ = ["replay"]


def replay(
    name: str,
    w0: Array,
    grads: Array | Sequence[Array],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float | None = None,
    weight_decay: float = 0.0,
    update_freq: int | None = 200,
    **family_options: Any,
) -> Array:
    """Run optimizer ``name`` from ``W_0 = w0`` on the given gradients.

    Step ``t`` (1-based) uses ``grads[t - 1]`` as ``G_t`` (the gradients are
    given, not recomputed from ``W_t``), refreshes the basis when
    ``t == 1`` or ``(t - 1) mod T == 0`` and applies
    ``W_{t+1} = W_t - eta (P U~ Q^T + lambda W_t)``.

    Args:
        name: one of ``adamw, adadiag, adadiag_pp, adafactor, adafacdiag,
            adafacdiag_pp, hfac, hfacdiag``.
        w0: initial parameter, any shape, any supported backend.
        grads: an array of shape ``(K, *w0.shape)`` or a sequence of K arrays.
        lr, betas, weight_decay, update_freq: the paper's eta, (beta_1, beta_2),
            lambda and T.  ``betas=(0.0, b2)`` turns momentum off.
        eps: the smoothing term epsilon; ``None`` takes the family default
            (1e-8 for the Adam family, 1e-30 added to ``G~^2`` otherwise).
        **family_options: extra config fields, e.g. ``momentum=False``,
            ``clip_threshold``, ``beta2_schedule``, ``max_basis_dim``,
            ``batch_dims`` (``w0`` of shape ``(*B, *S)``: ``prod(B)`` independent
            parameters of shape ``S``, :attr:`~adadiag_ref.config.BaseConfig.batch_dims`).

    Returns:
        An array of shape ``(K, *w0.shape)`` on ``w0``'s backend and device:
        the parameter after each step.
    """
    xp = namespace(w0)
    cfg = make_config(
        name,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        update_freq=update_freq,
        **family_options,
    )
    n_steps = int(grads.shape[0]) if hasattr(grads, "shape") else len(grads)
    state = init(w0, cfg, xp=xp)
    w = w0
    if is_numpy_namespace(xp):
        # W_{t+1} written straight into the result (no copy, no stack); the state never leaves this function, so
        # its moments may be updated in place (step's out=: the same bits)
        out = buffers.empty((n_steps, *w0.shape), w0.dtype)
        for k in range(n_steps):
            g = grads[k, ...] if hasattr(grads, "shape") else grads[k]  # type: ignore[call-overload]
            w, state = step(state, g, cfg, w, out=out[k, ...])
        return out
    trajectory = []
    for k in range(n_steps):
        g = grads[k, ...] if hasattr(grads, "shape") else grads[k]  # type: ignore[call-overload]
        w, state = step(state, g, cfg, w, xp=xp)
        trajectory.append(w)
    if not trajectory:
        return xp.zeros((0, *w0.shape), dtype=w0.dtype)
    return xp.stack(trajectory, axis=0)
