"""One step over many parameters: :func:`multi_step`, and the batched refresh :func:`refresh_bases`.

:func:`multi_step` is the functional form of the multi-parameter engine (:class:`~adadiag_ref.optim.engine.
Engine`): it builds an engine from the given states (their moments gathered into the engine's flat groups, the
bases of each rotation block stacked), takes one step and hands back the new parameters and states (views of
the engine's arrays).  Everything the engine does per step is therefore what ``multi_step`` does: every gradient
checked, one finiteness verdict read back for all of them, the refreshes due batched (:func:`refresh_bases`),
an entrywise family's moments, direction and tail once per flat group, the rotations as batched GEMMs per work
shape.  A driver that steps repeatedly keeps an :class:`~adadiag_ref.optim.engine.Engine` instead, and saves
the gathering of the states on every call.

Per parameter the results are those of :func:`~adadiag_ref.step` with the same ``count``: bit for bit where both
take the reference arithmetic, to rounding where one of them takes a fused kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._xp import Namespace, namespace
from ..config import BaseConfig, check_learning_rate, step_config
from .batched_refresh import host_counts, refresh_bases
from .core import check_gradient_matches, check_state, step_namespace
from .engine import Engine, key_mismatch

__all__ = ["multi_step", "refresh_bases"]


def _as_lists(states: Any, grads: Any, params: Any, names: Any) -> tuple[list[Any], ...]:
    """The four inputs as equal-length lists (a mapping of parameters gives the order and the names)."""
    if isinstance(params, Mapping):
        keys = list(params)
        for label, other in (("states", states), ("grads", grads)):
            if not isinstance(other, Mapping):
                raise TypeError(f"params is a mapping: {label} must be a mapping with the same keys, not a "
                                f"{type(other).__name__}")  # fmt: skip
            if set(other) != set(keys):
                raise key_mismatch(label, keys, list(other))
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


def multi_step(
    states: Any,
    grads: Any,
    cfg: BaseConfig,
    params: Any,
    *,
    lr: Any = None,
    weight_decay: Any = None,
    betas: Any = None,
    check: bool = True,
    names: Sequence[str | None] | None = None,
    count: int | Sequence[int] | None = None,
    xp: Namespace | None = None,
) -> tuple[Any, Any]:
    """:func:`~adadiag_ref.step` for every parameter of a model at once: ``W_{t+1} = W_t + delta`` for each.

    ``states``, ``grads`` and ``params`` are equal-length sequences (lists, tuples), or mappings with the same
    keys (the keys then name the parameters in messages); returns ``(new_params, new_states)`` in the same
    form (lists for sequences, dicts for mappings).  ``cfg``, ``lr``, ``weight_decay``, ``betas`` and ``check``
    are ``step``'s (the hyperparameters validated before anything is computed);
    ``names`` labels the parameters of sequences in messages.  ``count`` (host ints, the steps taken): one
    int for all parameters or one per parameter; ``None`` reads each state's counter.

    Order of work (:class:`~adadiag_ref.optim.engine.Engine`): the shapes and dtypes of every parameter and
    state, then the refreshes due (with ``check=True`` after the finiteness verdict), then the updates; on a step
    without refresh on a device backend the verdict (one host synchronisation) is read after the update is
    queued and before anything is returned.  An invalid input raises ``ValueError`` (a non-finite gradient's
    names the parameter); the inputs are never modified.  With ``count`` given and ``check=False``, a step
    without refresh reads nothing back from the device.
    """
    mapping_keys = list(params) if isinstance(params, Mapping) else None
    states_l, grads_l, params_l, names_l = _as_lists(states, grads, params, names)
    if not params_l:
        return ({} if mapping_keys is not None else []), ({} if mapping_keys is not None else [])
    check_learning_rate(lr)
    step_cfg = step_config(cfg, weight_decay=weight_decay, betas=betas)
    for g, p, n in zip(grads_l, params_l, names_l, strict=True):
        step_namespace(g, p, xp, n)  # a gradient of another library than its parameter, named
    xp = namespace(*grads_l, *params_l, xp=xp)
    counts = host_counts(count, states_l, len(params_l))
    for s, g, p, n in zip(states_l, grads_l, params_l, names_l, strict=True):
        check_state(s, g, p, cfg, name=n)
        check_gradient_matches(g, p, xp, name=n)
    engine = Engine.from_states(states_l, params_l, cfg, names=names_l, count=counts, xp=xp)
    new_params = engine._advance(grads_l, params_l, lr, check, False, step_cfg)
    new_states = [engine.state(i) for i in range(len(params_l))]
    if mapping_keys is not None:
        return dict(zip(mapping_keys, new_params, strict=True)), dict(zip(mapping_keys, new_states, strict=True))
    return new_params, new_states
