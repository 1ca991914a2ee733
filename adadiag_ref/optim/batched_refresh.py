"""The refreshes due at one step of many parameters, batched: :func:`refresh_bases` (and the host counts that
label their messages).  Shared by :func:`~adadiag_ref.multi_step` and the engine
(:class:`~adadiag_ref.optim.engine.Engine`), which calls it once per refresh step for all of its parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._xp import Array, Namespace, namespace, require_linalg
from ..config import BaseConfig
from ..linalg import canonical_svd_batch
from .core import _check_failure_policy, check_orientation, host_count, refresh_basis, work_dtype
from .families import State
from .layout import layout_for, to_work

__all__ = ["host_counts", "refresh_bases"]


def host_counts(count: Any, states: list[State], n: int) -> list[int]:
    """The steps taken per parameter: ``count`` (an int for all, or one per parameter) or each state's counter."""
    if count is None:
        return [int(s.count) for s in states]  # one read per state: pass count to avoid them
    if isinstance(count, Sequence) and not isinstance(count, str):
        if len(count) != n:
            raise ValueError(f"count has {len(count)} entries for {n} parameters")
        checked = [host_count(c) for c in count]
    else:
        checked = [host_count(count)] * n
    if None in checked:
        raise TypeError("count must be a host int, or one per parameter, not None entries")
    return checked  # type: ignore[return-value]


def refresh_bases(
    states: Sequence[State],
    grads: Sequence[Array],
    cfg: BaseConfig,
    *,
    names: Sequence[str | None] | None = None,
    on_nonfinite: str = "keep",
    on_failure: str = "keep",
    count: int | Sequence[int] | None = None,
    xp: Namespace | None = None,
) -> list[State]:
    """:func:`~adadiag_ref.refresh_basis` of many parameters: ``P_t, _, Q_t^T = canonical_svd(G_t)`` for each.

    The gradients are grouped by work shape, dtype and sides, and each group of two or more is decomposed by
    :func:`~adadiag_ref.linalg.canonical_svd_batch`: one stacked decomposition on a device backend (cuSOLVER
    and ``torch.linalg`` take stacks), one host read of its singular values, the bases formed on the device.
    Every parameter the batch does not decide (NumPy, a group of one, a non-finite gradient, a failed
    stacked decomposition) takes :func:`~adadiag_ref.refresh_basis`, so the failure policy (``on_nonfinite``,
    ``on_failure``, the warnings and the kept bases) and the messages are exactly its.  The bases are those of
    :func:`~adadiag_ref.refresh_basis` to rounding.  A stack of matrices (``cfg.batch_dims > 0``) is one
    batched decomposition of its own (:func:`~adadiag_ref.refresh_basis`).  ``names`` and ``count`` (host
    ints, one for all or one per parameter) only label messages.  Returns the new states, in order; moments untouched.
    """
    _check_failure_policy(on_nonfinite, on_failure)
    states_l, grads_l = list(states), list(grads)
    if len(states_l) != len(grads_l):
        raise ValueError(f"refresh_bases needs one gradient per state, got {len(states_l)} states and {len(grads_l)}")
    if not states_l:
        return []
    names_l = [None] * len(states_l) if names is None else list(names)
    if len(names_l) != len(states_l):
        raise ValueError(f"names has {len(names_l)} entries for {len(states_l)} states")
    counts: list[Any] = [None] * len(states_l) if count is None else host_counts(count, states_l, len(states_l))
    xp = namespace(*grads_l, xp=xp)
    for state, grad, name in zip(states_l, grads_l, names_l, strict=True):
        check_orientation(state, tuple(grad.shape), name=name)
    if any(layout_for(tuple(g.shape), cfg).rotate_left for g in grads_l):
        require_linalg(xp, f"the refresh of {cfg.name!r}")  # before any decomposition: one line, nothing changed
    groups: dict[tuple[Any, ...], list[tuple[int, Array]]] = {}
    out_of_group: list[int] = []
    for i, (state, grad) in enumerate(zip(states_l, grads_l, strict=True)):
        layout = layout_for(tuple(grad.shape), cfg)
        if layout.rotate_left and layout.batch:  # a stack: its own matrices make the batch (refresh_basis)
            out_of_group.append(i)
        elif layout.rotate_left:
            g = to_work(xp.astype(grad, work_dtype(state), copy=False), layout, xp)
            groups.setdefault((tuple(g.shape), g.dtype, layout.rotate_right), []).append((i, g))
    out = list(states_l)
    for i in out_of_group:
        out[i] = refresh_basis(states_l[i], grads_l[i], cfg, name=names_l[i], on_nonfinite=on_nonfinite,
                               on_failure=on_failure, count=counts[i], xp=xp)  # fmt: skip
    for (_, _, right), members in groups.items():
        batch = canonical_svd_batch([g for _, g in members], compute_p=True, compute_q=right, method=cfg.basis_method,
                                    xp=xp)  # fmt: skip
        for (i, _), svd in zip(members, batch, strict=True):
            if svd is None:
                out[i] = refresh_basis(states_l[i], grads_l[i], cfg, name=names_l[i], on_nonfinite=on_nonfinite,
                                       on_failure=on_failure, count=counts[i], xp=xp)  # fmt: skip
            else:
                out[i] = states_l[i]._replace(P=svd.P, Q=svd.Q if right else None)
    return out
