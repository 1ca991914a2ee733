"""PyTorch adapter: ``torch.optim.Optimizer`` classes over the array-API core (docs/adapters.md, "PyTorch").

For every parameter with a gradient, one :meth:`CoreOptimizer.step` does what the core's eager driver
:func:`adadiag_ref.step` does, on the parameter's own tensors and device, bit for bit::

    check_inputs(S, G, cfg, W)                    # all parameters first: an error leaves every state untouched
    if refresh_due(t - 1):  S <- refresh_basis(S, G, cfg, name=NAME)   # P, Q <- canonical_svd(G)
    S <- update_in_place(S, G, cfg, W, lr=group["lr"], refreshed=...)
                                                  # W += delta, delta = -eta_t (P U~ Q^T + lambda W_t)

A plain tensor on any device is stepped by its param group's :class:`adadiag_ref.Engine`, kept between steps
(:class:`_GroupEngine`); FSDP2's sharded parameters by :mod:`._sharded`; any other tensor subclass by
``update_in_place`` (the reference's arithmetic in torch ops).  :meth:`CoreOptimizer.routes` says which.

``optimizer.state[p]`` is the core's NamedTuple state flattened field by field (:func:`from_core_state`): the
counter ``count`` under ``"step"`` (a host int32 0-d tensor), ``None`` fields absent, every array in the work frame
(``ar.layout_for``) and the state dtype (float64 for float64 parameters, else float32); the keys per optimizer are
in docs/adapters.md, "State layout".
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # name the extra instead of a bare "No module named 'torch'"
    raise ImportError(
        'adadiag_ref.adapters.pytorch needs PyTorch: pip install "adadiag-ref[torch]"', name=exc.name
    ) from exc

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import adadiag_ref as ar
from adadiag_ref.config import BaseConfig
from adadiag_ref.optim import layout_for, split_batch, warn_at_caller
from adadiag_ref.optim.families import family_of

from . import _sharded

__all__ = [
    "OPTIMIZER_CLASSES",
    "CoreOptimizer",
    "from_core_state",
    "optimizer_class",
    "to_core_state",
    *(entry.class_name for entry in ar.OPTIMIZERS.values()),
]


def from_core_state(state: Any) -> dict[str, torch.Tensor]:
    """Flatten a core NamedTuple state into torch's per-parameter dict (``count`` -> ``"step"``)."""
    return {"step": state.count} | {k: v for k, v in zip(state._fields[1:], state[1:], strict=True) if v is not None}


def to_core_state(flat: Mapping[str, torch.Tensor], cfg: BaseConfig) -> Any:
    """Rebuild the core NamedTuple state of ``cfg``'s family from the flat dict (absent fields are ``None``)."""
    state_type = family_of(cfg).state_type
    fields = state_type._fields  # type: ignore[attr-defined]
    unknown = sorted(set(flat) - {"step", *fields[1:]})
    if unknown or "step" not in flat:
        raise ValueError(
            f"state keys {sorted(flat)} do not belong to optimizer {cfg.name!r} (expected 'step' and a subset of "
            f"{list(fields[1:])}): was the state dict saved by another optimizer?"
        )
    return state_type(count=flat["step"], **{name: flat.get(name) for name in fields[1:]})


@functools.cache
def _config_fields_of(name: str) -> frozenset[str]:
    """The init fields of optimizer ``name``'s config a param group may set (all but ``name``, ``sides``, ``lr``)."""
    cls = ar.OPTIMIZERS[name].config_type
    return frozenset({f.name for f in dataclasses.fields(cls) if f.init} - {"name", "sides", "lr"} | {"momentum"})


def _hashable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    return value


def _number(value: Any) -> Any:
    """A hyperparameter as a Python number (a 1-element tensor is read once, as torch does); others unchanged."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        return value.item()
    return value


def _finite_at_least(value: Any, low: float, high: float = math.inf) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return low <= value < high


def validate_hyperparameters(group: Mapping[str, Any]) -> None:
    """torch.optim's checks and messages (``Invalid learning rate: nan``, ...), stricter only in refusing nan/inf:
    ``ValueError`` for ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``foreach`` (``None`` or a bool); the core
    config checks the other fields."""
    lr = _number(group["lr"])
    if not _finite_at_least(lr, 0.0):
        raise ValueError(f"Invalid learning rate: {lr}")
    eps = _number(group["eps"])
    if eps is not None and not _finite_at_least(eps, 0.0):
        raise ValueError(f"Invalid epsilon value: {eps}")
    betas = group["betas"]
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair (beta1, beta2))")
    for index, beta in enumerate(betas):
        if not _finite_at_least(_number(beta), 0.0, 1.0):
            raise ValueError(f"Invalid beta parameter at index {index}: {_number(beta)}")
    weight_decay = _number(group["weight_decay"])
    if not _finite_at_least(weight_decay, 0.0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    foreach = group.get("foreach")
    if foreach is not None and not isinstance(foreach, bool):
        raise ValueError(f"Invalid foreach value: {foreach!r} (expected None, True or False)")


_GRAD, _DTYPE, _SHAPE, _LAYOUT = (operator.attrgetter(a) for a in ("grad", "dtype", "shape", "layout"))
"""Read by ``map`` over a group's parameters at every step: a loop in C, no Python frame per parameter."""


