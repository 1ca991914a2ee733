"""PyTorch adapter: ``torch.optim.Optimizer`` classes over the array-API core.

For every parameter with a gradient, one call of :meth:`CoreOptimizer.step` does exactly what the core's eager
driver :func:`adadiag_ref.step` does, on the parameter's own tensors and device, bit for bit::

    check_inputs(S, G, cfg, W)                    # all parameters first: an error leaves every state untouched
    if refresh_due(t - 1):  S <- refresh_basis(S, G, cfg, name=NAME)   # P, Q <- canonical_svd(G)
    S <- update_in_place(S, G, cfg, W, lr=group["lr"], refreshed=...)
                                                  # W += delta, delta = -eta_t (P U~ Q^T + lambda W_t);
                                                  # bit-identical to update(), moments overwritten in place

The core resolves the torch namespace itself (``array_api_compat``); nothing is copied to NumPy.  Who computes a
parameter's step (:meth:`CoreOptimizer.routes` says it per parameter):

* a plain tensor on any device is stepped by its param group's :class:`adadiag_ref.Engine` (one per group, kept
  between steps, refresh steps included, holding the moments and bases: :class:`_GroupEngine`): in host memory its
  group kernels over the tensors' own memory (numba) and one ``torch.mm`` per rotated matrix, ``ar.step``'s bits;
  on CUDA with CuPy its CUDA group kernels, else its gathering path in torch ops;
* FSDP2's sharded parameters take their own route (:mod:`._sharded`); any other parameter ``update_in_place`` (the
  reference's arithmetic in torch ops).

State layout (``optimizer.state[p]``, and ``state_dict()["state"][i]``): a flat
dict of tensors, the core's NamedTuple state flattened field by field, with the
counter ``count`` under the key ``"step"`` (an int32 0-d tensor)::

    AdamW / AdaDiag / AdaDiagPP            step, [P], [Q], M, V, param_shape
    Adafactor / AdafacDiag / AdafacDiagPP  step, [P], [Q], [M], r, s, param_shape
    Hfac / HfacDiag                        step, [P], [Q], u, v, r, s, param_shape

A field the core leaves as ``None`` (no basis on that side, no momentum) is
absent; ``param_shape`` is the zero-size record of the parameter's shape
(``(0, *p.shape)``, :data:`adadiag_ref.optim.families.State`), absent in states saved before it existed.
All arrays are in the parameter's work frame (``ar.layout_for``) and
in the state dtype: float64 for float64 parameters, float32 for float32,
float16 and bfloat16 ones.
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
    flat = {"step": state.count}
    for name in state._fields[1:]:
        value = getattr(state, name)
        if value is not None:
            flat[name] = value
    return flat


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
    """torch.optim's checks and messages (``Invalid learning rate: nan``, ...), stricter only in refusing nan/inf.

    Raises ``ValueError`` for ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``foreach`` (``None`` or a
    bool); the remaining core fields are checked by the core config.
    """
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
    """Any of the core's eight optimizers as a ``torch.optim.Optimizer``.

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
        split_refresh: under ``torch.distributed`` with identical gradients on every
            rank (DDP), rank ``r`` decomposes only the ``j``-th matrices due for a
            refresh with ``j mod world_size == r`` and broadcasts their bases; the
            result is bit-identical to every rank decomposing every matrix.  Ignored
            when no process group is initialised.  FSDP2 (DTensor) parameters are always
            refreshed this way, over their mesh's ranks.
        process_group: the ranks that step the same parameters (``None``: the default group), as DDP's and
            ``ZeroRedundancyOptimizer``'s ``process_group``.  Under ``torch.distributed`` with more than one rank in
            it, every ``step()`` first makes the ranks agree, in one all-reduce of 8 bytes per parameter, on which
            parameters have a gradient, that every gradient is finite (an FSDP2 rank: its shard) and valid, and on
            the step counters; a disagreement raises the same ``ValueError`` on every rank, naming the parameter
            and the ranks, with nothing changed, before any other collective (so catching it keeps the ranks
            identical; docs/adapters.md, "Ranks that disagree").  Ranks that step different models (pipeline
            stages) pass the group of their data-parallel replicas.
        foreach: accepted as torch.optim accepts it (``None``, ``True`` or ``False``; anything else raises
            ``ValueError``) and changes nothing: every group's engine already steps the group as a whole (in host
            memory, and on CUDA with CuPy, one kernel call for the moments, direction and tail of the group;
            otherwise the reference's arithmetic once over its flat arrays), so there is no per-parameter route to
            opt out of.  ``load_state_dict`` loads it from the checkpoint's groups, as torch.optim does.
        name: the core optimizer name; the subclasses fix it.
        **family_options: other core config fields (``max_basis_dim``,
            ``bias_correction``, ``state_dtype``, ``clip_threshold``, ``beta2_schedule``,
            ``decay_rate``, ``relative_step``, ``scale_parameter``, ``eps2``, ``momentum``, ``batch_dims``).
            ``batch_dims=k`` in a param group (e.g. stacked expert weights ``(E, d, f)`` with ``k = 1``) makes
            every parameter of that group ``prod(shape[:k])`` independent matrices, each with its own bases
            (``docs/embedding.md``); a parameter of the group with fewer than ``k`` dimensions raises
            ``ValueError`` naming it at the first ``step()``, before any state exists.

    Errors: invalid hyperparameters raise ``ValueError`` with torch.optim's
    messages (``Invalid learning rate: nan``), at construction, in
    ``add_param_group`` and, for values edited in ``param_groups``, at the next
    ``step()``; sparse or complex gradients and parameters raise
    ``RuntimeError``; a non-finite gradient (named by parameter and step) or a
    mismatched shape or dtype raises ``ValueError``.  Everything is validated
    before anything is updated, so on an error no parameter and no state has
    changed.  In host memory the groups' engines count each gradient's NaN and Inf (their kernels, by address;
    else one sum per gradient), every engine before any writes.  Off the host a ``step()`` without a basis refresh
    synchronises with the device once (the finiteness of one sum per gradient, all tested together; only a
    non-finite sum leads to the exact per-entry test); a refresh step also copies the gradients it decomposes to
    the host.

    FSDP2 (``torch.distributed.fsdp.fully_shard``: DTensor parameters, rows split over the ranks) is handled by
    :mod:`adadiag_ref.adapters._sharded`, the core's math unchanged (the local shard where its rows are a block the
    family can step alone, else the gathered matrix; expert stacks by the rank that holds each matrix; each
    refresh decomposes every matrix once across the ranks).  The shards equal the single-process run, and DCP
    saves and restores the sharded state (docs/adapters.md, "Exactness" and "Sharded training").

    Initialisation step: a ``step()`` on an optimizer without any state, with every group's ``lr`` equal to 0 and
    every gradient exactly zero, creates the states (``ar.init``, step 0) and counts no step, so the first real
    step refreshes the basis.  This is the step DCP's ``get_/set_optimizer_state_dict`` take to initialise a fresh
    optimizer (zero gradients, ``lr = 0``); ``torch.optim.AdamW`` counts it (``step = 1``, so its next step's bias
    correction is that of ``t = 2``).

    ``torch.compile(opt.step)``: the whole step runs eagerly, outside the graph, on purpose
    (``torch.compiler.disable``): a step reads host values, decomposes on the host and makes new states, none of
    which a graph can hold, and its engines run their own group kernels; so a compiled step has the eager step's
    bits, with a one-time ``UserWarning``.
    ``fullgraph=True`` is refused (docs/adapters.md, "torch.compile").

    Parameters whose matrix the optimizer cannot see are refused with ``RuntimeError`` (at construction, in
    ``add_param_group`` and at the first ``step()``, before anything changes): FSDP1's flattened parameters,
    DeepSpeed ZeRO-3's partitioned ones and groups whose parameters a wrapper replaced by a flat partition
    (:func:`_refuse_hidden_shapes`).
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
        self._warned_eager_under_compile = False  # torch.compile(opt.step) runs the eager step: said once
        if name not in ar.OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(ar.OPTIMIZERS)}")
        self.core_name = name
        self._configs: dict[tuple[Any, ...], BaseConfig] = {}
        self._engines: dict[int, _GroupEngine] = {}  # per group: the engine of its plain parameters (_engines_for)
        self._registered_shapes: list[list[tuple[int, ...]]] = []  # per group, as add_param_group saw them
        self._shapes_checked = False  # the first step() checks every parameter (:func:`_refuse_hidden_shapes`)
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
        self._warned_eager_under_compile = False
        self._configs = {}
        self._engines = {}
        for group in self.param_groups:
            group.setdefault("foreach", None)
        self._registered_shapes = [[tuple(p.shape) for p in group["params"]] for group in self.param_groups]
        self._shapes_checked = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``, then the group's hyperparameters are validated and its
        parameters checked for a shape the optimizer cannot see (:func:`_refuse_hidden_shapes`)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._build_config(group)
            _refuse_hidden_shapes([group], first_group_index=len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise
        self._registered_shapes.append([tuple(p.shape) for p in group["params"]])

    # ------------------------------------------------------------------ config

    def _build_config(self, group: Mapping[str, Any]) -> BaseConfig:
        """The frozen core config of a group (cached on its hyperparameter values, lr excluded).

        Validates the group first (torch's messages, then the core config's).
        """
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
        """One optimizer step for every parameter with a gradient; returns ``closure()``'s loss.

        Phase 1 validates everything (:class:`CoreOptimizer`, "Errors"); phase 2 computes the new bases of the
        parameters due for a refresh (new tensors); only phase 3 writes, so a failure in phase 1 or 2 leaves every
        parameter and state bit-identical.
        """
        if not self._shapes_checked:  # before the closure and before anything changes
            _refuse_hidden_shapes(self.param_groups, self._registered_shapes)
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
        """The body of :meth:`step` after the closure (``compiled``: called by ``torch.compile(opt.step)``).

        A param group whose kept engine still holds its parameters with a gradient (the steady state of training,
        frozen parameters aside) is one job, without per-parameter bookkeeping (:meth:`_kept_engine`); every other
        parameter is checked one by one and gets a state where it has none (:meth:`_work_of`), the plain ones an
        engine (:meth:`_engines_for`).
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
        """The group's kept engine when it takes this step of ``params`` (the group's parameters with a gradient,
        ``grads``) whole, else ``None``, having changed nothing: it :meth:`~_GroupEngine.holds` them, every gradient
        is dense with its parameter's dtype and shape (any other is :meth:`_work_of`'s to refuse) and no refresh
        due is split.  Each property is read by ``map``, a loop in C, as every step asks it of every parameter."""
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
        """The parameters of ``param_groups[group_index]`` with a gradient, each with its state dict (a new one, of
        ``ar.init``, where it has none).  ``checked``: as a step takes them, each gradient validated
        (:func:`_refusal`; negated under ``maximize``) and each shape against the group's ``batch_dims``
        (``ValueError`` naming it, before any state exists)."""
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
        """Under ``torch.distributed`` with more than one rank in :attr:`process_group`: make the ranks agree on
        the step (:func:`_sharded.agree`, as :class:`CoreOptimizer` says under ``process_group``) and return
        ``True``, or raise; ``False`` (nothing exchanged) otherwise.

        A step's collectives (the bases' broadcasts of ``split_refresh``, FSDP2's gathers) follow from these
        facts alone, so ranks that agree on them enter the same collectives in the same order; ranks that do not
        learn it here together, instead of waiting in different collectives (a hang) or stepping different
        parameters (ranks that silently diverge under DDP)."""
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
        """Per param group, the job of its plain parameters (``item.engine``; ``counts``: the host counters of
        ``work``): the group's kept engine when it still holds them, else one built over their states (the state
        dicts then hold views of its arrays, their values unchanged) and kept, or, unless ``keep``, built over
        copies of the state dicts, which stay as they were."""
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
        """Which code runs each part of a step, per parameter (``named_parameters()`` names when the groups were
        given them, else ``"param_groups[i].params[j]"``), for the gradients present now: a mapping with

        * ``"refresh"``: the basis refresh;
        * ``"rotate"``: ``G~ = P^T G Q`` and ``P U~ Q^T``;
        * ``"moments"``: moments, direction and tail of a step;
        * ``"engine"`` (a plain parameter): its group in the param group's :class:`adadiag_ref.Engine`.

        A plain parameter's entries are its param group's engine's :meth:`adadiag_ref.Engine.routes`; the others say
        ``"per parameter: update_in_place ..."`` or ``"sharded ..."``.  A parameter without a gradient is skipped.
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
        layout = layout_for(tuple(p.shape), cfg) if not cfg.batch_dims else None
        rotated = layout is None or layout.rotate_left or layout.rotate_right
        sharded = _sharded.is_sharded(p)
        if sharded:
            moments = "sharded: the family's route on the local shard or the gathered matrix (_sharded)"
        else:
            moments = "per parameter: update_in_place (the reference's arithmetic, in the state's tensors)"
        if not rotated:
            refresh = "none (no basis)"
        elif sharded:
            refresh = "sharded owner (one rank decomposes each matrix, bases broadcast)"
        elif self._split():
            refresh = "split over ranks (owner per matrix, bases broadcast)"
        else:
            refresh = "batched stack (ar.refresh_bases per config and shape)"
        return {"refresh": refresh, "rotate": "GEMM (torch.matmul per parameter)" if rotated else "none",
                "moments": moments}  # fmt: skip

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
        """``({"P"[, "Q"]}, refreshed)`` per parameter due (``refresh_basis``), split over the ranks when ``split``
        (:meth:`_split`, decided once per step).

        ``refreshed`` is the core's (:func:`adadiag_ref.step`): False when the refresh kept the previous basis
        (a failed decomposition), which ``refresh_basis`` returns as the very same tensors.  The bases are then
        the previous ones and the step's update applies no refresh-step structure.
        """
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
            return [(_bases(news[j]), news[j].P is not old.P) for j, old in enumerate(states)]
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
        """``torch.optim.Optimizer.state_dict`` (live references, as torch), plus each group's ``param_shapes``.

        The shapes let :meth:`load_state_dict` refuse the state of a (7, 9)
        parameter for a (9, 7) one, whose work-frame state has the same shapes.
        """
        saved = super().state_dict()
        for packed, group in zip(saved["param_groups"], self.param_groups, strict=True):
            packed["param_shapes"] = [list(p.shape) for p in group["params"]]
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` output; everything is checked before anything changes.

        * ``"step"`` may be a tensor of any dtype or a Python number (older
          checkpoints); it becomes an int32 0-d tensor on the host.
        * Floating state is cast to this parameter's state dtype (the dtype
          ``ar.init`` gives it: float32 for bfloat16 parameters, where torch's
          loader would round to bfloat16) and moved to the parameter's device.
        * Every field must have the shape this parameter's state has, and the
          saved ``param_shapes`` (when present) must match the parameters.
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
        super().load_state_dict(
            {
                **state_dict,
                "state": {},
                "param_groups": [{k: v for k, v in g.items() if k != "param_shapes"} for g in groups],
            }
        )
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
    """A param group's :class:`adadiag_ref.Engine` over its plain parameters with a gradient, built with
    live states (:meth:`adadiag_ref.Engine.from_states`): ``optimizer.state[p]``'s moments and bases are views of
    the engine's arrays, which every step writes in place, so ``state_dict()`` and a user's references stay
    current; kept while it :meth:`holds` them."""

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
    """A plain tensor or parameter on any device (not FSDP2's DTensor or another subclass): its group's engine
    steps it."""
    return type(p) in (torch.Tensor, torch.nn.Parameter)


def _initialisation_only(work: list[_Work]) -> bool:
    """Whether a first ``step()`` (no state yet) only initialises the states: every group's ``lr`` is 0 and every
    gradient is exactly zero (:class:`CoreOptimizer`, "Initialisation step": what
    ``torch.distributed.checkpoint.state_dict``'s ``_init_optim_state`` takes).  Such a step can change no parameter
    and carries no information about the gradients; counting it would put the first refresh at ``t = 1 + T``.  The
    gradients are read (one synchronisation per parameter) only when every ``lr`` is already 0."""
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


def _refuse_hidden_shapes(
    groups: list[dict[str, Any]], registered: list[list[tuple[int, ...]]] | None = None, *, first_group_index: int = 0
) -> None:
    """``RuntimeError`` when a wrapper hides a parameter's matrix from the optimizer (:func:`_sharded.hidden_shape`:
    FSDP1, DeepSpeed ZeRO-3) or, with ``registered`` (each group's parameter shapes when it was added), replaced
    the group's parameters by a flat partition (:func:`_sharded.shape_change`: DeepSpeed ZeRO), so that no other
    optimizer (AdamW on a flat shard) runs silently in its place.  Nothing is changed by the check."""
    for offset, group in enumerate(groups):
        group_index, names = first_group_index + offset, group.get("param_names")
        for index, p in enumerate(group["params"]):
            if reason := _sharded.hidden_shape(p):
                raise RuntimeError(f"{_label(names, index, group_index)[1]} {reason}; {_sharded.ALTERNATIVES}; "
                                   "no parameter and no optimizer state was changed")  # fmt: skip
        was = registered[offset] if registered is not None and offset < len(registered) else None
        if was is not None and (change := _sharded.shape_change(was, [tuple(p.shape) for p in group["params"]])):
            raise RuntimeError(
                f"param_groups[{group_index}] {change}: a wrapper replaced or flattened its parameters "
                f"(DeepSpeed ZeRO hands the optimizer one flat partition per group), so the optimizer cannot "
                f"see their matrices; {_sharded.ALTERNATIVES} (a parameter resized on purpose needs a new "
                "optimizer); no parameter and no optimizer state was changed"
            )


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


def _bases(state: Any) -> dict[str, torch.Tensor]:
    return {f: getattr(state, f) for f in ("P", "Q") if getattr(state, f) is not None}


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
    """The ``torch.optim.Optimizer`` class of registered optimizer ``name`` (made once, then the same object).

    Generated from the registry (:data:`adadiag_ref.config.OPTIMIZERS`): a :class:`CoreOptimizer` whose
    ``core_name`` is ``name``, called by the entry's ``class_name`` (``AdaDiagPP`` for ``adadiag_pp``).  The
    library's eight are also this module's attributes (``pytorch.AdaDiag``); an optimizer registered later
    (``register_family``) is reached through this function.  ``ValueError`` for a name that is not registered.
    """
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
