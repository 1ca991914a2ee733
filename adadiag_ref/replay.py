"""``replay``: feed one gradient stream to an optimizer and record the trajectory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, overload

import numpy as np

from ._xp import Array, namespace, to_numpy
from .config import BaseConfig, make_config
from .linalg import basis_conditioning
from .optim import init, layout_for, refresh_due, step, to_work

__all__ = ["Replay", "refresh_conditioning", "replay", "trajectory_conditioning"]


class Replay(NamedTuple):
    """:func:`replay`'s result with ``conditioning=True``: the trajectory and the basis conditioning per step."""

    params: Array
    conditioning: np.ndarray


def refresh_conditioning(cfg: BaseConfig, grad: Any) -> float:
    """The conditioning of the bases a refresh computes from ``grad`` (:func:`~adadiag_ref.linalg.basis_conditioning`).

    The singular values of the work-frame gradient (``m x n``, ``m <= n``; each matrix of a ``batch_dims``
    stack, the largest value over the stack), computed in float64; the gradient's own dtype sets ``eps``.
    ``0.0`` when the refresh computes no basis (AdamW, Adafactor,
    Hfac, a 1-D parameter, a side over ``max_basis_dim``).
    """
    host = np.asarray(to_numpy(grad))
    layout = layout_for(tuple(host.shape), cfg)
    if not layout.rotate_left:
        return 0.0
    work = np.asarray(to_work(host, layout, np), dtype=np.float64)
    m, n = layout.rows, layout.cols
    singular = np.linalg.svd(work.reshape(-1, m, n), compute_uv=False)
    return max(basis_conditioning(S, m, n, host.dtype) for S in singular)


def trajectory_conditioning(cfg: BaseConfig, grads: Any) -> np.ndarray:
    """``kappa_t`` for ``t = 1..K``: the largest :func:`refresh_conditioning` of the refreshes at steps ``<= t``.

    A basis error made at a refresh stays in the parameters for the rest of the run, so the tolerance of
    ``W_{t+1}`` (docs/golden.md, "Tolerances") follows the worst refresh so far.  Shape ``(K,)``, float64.
    """
    n_steps = int(grads.shape[0]) if hasattr(grads, "shape") else len(grads)
    out = np.zeros(n_steps)
    worst = 0.0
    for k in range(n_steps):
        if refresh_due(k, cfg):
            worst = max(worst, refresh_conditioning(cfg, grads[k]))
        out[k] = worst
    return out


@overload
def replay(
    name: str,
    w0: Array,
    grads: Array | Sequence[Array],
    *,
    lr: float,
    betas: tuple[float, float] = ...,
    eps: float | None = ...,
    weight_decay: float = ...,
    update_freq: int | None = ...,
    conditioning: Literal[False] = ...,
    **family_options: Any,
) -> Array: ...


@overload
def replay(
    name: str,
    w0: Array,
    grads: Array | Sequence[Array],
    *,
    lr: float,
    betas: tuple[float, float] = ...,
    eps: float | None = ...,
    weight_decay: float = ...,
    update_freq: int | None = ...,
    conditioning: Literal[True],
    **family_options: Any,
) -> Replay: ...


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
    conditioning: bool = False,
    **family_options: Any,
) -> Array | Replay:
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
        conditioning: also return how well each step's bases are determined
            (:func:`trajectory_conditioning`, computed from the gradients at the refresh steps).
        **family_options: extra config fields, e.g. ``momentum=False``,
            ``clip_threshold``, ``beta2_schedule``, ``max_basis_dim``,
            ``batch_dims`` (``w0`` of shape ``(*B, *S)``: ``prod(B)`` independent
            parameters of shape ``S``, :attr:`~adadiag_ref.config.BaseConfig.batch_dims`).

    Returns:
        An array of shape ``(K, *w0.shape)`` on ``w0``'s backend and device:
        the parameter after each step.  With ``conditioning=True`` a :class:`Replay`
        ``(params, conditioning)``, ``conditioning`` a ``(K,)`` NumPy array: ``kappa_t``,
        whose tolerance (``adadiag_ref.golden.conditioning_rtol``) bounds the difference
        between two correct implementations at step ``t``.
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
    params = _run(cfg, w0, grads, xp)
    return Replay(params, trajectory_conditioning(cfg, grads)) if conditioning else params


def _run(cfg: BaseConfig, w0: Array, grads: Array | Sequence[Array], xp: Any) -> Array:
    """The parameter after every step, ``(K, *w0.shape)`` on ``w0``'s backend."""
    n_steps = int(grads.shape[0]) if hasattr(grads, "shape") else len(grads)
    state = init(w0, cfg, xp=xp)
    w = w0
    trajectory = []
    for k in range(n_steps):
        g = grads[k, ...] if hasattr(grads, "shape") else grads[k]  # type: ignore[call-overload]
        w, state = step(state, g, cfg, w, xp=xp)
        trajectory.append(w)
    if not trajectory:
        return xp.zeros((0, *w0.shape), dtype=w0.dtype)
    return xp.stack(trajectory, axis=0)