_CONFIG_CACHE_SIZE = 64
"""Configs kept per optimizer: OneCycleLR changes ``betas`` at every step, so the cache must not grow without end."""


class CoreOptimizer(torch.optim.Optimizer):
    """Any of the core's eight optimizers as a ``torch.optim.Optimizer`` (docs/adapters.md, "PyTorch").

    Args:
        params: parameters or parameter groups (dicts), as for any torch optimizer;
            a group may override every keyword below.
        lr: learning rate eta (a float or a 1-element tensor); read from
            ``param_groups`` at every step, so ``torch.optim.lr_scheduler`` works.
        betas: (beta_1, beta_2).  ``beta_1 = 0`` turns momentum off.  OneCycleLR's
            ``cycle_momentum`` drives ``beta_1``.
        eps: smoothing term; ``None`` takes the family default (1e-8 Adam family,
            1e-30 Adafactor/Hfac families).
        weight_decay: decoupled weight decay lambda (``W <- W - eta (U + lambda W)``).
            The default is the core's 0.0 (``torch.optim.AdamW`` defaults to 0.01).
        update_freq: basis refresh period T (``None``: refresh at t = 1 only).
        maximize: ascend the objective (the gradient is negated before the core sees it).
        split_refresh: under ``torch.distributed`` with identical gradients on every rank (DDP), each matrix due
            for a refresh is decomposed by one rank (the ``j``-th by rank ``j mod world_size``) and its bases
            broadcast: the bits of every rank decomposing every matrix.  Ignored without a process group; FSDP2
            parameters always refresh this way, over their mesh's ranks.
        process_group: the ranks that step the same parameters (``None``: the default group), as DDP's.  With more
            than one rank in it, every ``step()`` first makes them agree (one all-reduce, 8 bytes per parameter) on
            which parameters have a gradient, that each is finite and valid, and on the step counters; a
            disagreement raises the same ``ValueError`` on every rank, with nothing changed, before any other
            collective (docs/adapters.md, "Ranks that disagree": pipeline stages pass their replicas' group).
        foreach: accepted as torch.optim accepts it (``None`` or a bool, else ``ValueError``) and changes nothing:
            every group's engine steps the group as a whole already (docs/adapters.md, "foreach").
        name: the core optimizer name; the subclasses fix it.
        **family_options: other core config fields (``max_basis_dim``, ``bias_correction``, ``state_dtype``,
            ``clip_threshold``, ``beta2_schedule``, ``decay_rate``, ``relative_step``, ``scale_parameter``,
            ``eps2``, ``momentum``, ``batch_dims``).  ``batch_dims=k`` in a param group (stacked experts
            ``(E, d, f)`` with ``k = 1``) makes each of its parameters ``prod(shape[:k])`` independent matrices,
            each with its own bases (docs/embedding.md).

    Errors are raised before anything changes, so on an error no parameter and no state has changed: invalid
    hyperparameters raise ``ValueError`` with torch.optim's messages (``Invalid learning rate: nan``) at
    construction, in ``add_param_group`` and, for values edited in ``param_groups``, at the next ``step()``; sparse
    or complex gradients and parameters ``RuntimeError``; a non-finite gradient (named by parameter and step), a
    mismatched shape or dtype, or a parameter with fewer than ``batch_dims`` dimensions ``ValueError``; a
    parameter whose matrix a wrapper hides (FSDP1, DeepSpeed ZeRO-3, a flat partition per group) ``RuntimeError``
    (docs/adapters.md, "FSDP1 and DeepSpeed ZeRO").

    Also in docs/adapters.md: FSDP2's DTensor parameters step as the single-process run and DCP saves their sharded
    state ("Sharded training"); a first ``step()`` without state, with every ``lr`` 0 and every gradient exactly
    zero (DCP's initialisation) creates the states and counts no step, so the first real step refreshes
    ("PyTorch"); ``torch.compile(opt.step)`` runs the eager step outside the graph, with its bits and a one-time
    ``UserWarning``, and ``fullgraph=True`` is refused ("torch.compile").
    """

    core_name: str = ""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float | None = None,
        weight_decay: float = 0.0,
        update_freq: int | None = 200,
        *,
        maximize: bool = False,
        split_refresh: bool = False,
        process_group: Any = None,
        foreach: bool | None = None,
        name: str | None = None,
        **family_options: Any,
    ) -> None:
        name = name or self.core_name
        self.split_refresh = bool(split_refresh)
        self.process_group = process_group
        if name not in ar.OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(ar.OPTIMIZERS)}")
        self.core_name = name
        self._start_caches([])  # add_param_group fills the registered shapes
        if unknown := sorted(set(family_options) - _config_fields_of(name)):
            ar.make_config(name, **{k: family_options[k] for k in unknown})  # raises "unknown option(s)"
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "update_freq": update_freq,
            "maximize": bool(maximize),
            "foreach": foreach,
            **family_options,
        }
        self._build_config(defaults)  # invalid hyperparameters raise here, before any state exists
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "core_name": self.core_name, "split_refresh": self.split_refresh}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # torch's load_state_dict ends here too, on a live optimizer: its own options stay as constructed
        self.split_refresh = bool(state.get("split_refresh", getattr(self, "split_refresh", False)))
        # a process group does not pickle: the unpickled optimizer agrees over the default
        self.process_group = getattr(self, "process_group", None)
        for group in self.param_groups:
            group.setdefault("foreach", None)
        self._start_caches([[tuple(p.shape) for p in group["params"]] for group in self.param_groups])

    def _start_caches(self, registered_shapes: list[list[tuple[int, ...]]]) -> None:
        """What the optimizer derives and keeps between steps, new (at construction and after unpickling)."""
        self._warned_eager_under_compile = False  # torch.compile(opt.step) runs the eager step: said once
        self._configs: dict[tuple[Any, ...], BaseConfig] = {}
        self._engines: dict[int, _GroupEngine] = {}  # per group: the engine of its plain parameters (_engines_for)
        self._registered_shapes = registered_shapes  # per group, as add_param_group saw them
        self._shapes_checked = False  # the first step() checks every parameter (:meth:`_refuse_hidden_shapes`)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``, then the group's hyperparameters are validated and its
        parameters checked for a shape the optimizer cannot see (:meth:`_refuse_hidden_shapes`)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._build_config(group)
            self._refuse_hidden_shapes(len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise
        self._registered_shapes.append([tuple(p.shape) for p in group["params"]])

    def _refuse_hidden_shapes(self, group_index: int) -> None:
        """:func:`_sharded.refuse_hidden_shapes` on ``param_groups[group_index]``, against its shapes when added."""
        group = self.param_groups[group_index]
        was = self._registered_shapes[group_index] if group_index < len(self._registered_shapes) else None
        names = group.get("param_names")
        _sharded.refuse_hidden_shapes(group["params"], lambda i: _label(names, i, group_index)[1], group_index, was)

    # ------------------------------------------------------------------ config

    def _build_config(self, group: Mapping[str, Any]) -> BaseConfig:
        """The frozen core config of a group, validated (torch's messages, then the core config's) and cached on its
        hyperparameter values, lr excluded."""
        validate_hyperparameters(group)
        # entries schedulers add (initial_lr, max_momentum, ...) are not config fields: ignored, as torch does
        options = {k: _hashable(_number(v)) for k, v in group.items() if k in _config_fields_of(self.core_name)}
        key = tuple(sorted(options.items()))
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = ar.make_config(self.core_name, **options)
            if len(self._configs) >= _CONFIG_CACHE_SIZE:
                self._configs.clear()
            self._configs[key] = cfg
        return cfg

    def config(self, group_index: int = 0) -> BaseConfig:
        """The core config used for ``param_groups[group_index]`` (its ``lr`` field is overridden at each step)."""
        return self._build_config(self.param_groups[group_index])

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step for every parameter with a gradient; returns ``closure()``'s loss.  Phase 1 validates
        everything (:class:`CoreOptimizer`, "Errors"), phase 2 computes the new bases due (new tensors), only phase 3
        writes: a failure in phase 1 or 2 leaves every parameter and state bit-identical."""
        if not self._shapes_checked:  # before the closure and before anything changes
            for group_index in range(len(self.param_groups)):
                self._refuse_hidden_shapes(group_index)
            self._shapes_checked = True
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():  # the eager step, outside the graph on purpose
            _eager_step_outside_graph(self, compiled=True)
        else:
            self._eager_step()
        return loss

    def _eager_step(self, compiled: bool = False) -> None:
        """The body of :meth:`step` after the closure (``compiled``: called by ``torch.compile(opt.step)``): a group
        whose kept engine still holds its parameters (the steady state) is one job (:meth:`_kept_engine`); every
        other parameter is checked one by one (:meth:`_work_of`), the plain ones get an engine (:meth:`_engines_for`).
        """
        if compiled and not self._warned_eager_under_compile:
            self._warned_eager_under_compile = True
            warn_at_caller(_EAGER_UNDER_COMPILE, UserWarning)
        agreed = self._agreed()  # under torch.distributed: the ranks agree before anything else is exchanged
        split = self._split()
        kept: list[_Job] = []
        work: list[_Work] = []
        for group_index, group in enumerate(self.param_groups):
            cfg = self._build_config(group)
            grads = list(map(_GRAD, group["params"]))
            params = [p for p, g in zip(group["params"], grads, strict=True) if g is not None]  # frozen: none
            grads = [g for g in grads if g is not None]
            held = self._kept_engine(group_index, params, grads, cfg, split)
            if held is None:
                work += self._work_of(group_index, checked=True)
                continue
            grads = list(torch._foreach_neg(grads)) if group["maximize"] else grads
            kept.append(_Job(held, grads, cfg, _number(group["lr"]), [], group_index))
        counts = _counts_of([item.flat["step"] for item in work])  # host counters: no device sync
        due = [ar.refresh_due(count, item.cfg) for item, count in zip(work, counts, strict=True)]
        if split and any(due):  # the bases decomposed once over the ranks: that step per parameter
            work = [item._replace(engine=False) for item in work]
        jobs = kept + self._engines_for(work, counts)
        if not agreed:  # agreed: every gradient was found finite, exactly, on every rank
            off_engine = [item for item in work if not item.engine]
            finite = _sharded.exactly_finite([item.grad for item in off_engine])
            self._raise_first_nonfinite([item for item, ok in zip(off_engine, finite, strict=True) if not ok])
            for job in jobs:  # every engine's verdict before any writes
                if not bool(job.held.engine.finite(job.grads)):
                    self._raise_first_nonfinite(job.items or self._work_of(job.group_index))
        if not self.state and _initialisation_only(work):  # torch.distributed.checkpoint's initialisation
            for item in work:
                self._commit(item, {})  # the states of ar.init, step 0: the first real step refreshes
            return
        self._whole_grads: dict[int, torch.Tensor] = {}  # DTensor gradients gathered by a refresh, for the update
        refreshes = iter(
            self._refresh([item for item, d in zip(work, due, strict=True) if d and not item.engine], split)
        )
        for job in jobs:
            for item in job.items:
                self._commit(item, {})  # a fresh state enters self.state
            job.held.step(job.grads, job.cfg, job.lr)
        for item, is_due in zip(work, due, strict=True):
            if item.engine:
                continue
            # a refresh that kept the previous basis is no refresh for the update (no refresh structure), as ar.step
            new_bases, refreshed = next(refreshes) if is_due else ({}, False)
            # the core's NamedTuple over the very tensors of the flat dict (no copy); update_in_place overwrites the
            # moments in place, so only the counter and new bases need writing back, into the same tensor objects
            state = to_core_state(item.flat, item.cfg)._replace(**new_bases)
            if _sharded.is_sharded(item.p):
                whole = self._whole_grads.get(id(item.p))
                _sharded.update(state, item.grad, item.cfg, item.p, lr=item.lr, refreshed=refreshed, whole_grad=whole)
            else:  # same numbers as ``p += ar.update(...)[0]`` (bit for bit)
                ar.update_in_place(state, item.grad, item.cfg, item.p, lr=item.lr, refreshed=refreshed)
            self._commit(item, new_bases)
            item.flat["step"] += 1
        self._whole_grads = {}

    def _kept_engine(
        self, group_index: int, params: list[torch.Tensor], grads: list[torch.Tensor], cfg: BaseConfig, split: bool
    ) -> _GroupEngine | None:
        """The group's kept engine when it takes this step of ``params`` (with gradients ``grads``) whole, else
        ``None``: it :meth:`~_GroupEngine.holds` them, every gradient is dense with its parameter's dtype and shape
        (any other is :meth:`_work_of`'s to refuse) and no refresh due is split.  Read by ``map``, a loop in C."""
        held = self._engines.get(group_index)
        if held is None or not params:
            return None
        if (set(map(_LAYOUT, grads)) != {torch.strided} or list(map(_DTYPE, grads)) != held.dtypes
                or list(map(_SHAPE, grads)) != held.shapes):  # fmt: skip
            return None  # the parameters' own dtypes and shapes are held's: held.holds
        if not held.holds(params, list(map(self.state.get, params)), cfg, held.counters.numpy().tolist()):
            return None
        if split and any(ar.refresh_due(count, cfg) for count in set(held.counts)):
            return None
        return held

    def _work_of(self, group_index: int, *, checked: bool = False) -> list[_Work]:
        """The parameters of ``param_groups[group_index]`` with a gradient, each with its state dict (``ar.init``'s
        where it has none); ``checked``, as a step takes them: each gradient validated (:func:`_refusal`; negated
        under ``maximize``) and each shape checked against ``batch_dims`` (``ValueError`` naming it, no state made)."""
        group = self.param_groups[group_index]
        cfg = self._build_config(group)
        lr = _number(group["lr"])
        names = group.get("param_names")
        work = []
        for index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            label, where = _label(names, index, group_index)
            grad = p.grad
            if checked:
                if refused := _refusal(p, grad, where):
                    raise refused
                split_batch(tuple(p.shape), cfg.batch_dims, name=label)
                grad = -grad if group["maximize"] else grad
            flat: dict[str, torch.Tensor] = self.state.get(p) or {}
            fresh = not flat
            if fresh:
                flat = from_core_state(_sharded.init(p, cfg))
                flat["step"] = flat["step"].cpu()  # as torch.optim: the counter lives on the host
            work.append(_Work(p, grad, flat, fresh, cfg, lr, where, label, group_index, _plain_parameter(p)))
        return work

    def _agreed(self) -> bool:
        """With more than one rank in :attr:`process_group`: make the ranks agree on the step (:func:`_sharded.agree`)
        and return ``True``, or raise; ``False`` (nothing exchanged) otherwise.  A step's later collectives follow
        from these facts alone, so ranks that agree enter them in the same order, and ranks that do not learn it
        here together instead of hanging in different collectives or silently diverging."""
        if not _sharded.several_ranks(self.process_group):
            return False
        grads, refused, counts, wheres = [], [], [], []
        for group_index, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for index, p in enumerate(group["params"]):
                flat, grad = self.state.get(p), p.grad
                grads.append(grad)
                refused.append(grad is not None and _refusal(p, grad, "") is not None)
                counts.append(int(flat["step"]) if flat and grad is not None else 0)
                wheres.append(_label(names, index, group_index)[1])
        _sharded.agree(grads, refused, counts, wheres, group=self.process_group)
        return True

    def _split(self) -> bool:
        """Whether a refresh is split over the ranks (``split_refresh`` under more than one rank)."""
        return self.split_refresh and _sharded.several_ranks(self.process_group)

    def _engines_for(self, work: list[_Work], counts: list[int], *, keep: bool = True) -> list[_Job]:
        """Per param group, the job of its plain parameters in ``work`` (host counters ``counts``): the group's kept
        engine when it still holds them, else one built over their states (which then hold views of its arrays,
        values unchanged) and kept, or, unless ``keep``, over copies of the state dicts, which stay as they were."""
        by_group: dict[int, list[tuple[_Work, int]]] = {}
        for item, count in zip(work, counts, strict=True):
            if item.engine:
                by_group.setdefault(item.group_index, []).append((item, count))
        jobs = []
        for group_index, members in by_group.items():
            items, group_counts = [item for item, _ in members], [count for _, count in members]
            held = self._engines.get(group_index)
            if held is None or not held.holds(
                [i.p for i in items], [i.flat for i in items], items[0].cfg, group_counts
            ):
                if keep:
                    held = self._engines[group_index] = _GroupEngine(items, group_counts)
                else:
                    held = _GroupEngine([item._replace(flat=dict(item.flat)) for item in items], group_counts)
            jobs.append(_Job(held, [item.grad for item in items], items[0].cfg, items[0].lr, items, group_index))
        return jobs

    def routes(self) -> dict[str, dict[str, str]]:
        """Which code runs each part of a step, per parameter (by ``named_parameters()`` names when the groups carry
        them, else ``"param_groups[i].params[j]"``), for the gradients present now: ``"refresh"`` (the basis
        refresh), ``"rotate"`` (``G~ = P^T G Q`` and ``P U~ Q^T``), ``"moments"`` (moments, direction and tail)
        and, for a plain parameter, ``"engine"`` (its group in the param group's :class:`adadiag_ref.Engine`, whose
        :meth:`~adadiag_ref.Engine.routes` these are).  Other parameters read ``"per parameter: update_in_place
        ..."`` or ``"sharded ..."``, and one without a gradient ``"none (no gradient: skipped)"``.
        """
        work = [item for group_index in range(len(self.param_groups)) for item in self._work_of(group_index)]
        jobs = self._engines_for(work, _counts_of([item.flat["step"] for item in work]), keep=False)
        by_engine = {id(p): route for job in jobs
                     for p, route in zip(job.held.params, job.held.engine.routes().values(), strict=True)}  # fmt: skip
        split = " (split over the ranks: that step per parameter)" if self._split() else ""
        out: dict[str, dict[str, str]] = {}
        for group_index, group in enumerate(self.param_groups):
            for index, p in enumerate(group["params"]):
                label = _label(group.get("param_names"), index, group_index)[0]
                if id(p) in by_engine:
                    route = by_engine[id(p)]
                    refresh = route.refresh + (split if not route.refresh.startswith("none") else "")
                    out[label] = {"refresh": refresh, "rotate": route.rotate, "moments": route.entrywise,
                                  "engine": route.group}  # fmt: skip
                else:
                    out[label] = self._route_off_engine(p, group)
        return out

    def _route_off_engine(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, str]:
        """:meth:`routes`' entry of a parameter that no engine steps."""
        if p.grad is None:
            return {"refresh": "none", "rotate": "none", "moments": "none (no gradient: skipped)"}
        cfg = self._build_config(group)
        rotated = layout_for(tuple(p.shape), cfg).rotate_left  # a stack's too (its matrices'), as the step reads it
        if _sharded.is_sharded(p):
            refresh, moments = _sharded.route(p, cfg)
        else:
            moments = "per parameter: update_in_place (the reference's arithmetic, in the state's tensors)"
            refresh = "batched stack (ar.refresh_bases per config and shape)"
            if self._split():
                refresh = "split over ranks (owner per matrix, bases broadcast)"
        return {"refresh": refresh if rotated else "none (no basis)",
                "rotate": "GEMM (torch.matmul per parameter)" if rotated else "none", "moments": moments}  # fmt: skip

    def _commit(self, item: _Work, new_bases: Mapping[str, torch.Tensor]) -> None:
        """A fresh state enters ``self.state``; new bases are copied into the state's own tensors."""
        if item.fresh:
            self.state[item.p] = item.flat
        for key, basis in new_bases.items():
            item.flat[key].copy_(basis)  # state_dict() references stay current, as in torch.optim

    @staticmethod
    def _raise_first_nonfinite(suspects: list[_Work]) -> None:
        """``ValueError`` naming the first of ``suspects`` whose gradient holds NaN or Inf (tested exactly);
        nothing when none does (finite entries whose sum overflowed)."""
        bad = next((item for item in suspects if not _sharded.all_finite(item.grad)), None)
        if bad is None:
            return
        raise ValueError(
            f"gradient of {bad.where} contains NaN or Inf at step {int(bad.flat['step']) + 1}; "
            "no parameter and no optimizer state was changed"
        )

    def _refresh(self, items: list[_Work], split: bool) -> list[tuple[dict[str, torch.Tensor], bool]]:
        """``({"P"[, "Q"]}, refreshed)`` per parameter due (``refresh_basis``), split over the ranks when ``split``.
        ``refreshed`` is :func:`adadiag_ref.step`'s: False when a failed decomposition kept the previous basis (the
        very same tensors), so the step's update applies no refresh-step structure."""
        states = [to_core_state(item.flat, item.cfg) for item in items]
        sharded = [_sharded.is_sharded(item.p) for item in items]
        if any(sharded):  # FSDP2: gathered gradients, an owner per matrix (adapters/_sharded.py)
            plain = iter(self._refresh([item for item, s in zip(items, sharded, strict=True) if not s], split))
            mine = [j for j, s in enumerate(sharded) if s]
            owned = iter(_sharded.refresh([items[j] for j in mine], [states[j] for j in mine], self._whole_grads))
            return [next(owned) if s else next(plain) for s in sharded]
        if not split:
            # batched per config (ar.refresh_bases): one stacked decomposition per work shape on a device
            by_config: dict[BaseConfig, list[int]] = {}
            for j, item in enumerate(items):
                by_config.setdefault(item.cfg, []).append(j)
            news: dict[int, Any] = {}  # the refreshed states, by index in items
            for cfg, members in by_config.items():
                fresh = ar.refresh_bases([states[j] for j in members], [items[j].grad for j in members], cfg,
                                         names=[items[j].name for j in members])  # fmt: skip
                news.update(zip(members, fresh, strict=True))
            return [(_sharded.bases(news[j]), news[j].P is not old.P) for j, old in enumerate(states)]
        return _sharded.owned_refresh(
            states,
            [item.grad for item in items],
            [item.cfg for item in items],
            [item.name for item in items],
            group=self.process_group,
            device=items[0].p.device if items else "cpu",
        )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict`` (live references, as torch), plus each group's ``param_shapes``, by
        which :meth:`load_state_dict` refuses the state of a (7, 9) parameter for a (9, 7) one (the same work frame).
        """
        saved = super().state_dict()
        for packed, group in zip(saved["param_groups"], self.param_groups, strict=True):
            packed["param_shapes"] = [list(p.shape) for p in group["params"]]
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` output, everything checked before anything changes: ``"step"`` (a tensor of any
        dtype or a Python number, as older checkpoints hold it) becomes a host int32 0-d tensor; floating state is
        cast to the parameter's state dtype (``ar.init``'s: float32 for bfloat16 parameters, which torch's loader
        would round to bfloat16) on its device; every field must have the parameter's state shape, and the saved
        ``param_shapes`` (when present) must match the parameters.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        saved_state = state_dict["state"]
        loaded: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for saved_group, group in zip(groups, self.param_groups, strict=True):
            if len(saved_group["params"]) != len(group["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
                )
            merged = {**group, **{k: v for k, v in saved_group.items() if k not in ("params", "param_shapes")}}
            cfg = self._build_config(merged)
            shapes = saved_group.get("param_shapes", [list(p.shape) for p in group["params"]])
            for index, (param_id, p, shape) in enumerate(zip(saved_group["params"], group["params"], shapes)):
                if list(shape) != list(p.shape):
                    raise ValueError(
                        f"the saved state of parameter {index} belongs to a parameter of shape {tuple(shape)}, "
                        f"this parameter has shape {tuple(p.shape)}"
                    )
                if param_id in saved_state:
                    loaded[p] = _checked_state(saved_state[param_id], p, cfg, index)
        unshaped = [{k: v for k, v in g.items() if k != "param_shapes"} for g in groups]
        super().load_state_dict({**state_dict, "state": {}, "param_groups": unshaped})
        self.state.update(loaded)  # torch's loader called __setstate__: no engine holds the old states


_EAGER_UNDER_COMPILE = (
    "torch.compile(opt.step) runs the eager step, outside the graph: a step reads host values (the finiteness "
    "verdict, the counters) and decomposes on the host, and its groups' engines run their own group kernels, so a "
    "compiled step has the eager step's bits and speed. Dynamo's call around it costs about 20 us a step "
    "(measurable on a tiny model only): call opt.step() uncompiled (docs/adapters.md, 'torch.compile')"
)


_eager_step_outside_graph = torch.compiler.disable(
    CoreOptimizer._eager_step,
    reason=(
        "adadiag_ref runs a step's host phase (gradient validation with one host read, step counters, basis refresh "
        "on the host) and its engines' group kernels outside the graph on purpose, so "
        "torch.compile(opt.step, fullgraph=True) is refused; see docs/adapters.md, 'torch.compile'"
    ),
)
""":meth:`CoreOptimizer._eager_step` as ``torch.compile`` calls it: run eagerly, outside the graph, on purpose."""


class _Work(NamedTuple):
    """One parameter's share of a ``step()``."""

    p: torch.Tensor
    grad: torch.Tensor
    flat: dict[str, torch.Tensor]  # the live state dict (a new one when ``fresh``)
    fresh: bool
    cfg: BaseConfig
    lr: Any
    where: str  # "parameter 'fc.weight'" or "parameter 2 of param_groups[0]", for error messages
    name: str  # "fc.weight" or "param_groups[0].params[2]": the core's ``name=`` in its warnings and errors
    group_index: int
    engine: bool  # stepped by its group's engine (:class:`_GroupEngine`): plain (not FSDP2's), not in a split refresh


class _Job(NamedTuple):
    """One engine's share of a ``step()``: a param group's plain parameters with a gradient."""

    held: _GroupEngine
    grads: list[torch.Tensor]  # negated under ``maximize``
    cfg: BaseConfig
    lr: Any
    # the parameters' records; none for a kept engine's steady step (:meth:`CoreOptimizer._kept_engine`)
    items: list[_Work]
    group_index: int


class _GroupEngine:
    """A param group's :class:`adadiag_ref.Engine` over its plain parameters with a gradient, built over live states
    (:meth:`adadiag_ref.Engine.from_states`): ``optimizer.state[p]``'s moments and bases are views of its arrays,
    written in place by every step, so ``state_dict()`` and users' references stay current; kept while it holds them."""

    def __init__(self, items: list[_Work], counts: list[int]) -> None:
        cfg = items[0].cfg
        states = [to_core_state(item.flat, cfg) for item in items]
        self.params = [item.p for item in items]
        self.engine = ar.Engine.from_states(states, self.params, cfg, names=[item.name for item in items],
                                            count=counts, live=True)  # fmt: skip
        self.dtypes = [p.dtype for p in self.params]
        self.shapes = [p.shape for p in self.params]
        self.flats = [item.flat for item in items]
        # the host counters as views of one int32 buffer: advanced by one addition, read by one host view
        self.counters = torch.tensor(counts, dtype=torch.int32)
        # (state dict, key, tensor) of every tensor handed out, as three lists for holds' loops in C
        held: list[tuple[dict[str, torch.Tensor], str, torch.Tensor]] = []
        for i, flat in enumerate(self.flats):
            tensors = from_core_state(self.engine.state(i)) | {"step": self.counters[i]}
            tensors.pop("param_shape", None)  # the state dict's own record stays (absent in older states)
            flat.update(tensors)
            held += [(flat, f, t) for f, t in tensors.items()]
        self.held_flats, self.held_keys, self.held_tensors = (list(column) for column in zip(*held, strict=True))
        self.counts = list(counts)
        self.cfg = cfg  # the last config found to differ from the engine's in betas and weight_decay only

    def holds(self, params: list[torch.Tensor], flats: list[Any], cfg: BaseConfig, counts: list[int]) -> bool:
        """Whether this engine can step ``params``, whose state dicts are ``flats`` and host counters ``counts``,
        under ``cfg``: the very parameters (same dtypes and shapes) and state dicts it was built over, each still
        holding the tensors it handed them, the counters it keeps, and a config it takes (:meth:`_takes`)."""
        if len(params) != len(self.params) or counts != self.counts or not self._takes(cfg):
            return False
        if not all(map(operator.is_, params, self.params)) or not all(map(operator.is_, flats, self.flats)):
            return False
        if list(map(_DTYPE, params)) != self.dtypes or list(map(_SHAPE, params)) != self.shapes:
            return False
        return all(map(operator.is_, map(dict.get, self.held_flats, self.held_keys), self.held_tensors))

    def _takes(self, cfg: BaseConfig) -> bool:
        """``cfg`` is the engine's, or differs from it only in what a step may change (betas, weight decay)."""
        if cfg is self.engine.cfg or cfg is self.cfg:
            return True
        if self.engine.cfg.replace(betas=cfg.betas, weight_decay=cfg.weight_decay) != cfg:
            return False
        self.cfg = cfg
        return True

    def step(self, grads: list[torch.Tensor], cfg: BaseConfig, lr: Any) -> None:
        """The engine's step (no check: the optimizer validated every gradient), the host counters advanced."""
        own = cfg is self.engine.cfg  # else a step's own betas and weight decay (a scheduler's)
        self.engine.step(grads, self.params, lr=lr, check=False, betas=None if own else cfg.betas,
                         weight_decay=None if own else cfg.weight_decay)  # fmt: skip
        self.counters += 1
        self.counts = [c + 1 for c in self.counts]


def _plain_parameter(p: torch.Tensor) -> bool:
    """A plain tensor or parameter on any device (no DTensor or other subclass): its group's engine steps it."""
    return type(p) in (torch.Tensor, torch.nn.Parameter)


def _initialisation_only(work: list[_Work]) -> bool:
    """Whether a first ``step()`` (no state yet) only initialises the states, as DCP's ``_init_optim_state`` does:
    every ``lr`` 0 and every gradient exactly zero (read only when every ``lr`` is 0).  Such a step changes no
    parameter; counting it would put the first refresh at ``t = 1 + T``."""
    return bool(work) and all(item.lr == 0 for item in work) and not any(bool(torch.any(item.grad)) for item in work)


def _label(names: Any, index: int, group_index: int) -> tuple[str, str]:
    """A parameter's two names: as :meth:`CoreOptimizer.routes` and the core's messages name it (``fc.weight``
    with ``named_parameters()``, else ``param_groups[i].params[j]``), and as this module's errors do
    (``parameter 'fc.weight'``, else ``parameter j of param_groups[i]``)."""
    if names:
        return str(names[index]), f"parameter {names[index]!r}"
    return f"param_groups[{group_index}].params[{index}]", f"parameter {index} of param_groups[{group_index}]"


def _counts_of(counters: list[torch.Tensor]) -> list[int]:
    """The values of host counters (0-d tensors), read together: one stack, one host view."""
    if any(c.device.type != "cpu" or type(c) is not torch.Tensor for c in counters):
        return [int(c) for c in counters]
    return torch.stack(counters).numpy().tolist() if counters else []  # one stack, one host view


def _refusal(p: torch.Tensor, grad: torch.Tensor, where: str) -> Exception | None:
    """The error a step raises for ``grad`` of ``p`` (``where`` names it), before anything changes, or ``None``:
    ``RuntimeError`` for a sparse, non-strided or complex gradient or a complex parameter, ``ValueError`` for a
    gradient of another shape or dtype than its parameter's."""
    if grad.is_sparse or grad.layout != torch.strided:
        return RuntimeError(
            f"sparse gradients ({grad.layout}) are not supported: the AdaDiag optimizers rotate the dense "
            "gradient matrix; use dense gradients (e.g. nn.Embedding(sparse=False))"
        )
    if torch.is_complex(grad) or torch.is_complex(p):
        return RuntimeError(
            f"complex parameters/gradients ({p.dtype}) are not supported: AdaDiag is defined for real "
            "parameters; optimise torch.view_as_real(param) instead"
        )
    for what, got, want in (("shape", tuple(grad.shape), tuple(p.shape)), ("dtype", grad.dtype, p.dtype)):
        if got != want:
            return ValueError(
                f"gradient of {where} has {what} {got}, the parameter {want}; no parameter and no state was changed"
            )
    return None


def _checked_state(saved: Mapping[str, Any], p: torch.Tensor, cfg: BaseConfig, index: int) -> dict[str, torch.Tensor]:
    """A saved per-parameter state converted to this parameter (dtype, device), or ``ValueError``."""
    expected = from_core_state(_sharded.init(p, cfg))
    if set(saved) != set(expected):
        raise ValueError(
            f"state keys {sorted(saved)} of parameter {index} do not belong to optimizer {cfg.name!r} for a "
            f"parameter of shape {tuple(p.shape)} (expected {sorted(expected)}): was the state dict saved by "
            "another optimizer or config?"
        )
    out = {}
    for key, want in expected.items():
        value = saved[key]
        if key == "step":
            number = value.item() if isinstance(value, torch.Tensor) else value
            if not isinstance(number, int | float) or not math.isfinite(number) or number < 0 or number % 1:
                raise ValueError(f"'step' of parameter {index} must be a whole number >= 0, got {number!r}")
            out[key] = torch.tensor(int(number), dtype=torch.int32)
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"state field {key!r} of parameter {index} has shape {got}, expected {tuple(want.shape)} for a "
                f"parameter of shape {tuple(p.shape)} under {cfg.name!r}"
            )
        out[key] = _sharded.conform(value, want)  # a copy with want's dtype, device (and DTensor placement)
    return out


_CLASSES: dict[str, type[CoreOptimizer]] = {}


def optimizer_class(name: str) -> type[CoreOptimizer]:
    """The ``torch.optim.Optimizer`` class of registered optimizer ``name`` (:data:`adadiag_ref.config.OPTIMIZERS`),
    made once: a :class:`CoreOptimizer` with ``core_name = name``, called by the entry's ``class_name`` (``AdaDiagPP``
    for ``adadiag_pp``).  The library's eight are also this module's attributes (``pytorch.AdaDiag``); one registered
    later (``register_family``) is reached here.  ``ValueError`` for a name that is not registered."""
    if name not in _CLASSES:
        if name not in ar.OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(ar.OPTIMIZERS)}")
        entry = ar.OPTIMIZERS[name]
        doc = f"{entry.summary}\n\nThe core's ``{name!r}``; keywords as :class:`CoreOptimizer`.".lstrip()
        attributes = {"core_name": name, "__doc__": doc, "__module__": __name__, "__qualname__": entry.class_name}
        _CLASSES[name] = type(entry.class_name, (CoreOptimizer,), attributes)
    return _CLASSES[name]


OPTIMIZER_CLASSES: dict[str, type[CoreOptimizer]] = {name: optimizer_class(name) for name in ar.OPTIMIZERS}
"""Core name -> torch class, for the optimizers registered when this module was imported."""
globals().update({cls.__name__: cls for cls in OPTIMIZER_CLASSES.values()})  # pytorch.AdamW, pytorch.AdaDiag, ...
