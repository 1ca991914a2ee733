"""One step over many parameters: :func:`multi_step`, for drivers that update a whole model per call.

Per parameter it computes what :func:`~adadiag_ref.step` computes.  What it adds is the grouping a device
backend needs, where each call on an array is a kernel launch and each value read back is a synchronisation:

* **one synchronisation for the checks**: every gradient's finiteness is reduced to one number per parameter
  and the verdict over all of them is read once (a suspect is then examined exactly, only on the error path);
  everything is validated before anything is computed, so an error leaves every state untouched;
* **a host counter** (``count``): the refresh schedule and the coefficients of the step never read a device
  counter (with ``count=None`` each state's counter is read once);
* **the refreshes due at the step batched** (:func:`refresh_bases`): the gradients of one work shape and dtype
  are decomposed by one stacked call of the backend's ``svd`` (or ``eigh`` of their Gram stack); only the
  singular values come to the host (rank and clusters), the factors stay on the device (docs/spec.md, section 4);
* **launches that do not grow with the number of parameters**: for a family whose moment rule is entrywise
  (:attr:`~adadiag_ref.optim.families.FamilySpec.entrywise`, the Adam family), the parameters sharing a
  dtype form one flat group: the rotated gradients ``G~``, the moments, ``W`` and the directions are
  concatenated, and the moment update, the direction and the tail ``delta = -eta (P U~ Q^T + lambda W)`` run
  once over the concatenation (their entries do not interact).  Only the rotations (GEMMs, per rotated
  parameter) and views remain per parameter.  The new parameters and moments are views into the group's
  flat results.  On NumPy, where a call costs no launch and a concatenation costs a pass over memory, each
  parameter takes :func:`~adadiag_ref.step` instead (its fused numba routes).

Each entry of a flat group is computed by the same expression with the same scalar coefficients as the
per-parameter step, so the results are those of :func:`~adadiag_ref.step` with the same ``count``: bit for
bit where both take the reference arithmetic, to rounding where one of them takes a fused kernel.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from array_api_compat import is_numpy_namespace

from .._xp import Array, Namespace, count_nonfinite, creation_device, namespace
from ..config import BaseConfig
from ..linalg import canonical_svd_batch
from .core import (
    _check_failure_policy,
    _check_form,
    _where,
    check_orientation,
    host_count,
    prepare_step,
    refresh_basis,
    refresh_due,
    step,
    update,
    work_dtype,
)
from .dispatch import direction as family_direction
from .families import State, family_of
from .layout import from_work, layout_for, to_work
from .rotation import unrotate
from .schedules import learning_rate
from .tail import decays

__all__ = ["multi_step", "refresh_bases"]


def _as_lists(states: Any, grads: Any, params: Any, names: Any) -> tuple[list[Any], ...]:
    """The four inputs as equal-length lists (a mapping of parameters gives the order and the names)."""
    if isinstance(params, Mapping):
        keys = list(params)
        for label, other in (("states", states), ("grads", grads)):
            if not isinstance(other, Mapping) or set(other) != set(keys):
                raise ValueError(f"params is a mapping: {label} must be a mapping with the same keys")
        return [states[k] for k in keys], [grads[k] for k in keys], [params[k] for k in keys], [str(k) for k in keys]
    if not all(isinstance(x, Sequence) for x in (states, grads, params)):
        raise TypeError("multi_step takes sequences (lists or tuples) or mappings of states, gradients and parameters")
    if not len(states) == len(grads) == len(params):
        raise ValueError(
            f"multi_step needs one state and one gradient per parameter, got {len(states)} states, "
            f"{len(grads)} gradients and {len(params)} parameters"
        )
    if names is None:
        names = [None] * len(params)
    elif len(names) != len(params):
        raise ValueError(f"names has {len(names)} entries for {len(params)} parameters")
    return list(states), list(grads), list(params), list(names)


def _host_counts(count: Any, states: list[State], n: int) -> list[int]:
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


def _check_finite_all(
    states: list[State], grads: list[Array], params: list[Array], names: list[Any], counts: list[int], xp: Namespace
) -> None:
    """Every gradient finite, read back once: one sum per gradient, the verdict over all of them in one value.

    A sum is NaN or Inf whenever an entry is, and may also overflow on finite entries, so a non-finite sum is
    only a suspicion, settled exactly (:func:`~adadiag_ref._xp.count_nonfinite`) for the suspects alone.
    """
    if not grads:
        return
    if is_numpy_namespace(xp):  # no device: the exact scan, per gradient
        suspects = list(range(len(grads)))
    else:
        sums = xp.stack([xp.astype(xp.sum(g), xp.float32) for g in grads])
        if bool(xp.all(xp.isfinite(sums))):  # the one synchronisation of a step
            return
        flags = xp.isfinite(sums)
        suspects = [i for i in range(len(grads)) if not bool(flags[i])]
    for i in suspects:
        bad = count_nonfinite(grads[i], xp)
        if bad:
            raise ValueError(
                f"non-finite gradient: {bad} NaN or Inf entr{'y' if bad == 1 else 'ies'} in the gradient of "
                f"{_where(names[i], states[i], tuple(params[i].shape), counts[i])}; no parameter and no "
                "optimizer state was changed"
            )


def multi_step(
    states: Any,
    grads: Any,
    cfg: BaseConfig,
    params: Any,
    *,
    lr: Any = None,
    check: bool = True,
    names: Sequence[str | None] | None = None,
    count: int | Sequence[int] | None = None,
    xp: Namespace | None = None,
) -> tuple[Any, Any]:
    """:func:`~adadiag_ref.step` for every parameter of a model at once: ``W_{t+1} = W_t + delta`` for each.

    ``states``, ``grads`` and ``params`` are equal-length sequences (lists, tuples), or mappings with the same
    keys (the keys then name the parameters in messages); returns ``(new_params, new_states)`` in the same
    form (lists for sequences, dicts for mappings).  ``cfg``, ``lr`` and ``check`` are ``step``'s;
    ``names`` labels the parameters of sequences in messages.  ``count`` (host ints, the steps taken): one
    int for all parameters or one per parameter; ``None`` reads each state's counter.

    Order of work (module docstring): the shapes and dtypes of every parameter, then with ``check=True``
    the finiteness of every gradient (one host synchronisation), then the refreshes due, then the updates.
    An invalid input raises ``ValueError`` before any state or parameter is computed; the inputs are never
    modified.  With ``count`` given and ``check=False``, a step without refresh reads nothing back from the
    device.
    """
    mapping_keys = list(params) if isinstance(params, Mapping) else None
    states_l, grads_l, params_l, names_l = _as_lists(states, grads, params, names)
    if not params_l:
        return ({} if mapping_keys is not None else []), ({} if mapping_keys is not None else [])
    xp = namespace(*grads_l, *params_l, xp=xp)
    counts = _host_counts(count, states_l, len(params_l))
    for s, g, p in zip(states_l, grads_l, params_l, strict=True):
        _check_form(s, g, cfg, p, xp)
    if check:
        _check_finite_all(states_l, grads_l, params_l, names_l, counts, xp)
    if is_numpy_namespace(xp):  # no launches to save: each parameter takes step's fused routes
        pairs = [
            step(s, g, cfg, p, lr=lr, check=False, name=nm, count=c, xp=xp)
            for s, g, p, nm, c in zip(states_l, grads_l, params_l, names_l, counts, strict=True)
        ]
        new_params, new_states = [p for p, _ in pairs], [s for _, s in pairs]
    else:
        current, refreshed = _refresh_all_due(states_l, grads_l, cfg, names_l, counts, xp)
        if family_of(cfg).entrywise:
            new_params, new_states = _flat_update(current, grads_l, cfg, params_l, refreshed, counts, lr, xp)
        else:
            new_params, new_states = [], []
            for s, g, p, r, c in zip(current, grads_l, params_l, refreshed, counts, strict=True):
                delta, new = update(s, g, cfg, p, lr=lr, refreshed=r, count=c, xp=xp)
                new_params.append(p + delta)
                new_states.append(new)
    if mapping_keys is not None:
        return dict(zip(mapping_keys, new_params, strict=True)), dict(zip(mapping_keys, new_states, strict=True))
    return new_params, new_states


def _refresh_all_due(
    states: list[State], grads: list[Array], cfg: BaseConfig, names: list[Any], counts: list[int], xp: Namespace
) -> tuple[list[State], list[bool]]:
    """The states after the refreshes due at this step (:func:`refresh_bases`, batched), and per parameter whether
    its bases were computed from this gradient (``False`` when none was due or a failed one kept the old)."""
    due = [i for i, c in enumerate(counts) if refresh_due(c, cfg)]
    current, refreshed = list(states), [False] * len(states)
    if due:
        new = refresh_bases([states[i] for i in due], [grads[i] for i in due], cfg, names=[names[i] for i in due],
                            count=[counts[i] for i in due], xp=xp)  # fmt: skip
        for i, state in zip(due, new, strict=True):
            current[i], refreshed[i] = state, state.P is not states[i].P
    return current, refreshed


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
    counts: list[Any] = [None] * len(states_l) if count is None else _host_counts(count, states_l, len(states_l))
    xp = namespace(*grads_l, xp=xp)
    for state, grad in zip(states_l, grads_l, strict=True):
        check_orientation(state, tuple(grad.shape))
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


def _in_memory_order(x: Array, layout: Any, xp: Namespace) -> Array:
    """A work-frame matrix in the parameter's orientation: the transposed view for a tall parameter, whose
    state matrices, ``G~`` and ``W`` keep the parameter's memory order (:func:`~adadiag_ref.init`), so that
    flattening it is a view, not a transposing copy."""
    return xp.matrix_transpose(x) if layout.transposed else x


def _flat(arrays: list[Array], layouts: list[Any], xp: Namespace) -> Array:
    """The arrays' entries one after another (one concatenation), each in its parameter's orientation: an
    entrywise rule does not care about the order of entries, only that every array of a parameter uses the same."""
    return xp.concat([xp.reshape(_in_memory_order(a, lay, xp), (-1,)) for a, lay in zip(arrays, layouts, strict=True)])


def _pieces(flat: Array, like: list[Array], layouts: list[Any], xp: Namespace) -> list[Array]:
    """:func:`_flat` undone: views of ``flat`` shaped like each of ``like`` (work frame), in the parameter's
    memory order."""
    out, start = [], 0
    for a, lay in zip(like, layouts, strict=True):
        size = math.prod(a.shape)
        shape = (*a.shape[:-2], a.shape[-1], a.shape[-2]) if lay.transposed else tuple(a.shape)
        out.append(_in_memory_order(xp.reshape(flat[start : start + size], shape), lay, xp))
        start += size
    return out


def _flat_update(
    states: list[State],
    grads: list[Array],
    cfg: BaseConfig,
    params: list[Array],
    refreshed: list[bool],
    counts: list[int],
    lr: Any,
    xp: Namespace,
) -> tuple[list[Array], list[State]]:
    """The updates of an entrywise family, one flat group per (state dtype, parameter dtype, step)."""
    inputs = zip(states, grads, params, refreshed, counts, strict=True)
    prepared = [prepare_step(s, g, cfg, p, r, xp, c) for s, g, p, r, c in inputs]
    groups: dict[tuple[Any, Any, int], list[int]] = {}
    for i, (step_in, p) in enumerate(zip(prepared, params, strict=True)):
        groups.setdefault((step_in.g_rot.dtype, p.dtype, counts[i]), []).append(i)
    new_params: list[Array] = [None] * len(params)
    new_states: list[Any] = [None] * len(params)
    family = family_of(cfg)
    eta = learning_rate(cfg, lr)
    for members in groups.values():
        g_rot = [prepared[i].g_rot for i in members]
        layouts = [prepared[i].layout for i in members]
        old = {name: _flat([getattr(states[i], name) for i in members], layouts, xp) for name in family.moment_fields}
        flat_state = family.state_type(count=None, P=None, Q=None, param_shape=None, **old)
        t = prepared[members[0]].t
        u_flat, moments = family_direction(flat_state, _flat(g_rot, layouts, xp), t, cfg, xp)
        directions = [
            unrotate(u, states[i].P, states[i].Q, xp, transposed=prepared[i].layout.transposed)
            for u, i in zip(_pieces(u_flat, g_rot, layouts, xp), members, strict=True)
        ]
        # the tail of tail.parameter_delta, the same expressions over the group: -eta_t (D + lambda W)
        w_flat = _flat([prepared[i].w for i in members], layouts, xp)
        d_flat = _flat(directions, layouts, xp)
        eta_t = family.step_size(cfg, t, w_flat, eta, xp)
        if decays(cfg):
            d_flat = d_flat + cfg.weight_decay * w_flat
        delta = xp.astype(-eta_t * d_flat, params[members[0]].dtype, copy=False)
        # W + delta in the parameter's dtype, entry by entry (the parameter's own order: its reshape is a view)
        params_flat = _flat([to_work(params[i], prepared[i].layout, xp) for i in members], layouts, xp)
        w_new = _pieces(params_flat + delta, g_rot, layouts, xp)
        new_moments = {name: _pieces(value, g_rot, layouts, xp) for name, value in moments.items()}
        # the group's common new counter, made once from the host count (one transfer, not a kernel per parameter)
        first = states[members[0]].count
        new_count = xp.asarray(counts[members[0]] + 1, dtype=first.dtype, device=creation_device(first))
        for k, i in enumerate(members):
            new_params[i] = from_work(w_new[k], prepared[i].layout, xp)
            new_states[i] = states[i]._replace(count=new_count, **{name: new_moments[name][k] for name in new_moments})
    return new_params, new_states
