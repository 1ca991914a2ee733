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

* a plain tensor on any device (``foreach`` unset, the default) is stepped by its param group's
  :class:`adadiag_ref.Engine` (one per group, kept between steps, refresh steps included): in host memory its group
  kernels over the tensors' own memory (numba) and one ``torch.mm`` per rotated matrix, ``ar.step``'s bits; on CUDA
  with CuPy its CUDA group kernels, else its gathering path in torch ops.  The engine holds the moments and bases,
  and ``optimizer.state[p]``'s tensors are views of its arrays, written in place;
* a ``foreach=True`` group: the multi-tensor chain (``torch._foreach_*``); FSDP2's sharded parameters their own
  route (:mod:`._sharded`); any other parameter ``update_in_place`` (the reference's arithmetic in torch ops).
  Moving the multi-tensor chain into the engine is the open part of issue 44.

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
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import numpy

import adadiag_ref as ar
from adadiag_ref.config import BaseConfig
from adadiag_ref.optim import (
    Layout,
    beta_hats,
    check_state,
    decays,
    from_work,
    host_step,
    layout_for,
    learning_rate,
    namespace,
    prepare_step,
    split_batch,
    sqrt_each,
    unrotate,
    work_dtype,
)
from adadiag_ref.optim.families import family_of
from adadiag_ref.optim.families.adam import SPEC as ADAM_FAMILY

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


def _finite_at_least(value: Any, low: float, high: float = math.inf, *, closed_high: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return low <= value <= high if closed_high else low <= value < high


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
        foreach: the Adam family's multi-tensor route (``torch._foreach_*``, as
            ``torch.optim.AdamW(foreach=True)``): the moments, the direction and the tail of all parameters of a
            group run as a fixed number of ``torch._foreach_*`` calls; only the rotations (GEMMs) stay per
            parameter, and under ``torch.compile`` the update goes into a graph.  ``None`` (default) or ``False``:
            off, on every device: the group's engine steps it, the faster route (:meth:`routes`,
            docs/adapters.md); ``True`` turns it on (on the CPU bit-identical to ``False``).  Every other family
            ignores it: its group's engine steps its parameters (an entrywise family's direction once over a flat
            group), FSDP2's their own route.  A group may set it; ``load_state_dict`` keeps this optimizer's
            choice (the state is the same either way).
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
    the host.  With ``foreach`` the sums are ``torch._foreach_norm(grads, 1)`` (the sum of ``|G|``, one call per
    device and dtype).

    FSDP2 (``torch.distributed.fsdp.fully_shard``: DTensor parameters, rows split over the ranks) is handled by
    :mod:`adadiag_ref.adapters._sharded`, the core's math unchanged: where the rows a rank holds form a block of
    whole, unrotated work-frame columns (or rows) and the family's direction is entrywise (the Adam family:
    AdamW; AdaDiag on tall, 1-D and tall conv parameters), the step runs on the local shard with the moments
    sharded like the parameter and nothing sent but the ranks' agreement (``process_group``); otherwise the whole
    gradient (and ``W`` where the update reads it) is all-gathered, the state is whole on every rank and each
    rank keeps its rows of the update; a ``batch_dims`` stack (experts) split on dim 0 is stepped and refreshed
    by the rank that holds each matrix, its state sharded like it, nothing sent.  Each refresh decomposes every
    matrix once across the ranks (an owner per matrix, round-robin; the bases are broadcast).  The shards equal
    the single-process run (docs/adapters.md, "Exactness"), and DCP
    (``get_/set_optimizer_state_dict``) saves and restores the sharded state (docs/adapters.md, "Sharded
    training").

    Initialisation step: a ``step()`` on an optimizer without any state, with every group's ``lr`` equal to 0 and
    every gradient exactly zero, creates the states (``ar.init``, step 0) and counts no step, so the first real
    step refreshes the basis.  This is the step DCP's ``get_/set_optimizer_state_dict`` take to initialise a fresh
    optimizer (zero gradients, ``lr = 0``); ``torch.optim.AdamW`` counts it (``step = 1``, so its next step's bias
    correction is that of ``t = 2``).

    ``torch.compile(opt.step)``: the host phase of a step (validation, counters, refreshes, new states: everything a
    graph cannot hold) runs outside the graph on purpose (``torch.compiler.disable``); on steps without a refresh the
    update of the Adam family's ``foreach=True`` groups runs in one graph (the multi-tensor route), bit-identical to the
    eager step and with no recompile after warm-up.  Without ``foreach=True`` the whole eager step runs outside the
    graph instead (the engines' group kernels are faster than the graph), with a one-time ``UserWarning``.
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
        self._warned_eager_under_compile = False  # torch.compile(opt.step) on the CPU: said once (_update_in_graph)
        if name not in ar.OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(ar.OPTIMIZERS)}")
        self.core_name = name
        self._configs: dict[tuple[Any, ...], BaseConfig] = {}
        self._frames: dict[int, _Frame] = {}
        self._engines: dict[int, _GroupEngine] = {}  # per group: the engine of its plain parameters (_engine_of)
        self._registered_shapes: list[list[tuple[int, ...]]] = []  # per group, as add_param_group saw them
        self._shapes_checked = False  # the first step() checks every parameter (:func:`_refuse_hidden_shapes`)
        if unknown := sorted(set(family_options) - self._config_fields):
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

    @property
    def _config_fields(self) -> frozenset[str]:
        """Group entries that are core config fields (lr is passed to ``update`` at each step instead)."""
        return _config_fields_of(self.core_name)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "core_name": self.core_name, "split_refresh": self.split_refresh}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.split_refresh = bool(state.get("split_refresh", False))
        self.process_group = None  # a process group does not pickle: the unpickled optimizer agrees over the default
        self._warned_eager_under_compile = False
        self._configs = {}
        self._frames = {}
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
        options = {k: _hashable(_number(v)) for k, v in group.items() if k in self._config_fields}
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

        Phase 1 validates everything (hyperparameters, gradient layout, shapes,
        dtypes, finiteness: one sum per gradient, one synchronisation); phase 2 computes the new bases of
        the parameters due for a refresh (new tensors); only phase 3 writes, so a
        failure in phase 1 or 2 leaves every parameter and state bit-identical.
        """
        if not self._shapes_checked:  # before the closure and before anything changes
            _refuse_hidden_shapes(self.param_groups, self._registered_shapes)
            self._shapes_checked = True
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():  # the host phase outside the graph, the update in it
            _foreach_traced(_step_on_host_outside_graph(self, True))
            return loss
        agreed = self._agreed()  # under torch.distributed: the ranks agree before anything else is exchanged
        if not self._engines_only_step(agreed):
            self._step_on_host(deferred=False, agreed=agreed)
        return loss

    def _engines_only_step(self, agreed: bool) -> bool:
        """The step of a model whose every parameter with a gradient is held by its group's kept engine (the
        steady state of CPU training, frozen parameters aside), without the general path's per-parameter
        bookkeeping: the same checks, in the same order of effects (every group validated, every gradient found
        finite, before the first write).  ``False``, having changed nothing, when anything differs (another set of
        gradients, a missing or replaced state, another dtype, shape or layout, a refresh split over the ranks, a
        non-finite gradient: :meth:`_step_on_host` then takes the step, or raises its error)."""
        jobs = []
        for group_index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]  # frozen parameters have none
            if not params:
                continue
            held = self._engines.get(group_index)
            cfg = self._build_config(group)
            if held is None or _foreach_on(group, cfg):
                return False
            grads = [p.grad for p in params]
            if not all(g.layout is torch.strided and g.dtype == p.dtype and g.shape == p.shape
                       for g, p in zip(grads, params, strict=True)):  # fmt: skip
                return False
            flats = [self.state.get(p) for p in params]
            if not held.holds_these(params, flats, cfg, held.counters.numpy().tolist()):  # the counters its own
                return False
            counts = held.counts
            if self._split() and any(ar.refresh_due(count, cfg) for count in set(counts)):
                return False
            if group["maximize"]:
                grads = list(torch._foreach_neg(grads))
            jobs.append((held, grads, cfg, _number(group["lr"])))
        if not agreed and not all(bool(held.engine.finite(grads)) for held, grads, _, _ in jobs):
            return False
        for held, grads, cfg, lr in jobs:
            held.step(grads, cfg, lr)
        return bool(jobs)

    def _update_in_graph(self) -> bool:
        """Whether ``torch.compile(opt.step)`` puts the Adam family's update in a graph (the multi-tensor route): when
        one of its groups sets ``foreach=True``.  Otherwise the whole step runs as the eager one does, through the
        groups' engines, outside the graph: on the CPU their group kernels take 0.4x (AdamW) to 0.65x (AdaDiag) of the
        compiled multi-tensor step's time (``benchmarks/bench_torch_compile.py``), so a graph could only be slower, and
        a compiled step keeps the eager step's bits on every device."""
        return any(_foreach_on(group, self._build_config(group)) for group in self.param_groups)

    def _agreed(self) -> bool:
        """Under ``torch.distributed`` with more than one rank in :attr:`process_group`: make the ranks agree on
        the step (:func:`_sharded.exchange`, one all-reduce; per parameter: gradient present, valid and exactly
        finite, and the step counter) and return ``True``, or raise the same ``ValueError`` on every rank with
        nothing changed.  ``False`` (nothing exchanged) without a process group of more than one rank.

        A step's collectives (the bases' broadcasts of ``split_refresh``, FSDP2's gathers) follow from these
        facts alone, so ranks that agree on them enter the same collectives in the same order; ranks that do not
        learn it here together, instead of waiting in different collectives (a hang) or stepping different
        parameters (ranks that silently diverge under DDP)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.process_group) <= 1:
            return False
        codes, counts, wheres, tested = [], [], [], []
        for group_index, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for index, p in enumerate(group["params"]):
                wheres.append(_where(names, index, group_index))
                grad, flat = p.grad, self.state.get(p)
                counts.append(int(flat["step"]) if flat and grad is not None else 0)
                if grad is None:
                    codes.append(_sharded.NO_GRAD)
                elif _invalid_grad(p, grad):
                    codes.append(_sharded.HAS_GRAD | _sharded.INVALID)
                else:
                    codes.append(_sharded.HAS_GRAD)
                    tested.append((len(codes) - 1, _sharded.local(grad)))
        for (j, _), finite in zip(tested, _exactly_finite([g for _, g in tested]), strict=True):
            codes[j] |= 0 if finite else _sharded.NONFINITE
        backend = str(dist.get_backend(self.process_group))
        device = "cpu" if "gloo" in backend or "mpi" in backend else torch.accelerator.current_accelerator()
        table = _sharded.exchange(codes, counts, group=self.process_group, device=device)
        if table is None:
            return True
        message = _sharded.disagreement(table, wheres, _sharded.group_ranks(self.process_group))
        if message is None:  # only the counters of parameters without a gradient anywhere differ: nothing steps them
            return True
        raise ValueError(
            f"{message}; every rank raises this error, and no parameter and no optimizer state was changed"
        )

    def _step_on_host(self, deferred: bool, agreed: bool | None = None) -> list[_ForeachPlan]:
        """The body of :meth:`step` after the closure: validation, refreshes and every update, except, when
        ``deferred`` (under ``torch.compile``), the multi-tensor update of the Adam family's batches without a
        refresh or a new state, returned as plans for :func:`_foreach_traced` (the part compiled into a graph).

        Under ``torch.compile`` this runs outside the graph (:data:`_step_on_host_outside_graph`): it reads host
        values (the finiteness test, the counters), decomposes on the host and makes new states, none of which a
        graph can hold.  The Adam family then takes the multi-tensor route, bit-identical to the per-parameter one.

        ``agreed``: :meth:`_agreed` ran this step (``None``: run it now), so every gradient is known to be finite on
        every rank and the local finiteness test is skipped.
        """
        if agreed is None:
            agreed = self._agreed()
        if deferred and not self._update_in_graph():  # the engines' eager step is faster than the graph: eager bits
            if not self._warned_eager_under_compile:
                self._warned_eager_under_compile = True
                warnings.warn(_EAGER_UNDER_COMPILE, UserWarning, stacklevel=2)
            if not self._engines_only_step(agreed):
                self._step_on_host(deferred=False, agreed=agreed)
            return []
        work = []
        for group_index, group in enumerate(self.param_groups):
            cfg = self._build_config(group)
            lr = _number(group["lr"])
            names = group.get("param_names")
            foreach = _foreach_on(group, cfg)
            for index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                grad = self._checked_grad(p, group)
                flat: dict[str, torch.Tensor] = self.state.get(p) or {}
                fresh = not flat
                where = _where(names, index, group_index)
                label = _label(names, index, group_index)
                # a parameter with fewer dimensions than the group's batch_dims, named before any state exists
                split_batch(tuple(p.shape), cfg.batch_dims, name=label)
                sharded = _sharded.is_sharded(p)  # FSDP2: its own route (adapters/_sharded.py), never foreach
                if fresh:
                    flat = from_core_state(_sharded.init(p, cfg) if sharded else ar.init(p, cfg))
                    flat["step"] = flat["step"].cpu()  # as torch.optim: the counter lives on the host
                engine = not foreach and _plain_parameter(p)  # FSDP2's DTensors are not plain
                work.append(_Work(p, grad, flat, fresh, cfg, lr, where, label, foreach and not sharded, group_index,
                                  engine))  # fmt: skip
        self._check_shapes(work)
        # a step of existing multi-tensor states without refresh reads its finiteness verdict after its work is
        # queued (the device never waits for the host's check), and commits only then; any other step reads it
        # first, before a decomposition or a per-parameter update writes
        counts = _host_counts(work)  # host counters: no device sync
        due = [ar.refresh_due(count, item.cfg) for item, count in zip(work, counts, strict=True)]
        queued = not deferred and bool(work) and not any(due)
        queued = queued and all(item.foreach and not item.fresh for item in work)
        if self._split() and any(due):  # the bases decomposed once over the ranks: that step per parameter
            work = [item._replace(engine=False) for item in work]
        engines = self._engines_for(work, counts)
        off_engine = [item for item in work if not item.engine]
        verdict = self._finiteness(off_engine) if queued and not agreed else None
        if verdict is None:
            if not agreed:  # agreed: every gradient was found finite, exactly, on every rank
                self._raise_if_nonfinite(off_engine, self._finiteness(off_engine))
                for held, items in engines:
                    if not bool(held.engine.finite([item.grad for item in items])):
                        self._raise_first_nonfinite(items)
            if not self.state and _initialisation_only(work):  # torch.distributed.checkpoint's initialisation
                for item in work:
                    self._commit(item, {})  # the states of ar.init, step 0: the first real step refreshes
                return []
        self._whole_grads: dict[int, torch.Tensor] = {}  # DTensor gradients gathered by a refresh, for the update
        refreshes = iter(self._refresh([item for item, d in zip(work, due, strict=True) if d and not item.engine]))
        batches: dict[tuple[Any, ...], list[_Batched]] = {}
        for held, items in engines:
            for item in items:
                self._commit(item, {})  # a fresh state enters self.state
            held.step([item.grad for item in items], items[0].cfg, items[0].lr)
        for item, is_due, count in zip(work, due, counts, strict=True):
            if item.engine:
                continue
            # the core's NamedTuple over the very tensors of the flat dict (no copy); update_in_place overwrites the
            # moments in place, so only the counter and new bases need writing back, into the same tensor objects
            state = to_core_state(item.flat, item.cfg)
            # a refresh that kept the previous basis is no refresh for the update (no refresh structure), as ar.step
            new_bases, refreshed = next(refreshes) if is_due else ({}, False)
            if new_bases:
                state = state._replace(**new_bases)
            if item.foreach:  # updated below, with the other parameters of its group, device, dtypes and step
                check_state(state, item.grad, item.p, item.cfg)
                key = (item.group_index, item.p.device, item.p.dtype, work_dtype(state), count)
                batches.setdefault(key, []).append(_Batched(item, state, refreshed, new_bases))
                continue
            if _sharded.is_sharded(item.p):
                whole = self._whole_grads.get(id(item.p))
                _sharded.update(state, item.grad, item.cfg, item.p, lr=item.lr, refreshed=refreshed, whole_grad=whole)
                self._commit(item, new_bases)
                item.flat["step"] += 1
                continue
            # same numbers as ``p += ar.update(...)[0]`` (bit for bit)
            ar.update_in_place(state, item.grad, item.cfg, item.p, lr=item.lr, refreshed=refreshed)
            self._commit(item, new_bases)
            item.flat["step"] += 1
        frames: dict[int, _Frame] = {}
        plans = []
        commits: list[tuple[Callable[[], None], list[_Batched]]] = []
        for key, batch in batches.items():  # the Adam family's foreach=True batches
            if deferred and not any(entry.refreshed or entry.new_bases or entry.item.fresh for entry in batch):
                plans.append(_as_graph_inputs(_foreach_plan(batch, None, self._frames, frames)))
                continue
            commits.append((_foreach_adam(batch, key[-1], self._frames, frames), batch))
            if verdict is None:
                self._commit_batch(*commits.pop())
        if verdict is not None:  # every batch's work is queued: now the one synchronisation of the step
            self._raise_if_nonfinite(work, verdict)
            for commit, batch in commits:
                self._commit_batch(commit, batch)
        self._frames = frames  # the views of this step's states only: nothing stale is kept alive
        self._whole_grads = {}
        return plans

    def _split(self) -> bool:
        """Whether a refresh is split over the ranks (``split_refresh`` under more than one rank)."""
        dist = torch.distributed
        return (
            self.split_refresh
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )

    def _engines_for(self, work: list[_Work], counts: list[int]) -> list[tuple[_GroupEngine, list[_Work]]]:
        """Per param group, the engine that steps its plain parameters (``item.engine``) and those
        items: the one kept when it still holds them, else one built over their states (the state dicts then hold
        views of its arrays; their values are unchanged)."""
        by_group: dict[int, list[tuple[_Work, int]]] = {}
        for item, count in zip(work, counts, strict=True):
            if item.engine:
                by_group.setdefault(item.group_index, []).append((item, count))
        engines = []
        for group_index, members in by_group.items():
            items, group_counts = [item for item, _ in members], [count for _, count in members]
            held = self._engines.get(group_index)
            if held is None or not held.holds(items, group_counts):
                held = self._engines[group_index] = _GroupEngine(items, group_counts)
            engines.append((held, items))
        return engines

    def _engine_of(self, group_index: int) -> _GroupEngine | None:
        """The engine the group's plain parameters with a gradient would step through now: the one kept
        when it still holds them, else one built over their states (new ones where they have none) but not kept."""
        group = self.param_groups[group_index]
        cfg = self._build_config(group)
        if _foreach_on(group, cfg):
            return None
        names = group.get("param_names")
        items = []
        for index, p in enumerate(group["params"]):
            if p.grad is None or not _plain_parameter(p):
                continue
            flat = self.state.get(p) or from_core_state(ar.init(p.detach(), cfg))
            label = _label(names, index, group_index)
            items.append(_Work(p, p.grad, flat, False, cfg, group["lr"], "", label, False, group_index, True))
        if not items:
            return None
        counts = [int(item.flat["step"]) for item in items]
        held = self._engines.get(group_index)
        if held is not None and held.holds(items, counts):
            return held
        return _GroupEngine([item._replace(flat=dict(item.flat)) for item in items], counts)

    def routes(self) -> dict[str, dict[str, str]]:
        """Which code runs each part of a step, per parameter (``named_parameters()`` names when the groups were
        given them, else ``"param_groups[i].params[j]"``), for the gradients present now: a mapping with

        * ``"refresh"``: the basis refresh;
        * ``"rotate"``: ``G~ = P^T G Q`` and ``P U~ Q^T``;
        * ``"moments"``: moments, direction and tail of a step;
        * ``"engine"`` (a plain parameter): its group in the param group's :class:`adadiag_ref.Engine`.

        A plain parameter (any device; not FSDP2's, not a ``foreach=True`` group) is stepped by its param group's
        engine, and its entries are that engine's :meth:`adadiag_ref.Engine.routes`; the others say
        ``"foreach multi-tensor ..."``, ``"per parameter: update_in_place ..."`` or
        ``"sharded ..."``.  A parameter without a gradient is skipped.
        """
        out: dict[str, dict[str, str]] = {}
        for group_index, group in enumerate(self.param_groups):
            names = group.get("param_names")
            labels = [_label(names, i, group_index) for i in range(len(group["params"]))]
            held = self._engine_of(group_index)
            by_engine = dict(zip(held.params_ids(), held.engine.routes().values(), strict=True)) if held else {}
            split = " (split over the ranks: that step per parameter)" if self._split() else ""
            for label, p in zip(labels, group["params"], strict=True):
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
        elif _foreach_on(group, cfg):
            moments = "foreach multi-tensor (torch._foreach_*, one call per op for the group)"
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

    def _commit_batch(self, commit: Callable[[], None], batch: list[_Batched]) -> None:
        """A multi-tensor batch's computed step written (``W``, the moments), new bases in, counters advanced."""
        commit()
        for entry in batch:
            self._commit(entry.item, entry.new_bases)
        torch._foreach_add_([entry.item.flat["step"] for entry in batch], 1)

    def _check_shapes(self, work: list[_Work]) -> None:
        """Shapes and dtypes per parameter (no value read)."""
        for item in work:
            if tuple(item.grad.shape) != tuple(item.p.shape):
                raise ValueError(
                    f"gradient of {item.where} has shape {tuple(item.grad.shape)}, the parameter "
                    f"{tuple(item.p.shape)}; no parameter and no state was changed"
                )
            if item.grad.dtype != item.p.dtype:
                raise ValueError(
                    f"gradient of {item.where} has dtype {item.grad.dtype}, the parameter {item.p.dtype}; "
                    "no parameter and no state was changed"
                )

    def _finiteness(self, work: list[_Work]) -> tuple[list[int], torch.Tensor] | None:
        """The finiteness verdict of all gradients, queued on the device (nothing read back): the index in
        ``work`` of each reduction and whether each is finite; ``None`` without work."""
        if not work:
            return None
        device = work[0].grad.device
        # one reduction per gradient, no gradient-sized temporary: a sum is NaN or Inf whenever an entry is, but
        # may also overflow on finite entries, so a non-finite sum is only a suspicion, settled exactly
        order, reductions = _finiteness_sums([item.grad for item in work], [item.foreach for item in work])
        return order, torch.isfinite(torch.stack([r.to(device) for r in reductions]))

    def _raise_if_nonfinite(self, work: list[_Work], verdict: tuple[list[int], torch.Tensor] | None) -> None:
        """Read the verdict (the one synchronisation of a step without refresh) and raise ``ValueError`` naming
        the first parameter whose gradient holds NaN or Inf, settled exactly gradient by gradient (a non-finite
        sum of finite entries that overflowed raises nothing)."""
        if verdict is None:
            return
        order, finite = verdict
        if not bool(finite.all()):
            self._raise_first_nonfinite([work[order[int(i)]] for i in torch.nonzero(~finite).flatten()])

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

    def _refresh(self, items: list[_Work]) -> list[tuple[dict[str, torch.Tensor], bool]]:
        """``({"P"[, "Q"]}, refreshed)`` per parameter due (``refresh_basis``), split over ranks when asked.

        ``refreshed`` is the core's (:func:`adadiag_ref.step`): False when the refresh kept the previous basis
        (a failed decomposition), which ``refresh_basis`` returns as the very same tensors.  The bases are then
        the previous ones and the step's update applies no refresh-step structure.
        """
        dist = torch.distributed
        states = [to_core_state(item.flat, item.cfg) for item in items]
        sharded = [_sharded.is_sharded(item.p) for item in items]
        if any(sharded):  # FSDP2: gathered gradients, an owner per matrix (adapters/_sharded.py)
            plain = iter(self._refresh([item for item, s in zip(items, sharded, strict=True) if not s]))
            mine = [j for j, s in enumerate(sharded) if s]
            split = iter(_sharded.refresh([items[j] for j in mine], [states[j] for j in mine], self._whole_grads))
            return [next(split) if s else next(plain) for s in sharded]
        distributed = self.split_refresh and dist.is_available() and dist.is_initialized()
        if not (distributed and dist.get_world_size(self.process_group) > 1):
            # batched per config (ar.refresh_bases): one stacked decomposition per work shape on a device
            by_config: dict[BaseConfig, list[int]] = {}
            for j, item in enumerate(items):
                by_config.setdefault(item.cfg, []).append(j)
            news: list[Any] = [None] * len(items)
            for cfg, members in by_config.items():
                fresh = ar.refresh_bases([states[j] for j in members], [items[j].grad for j in members], cfg,
                                         names=[items[j].name for j in members])  # fmt: skip
                for j, new in zip(members, fresh, strict=True):
                    news[j] = new
            return [(_bases(new), new.P is not old.P) for old, new in zip(states, news, strict=True)]
        return _sharded.owned_refresh(
            states,
            [item.grad for item in items],
            [item.cfg for item in items],
            [item.name for item in items],
            group=self.process_group,
            device=items[0].p.device if items else "cpu",
        )

    @staticmethod
    def _checked_grad(p: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
        grad = p.grad
        assert grad is not None
        if grad.is_sparse or grad.layout != torch.strided:
            raise RuntimeError(
                f"sparse gradients ({grad.layout}) are not supported: the AdaDiag optimizers rotate the dense "
                "gradient matrix; use dense gradients (e.g. nn.Embedding(sparse=False))"
            )
        if torch.is_complex(grad) or torch.is_complex(p):
            raise RuntimeError(
                f"complex parameters/gradients ({p.dtype}) are not supported: AdaDiag is defined for real "
                "parameters; optimise torch.view_as_real(param) instead"
            )
        return -grad if group["maximize"] else grad

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
        kept = [group.get("foreach") for group in self.param_groups]
        super().load_state_dict(
            {
                **state_dict,
                "state": {},
                "param_groups": [{k: v for k, v in g.items() if k != "param_shapes"} for g in groups],
            }
        )
        for group, foreach in zip(self.param_groups, kept, strict=True):
            group["foreach"] = foreach  # an execution choice of this optimizer, not of the checkpoint
        for group in self.param_groups:
            for p in group["params"]:
                if p in loaded:
                    self.state[p] = loaded[p]
        self._engines = {}  # new state tensors: the engines are built again, holding them


_EAGER_UNDER_COMPILE = (
    "torch.compile(opt.step) with foreach unset runs the eager step, outside the graph: the engines' group kernels "
    "take 0.4x to 0.65x of the time of a compiled multi-tensor update on the CPU, and give the same bits. "
    "Dynamo's call around it costs about 20 us a step (measurable on a tiny model only), so call opt.step() "
    "uncompiled there, or set foreach=True to put the update in a graph anyway (docs/adapters.md, 'torch.compile')"
)

_step_on_host_outside_graph = torch.compiler.disable(
    CoreOptimizer._step_on_host,
    reason=(
        "adadiag_ref runs a step's host phase (gradient validation with one host read, step counters, basis refresh "
        "on the host) outside the graph on purpose, so torch.compile(opt.step, fullgraph=True) is refused; see "
        "docs/adapters.md, 'torch.compile'"
    ),
)
""":meth:`CoreOptimizer._step_on_host` as ``torch.compile`` calls it: run eagerly, outside the graph, on purpose."""


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
    foreach: bool  # updated by the multi-tensor route (:func:`_foreach_adam`)
    group_index: int
    engine: bool  # stepped by its group's engine (:class:`_GroupEngine`): plain, not foreach=True, not FSDP2


class _GroupEngine:
    """A param group's :class:`adadiag_ref.Engine` over its plain parameters with a gradient, built with
    live states (:meth:`adadiag_ref.Engine.from_states`): ``optimizer.state[p]``'s moments and bases are views of
    the engine's arrays, which every step writes in place, so ``state_dict()`` and a user's references stay
    current.  Kept while the same parameters (dtypes too) have a gradient, their state dicts hold the very tensors
    handed to them and the host counters agree; otherwise built again from the states (a copy)."""

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
        self.held: list[tuple[tuple[str, torch.Tensor], ...]] = []
        for i, flat in enumerate(self.flats):
            state = self.engine.state(i)
            tensors = {f: getattr(state, f) for f in state._fields[1:] if f != "param_shape"}
            tensors["step"] = self.counters[i]
            flat.update({f: t for f, t in tensors.items() if t is not None})
            self.held.append(tuple((f, t) for f, t in tensors.items() if t is not None))
        self.counts = list(counts)
        self.cfg = cfg  # the last config found to differ from the engine's in betas and weight_decay only

    def params_ids(self) -> list[int]:
        return [id(p) for p in self.params]

    def holds(self, items: list[_Work], counts: list[int]) -> bool:
        """Whether this engine can take the step of ``items`` (their host counters ``counts``)."""
        return self.holds_these([item.p for item in items], [item.flat for item in items], items[0].cfg, counts)

    def holds_these(self, params: list[torch.Tensor], flats: list[Any], cfg: BaseConfig, counts: list[int]) -> bool:
        """Whether this engine can step ``params``, whose state dicts are ``flats`` and host counters ``counts``,
        under ``cfg``: the very parameters (same dtypes and shapes) and state dicts it was built over, each still
        holding the tensors it handed them, the counters it keeps, and a config it takes (:meth:`_takes`)."""
        if len(params) != len(self.params) or counts != self.counts or not self._takes(cfg):
            return False
        if not all(map(operator.is_, params, self.params)) or not all(map(operator.is_, flats, self.flats)):
            return False
        if any(p.dtype != dtype or p.shape != shape for p, dtype, shape in zip(params, self.dtypes, self.shapes,
                                                                              strict=True)):  # fmt: skip
            return False
        return all(flat.get(f) is t for flat, held in zip(flats, self.held, strict=True) for f, t in held)

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
        own = cfg is self.engine.cfg  # else a step's own betas and weight decay (the gathering path)
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
    gradient is exactly zero.

    That is the step ``torch.distributed.checkpoint.state_dict`` takes in ``_init_optim_state`` (called by
    ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` on an optimizer without state): it sets every
    gradient to ``zeros_like``, every ``lr`` to 0 and calls ``step()``.  Such a step can change no parameter
    (``-0 * D``) and carries no information about the gradients, so it creates the states of ``ar.init`` and counts
    no step: the first real step is ``t = 1`` and refreshes the basis.  Counting it would leave ``step = 1`` with the
    identity basis, so the first refresh would come only at ``t = 1 + T``.  The gradients are read (one
    synchronisation per parameter) only when every ``lr`` is already 0."""
    return bool(work) and all(item.lr == 0 for item in work) and not any(bool(torch.any(item.grad)) for item in work)


def _label(names: Any, index: int, group_index: int) -> str:
    """A parameter as :meth:`CoreOptimizer.routes` and the core's messages name it: ``fc.weight`` with
    ``named_parameters()``, else ``param_groups[i].params[j]``."""
    return str(names[index]) if names else f"param_groups[{group_index}].params[{index}]"


def _where(names: Any, index: int, group_index: int) -> str:
    """A parameter as error messages name it: ``parameter 'fc.weight'`` with ``named_parameters()``, else its
    index and group."""
    return f"parameter {names[index]!r}" if names else f"parameter {index} of param_groups[{group_index}]"


_SHARDED_ALTERNATIVES = (
    "the rotation needs each parameter's whole matrix: shard with FSDP2 (torch.distributed.fsdp.fully_shard) or "
    "replicate with DistributedDataParallel (optionally with split_refresh=True, or under "
    "ZeroRedundancyOptimizer) instead"
)


def _hidden_shape(p: torch.Tensor) -> str | None:
    """Why the optimizer cannot see the matrix of ``p`` (a clause naming the wrapper), or ``None`` when it can.

    Relies on the marks the wrappers leave on the tensors the optimizer is given:

    * FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``): its ``FlatParamHandle`` sets
      ``_fsdp_flattened = True`` on every original parameter it manages (``use_orig_params=True``: the
      parameters become 1-D views into this rank's shard of the flat parameter) and on the ``FlatParameter``
      itself (``use_orig_params=False``).  Every sharding strategy is refused, ``NO_SHARD`` too (use DDP, its
      equivalent).
    * DeepSpeed ZeRO-3: a partitioned parameter carries its true shape in ``ds_shape`` (with ``ds_id``,
      ``ds_numel``, ``ds_tensor``) while the tensor itself is empty; refused unless it is gathered (its shape is
      then ``ds_shape``).
    """
    if getattr(p, "_fsdp_flattened", False):
        return (
            f"is managed by FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel), which hands the optimizer "
            f"flat 1-D shards of its parameters (this one has shape {tuple(p.shape)})"
        )
    ds_shape = getattr(p, "ds_shape", None)
    if ds_shape is not None and tuple(ds_shape) != tuple(p.shape):
        return (
            f"is partitioned by DeepSpeed ZeRO-3: its matrix has shape {tuple(ds_shape)} (ds_shape), the "
            f"optimizer is given a tensor of shape {tuple(p.shape)}"
        )
    return None


def _refuse_hidden_shapes(
    groups: list[dict[str, Any]], registered: list[list[tuple[int, ...]]] | None = None, *, first_group_index: int = 0
) -> None:
    """``RuntimeError`` when a parameter's true shape is hidden from the optimizer, so that no other optimizer
    (AdamW on a flat shard) runs silently in its place.

    Two tests: the wrappers' marks (:func:`_hidden_shape`), and, with ``registered`` (the shapes of each group's
    parameters when it was added), a group whose parameters changed count or shape since: what DeepSpeed ZeRO
    stages 1 and 2 (and 3) do when they replace ``param_group["params"]`` with one flat partition of the group,
    a tensor without any mark.  Nothing is changed by the check."""
    for offset, group in enumerate(groups):
        group_index = first_group_index + offset
        names = group.get("param_names")
        for index, p in enumerate(group["params"]):
            if reason := _hidden_shape(p):
                raise RuntimeError(
                    f"{_where(names, index, group_index)} {reason}; {_SHARDED_ALTERNATIVES}; no parameter and no "
                    "optimizer state was changed"
                )
        if registered is not None and offset < len(registered):
            if change := _shape_change(registered[offset], [tuple(p.shape) for p in group["params"]]):
                raise RuntimeError(
                    f"param_groups[{group_index}] {change}: a wrapper replaced or flattened its parameters "
                    f"(DeepSpeed ZeRO hands the optimizer one flat partition per group), so the optimizer cannot "
                    f"see their matrices; {_SHARDED_ALTERNATIVES} (a parameter resized on purpose needs a new "
                    "optimizer); no parameter and no optimizer state was changed"
                )


def _shape_change(was: list[tuple[int, ...]], now: list[tuple[int, ...]]) -> str | None:
    """How a group's parameter shapes changed since it was added (a clause), or ``None`` if they did not."""
    if len(now) != len(was):
        return f"held {len(was)} parameters when it was given to the optimizer and holds {len(now)} now"
    for before, after in zip(was, now, strict=True):
        if before != after:
            return f"has a parameter of shape {after} that was {before} when it was given to the optimizer"
    return None


def _finiteness_sum(grad: torch.Tensor) -> torch.Tensor:
    """``sum(G)`` (0-d), accumulated in float32 at least: non-finite whenever an entry of ``G`` is NaN or Inf.

    IEEE sums never leave NaN or Inf again (``inf - inf`` is NaN), so a finite sum proves every entry finite in
    one read of ``G`` and without the boolean ``G``-sized tensor of ``isfinite(G).all()``.  A non-finite sum
    can also come from finite entries whose sum overflows; the caller then tests that gradient exactly.
    float16/bfloat16 gradients are summed in float32, where such overflow is out of reach in practice.
    A DTensor's sum is its local shard's (the ranks agree on every shard's finiteness in
    :meth:`CoreOptimizer._agreed`)."""
    grad = _sharded.local(grad)
    if grad.dtype in (torch.float16, torch.bfloat16):
        return torch.sum(grad, dtype=torch.float32)
    return torch.sum(grad)


def _foreach_devices() -> tuple[str, ...]:
    """Device types with multi-tensor kernels (torch's own list: ``cuda``, ``xpu``, ...; ``cpu`` is not one)."""
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        return tuple(_get_foreach_kernels_supported_devices())
    except (ImportError, AttributeError):  # pragma: no cover - a torch without the helper
        return ("cuda",)


def _foreach_on(group: Mapping[str, Any], cfg: BaseConfig) -> bool:
    """Whether the parameters of ``group`` take the Adam family's multi-tensor route (:func:`_foreach_adam`): only
    where the group sets ``foreach=True``; otherwise (``None``, ``False``, another family) its engine steps them,
    on every device."""
    return family_of(cfg) is ADAM_FAMILY and group.get("foreach") is True


def _host_counts(work: list[_Work]) -> list[int]:
    """The steps taken per parameter, read from the host counters (``"step"``, CPU tensors as in torch.optim)."""
    return _counts_of([item.flat["step"] for item in work])


def _counts_of(counters: list[torch.Tensor]) -> list[int]:
    """The values of host counters (0-d tensors), read together: one stack, one host view."""
    if any(c.device.type != "cpu" or type(c) is not torch.Tensor for c in counters):
        return [int(c) for c in counters]
    return torch.stack(counters).numpy().tolist() if counters else []  # one stack, one host view


def _finiteness_sums(grads: list[torch.Tensor], multi: list[bool]) -> tuple[list[int], list[torch.Tensor]]:
    """``(order, sums)``: a 0-d reduction per gradient (:func:`_finiteness_sum`; where ``multi``,
    ``torch._foreach_norm(G, 1)``, the sum of ``|G|``, one call per device and dtype) and the index in ``grads``
    of each.  Either is NaN or Inf whenever an entry of ``G`` is."""
    order: list[int] = []
    sums: list[torch.Tensor] = []
    buckets: dict[tuple[Any, Any], list[int]] = {}
    for i, (grad, together) in enumerate(zip(grads, multi, strict=True)):
        if together:
            buckets.setdefault((grad.device, grad.dtype), []).append(i)
        else:
            order.append(i)
            sums.append(_finiteness_sum(grad))
    for (_, dtype), members in buckets.items():
        low = dtype in (torch.float16, torch.bfloat16)  # accumulated in float32, as _finiteness_sum does
        norms = torch._foreach_norm([grads[i] for i in members], 1, torch.float32 if low else None)
        order.extend(members)
        sums.extend(norms)
    return order, sums


def _exactly_finite(grads: list[torch.Tensor]) -> list[bool]:
    """``isfinite(G).all()`` per (plain, dense) gradient: one multi-tensor sum per device and dtype (one
    ``torch.sum`` per gradient on the CPU, where ``_foreach_norm`` takes a norm per tensor, 4.4x slower: 10.4
    against 2.35 ms over the 4-block LLaMA-60M's gradients, 1 thread), one host read, and the exact per-entry test
    only for a non-finite sum (NaN or Inf, or finite entries whose sum overflowed)."""
    if not grads:
        return []
    devices = _foreach_devices()
    order, sums = _finiteness_sums(grads, [g.device.type in devices for g in grads])
    finite = [True] * len(grads)
    for i, ok in zip(order, torch.isfinite(torch.stack([s.cpu() for s in sums])).tolist(), strict=True):
        finite[i] = bool(ok) or bool(torch.isfinite(grads[i]).all())
    return finite


def _invalid_grad(p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether a step refuses ``grad`` for ``p`` (:meth:`CoreOptimizer._checked_grad`,
    :meth:`CoreOptimizer._check_shapes`): sparse or not strided, complex, another shape or dtype."""
    return (
        grad.is_sparse
        or grad.layout != torch.strided
        or torch.is_complex(grad)
        or torch.is_complex(p)
        or tuple(grad.shape) != tuple(p.shape)
        or grad.dtype != p.dtype
    )


class _Batched(NamedTuple):
    """One parameter of a multi-tensor batch: its work, its state (new bases in), the refresh flag."""

    item: _Work
    state: Any
    refreshed: bool
    new_bases: dict[str, torch.Tensor]


class _Frame(NamedTuple):
    """A moment's view in its parameter's shape, valid while ``tensor`` keeps this memory and these strides."""

    tensor: torch.Tensor
    data_ptr: int
    stride: tuple[int, ...]
    view: torch.Tensor


def _param_frame(
    x: torch.Tensor, layout: Layout, cache: Mapping[int, _Frame], frames: dict[int, _Frame]
) -> torch.Tensor:
    """``from_work(x)``: an unrotated state matrix seen in its parameter's shape, where ``G`` and ``W`` are.

    The view is made once and kept (``cache`` of the previous step, ``frames`` of this one) while the state
    tensor keeps its memory, so a step makes no view per parameter; a tensor whose storage was replaced
    (``Tensor.set_``, a loaded state) gets a new view.  A wide 2-D parameter's work frame is its own shape."""
    if tuple(x.shape) == layout.shape:
        return x
    entry = cache.get(id(x))
    if entry is None or entry.tensor is not x or entry.data_ptr != x.data_ptr() or entry.stride != x.stride():
        entry = _Frame(x, x.data_ptr(), tuple(x.stride()), from_work(x, layout, torch_namespace()))
    frames[id(x)] = entry
    return entry.view


def torch_namespace() -> Any:
    """The array-API namespace of torch tensors (the core's ``xp``), found once."""
    global _TORCH_XP
    if _TORCH_XP is None:
        _TORCH_XP = namespace(torch.zeros(()))
    return _TORCH_XP


_TORCH_XP: Any = None


def _host_number(x: Any) -> float:
    """A coefficient the core computed as a 0-d tensor on the host (the step counter's device), as a Python float
    holding its value exactly (read from host memory, no device synchronisation)."""
    if isinstance(x, torch.Tensor):
        return float(x.detach().cpu().numpy())
    return float(x)


_HOST_BETAS: dict[tuple[Any, ...], tuple[float, float, float, float]] = {}


def _host_betas(cfg: BaseConfig, count: torch.Tensor, dtype: torch.dtype) -> tuple[float, float, float, float]:
    """``b1_t, b2_t, 1 - b1_t, 1 - b2_t`` of the step after ``count`` (the host counter, an int32 tensor), as exact
    Python floats: the core's host coefficients (:mod:`~adadiag_ref.optim.schedules`: float64 by Python's ``math``
    from the integer step, rounded once to ``dtype``), so every route and backend has the same floats on any CPU.

    Computed once for all the batches of a step: kept for the last few
    ``(betas, bias_correction, count, dtype)``, all they depend on; computed afresh for betas that are not Python
    floats or a counter off the host."""
    key = None
    if count.device.type == "cpu":
        steps = int(count.detach().numpy())  # read from host memory: no aten dispatch
        if all(type(b) is float for b in cfg.betas):
            key = (tuple(cfg.betas), bool(cfg.bias_correction), steps, dtype)
            found = _HOST_BETAS.get(key)
            if found is not None:
                return found
        b1_t, b2_t = beta_hats(cfg, host_step(steps, dtype, torch_namespace()), numpy)  # NumPy 0-d, dtype's precision
    else:
        b1_t, b2_t = beta_hats(cfg, torch_namespace().astype(count + 1, dtype), torch_namespace())
    # 1 - b in the arrays' dtype: exact from the rounded b in float64, rounded once (docs/spec.md)
    b1, b2, c1, c2 = (_host_number(x) for x in (b1_t, b2_t, 1.0 - b1_t, 1.0 - b2_t))
    if key is not None:
        if len(_HOST_BETAS) > 8:
            _HOST_BETAS.clear()
        _HOST_BETAS[key] = (b1, b2, c1, c2)
    return b1, b2, c1, c2


def _foreach_adam(
    batch: list[_Batched], count: int, cache: Mapping[int, _Frame], frames: dict[int, _Frame]
) -> Callable[[], None]:
    r"""The Adam family's step of every parameter of ``batch`` (one group, device, dtype pair and step ``t``,
    ``count = t - 1`` their host counter) as
    ``torch._foreach_*`` calls: the arithmetic of ``update_in_place``, the same operations in the same order::

        G~  = P^T G Q                                        (per parameter; G itself without a basis)
        V_t = b2_t V + (1 - b2_t) G~^2,   M_t = b1_t M + (1 - b1_t) G~
        U~  = M_t / (sqrt(V_t) + eps)
        D   = P U~ Q^T                                       (per parameter; U~ itself without a basis)
        W  <- W + (-eta) (D + lambda W)                      (lambda W only when lambda != 0)

    with ``b_t = beta (1 - beta^(t-1)) / (1 - beta^t)`` (:func:`~adadiag_ref.optim.schedules.beta_hats`, computed
    once by the core's torch code from the host counter and passed as exact Python floats).  Each entry is
    computed by the same IEEE operations as the per-parameter route, so the result is the same bit for bit;
    the moments of an unrotated parameter are updated in its own shape (a view made once, :func:`_param_frame`),
    so for AdamW no call is made per parameter.  Parameters of another dtype than their state (bfloat16) are
    cast per parameter, as ``update_in_place`` casts them.

    All or nothing: the new ``M``, ``V`` and ``delta`` are computed into new tensors first (the GEMMs and
    allocations, everything that can fail); the returned commit then adds ``delta`` to ``W`` and copies ``M``,
    ``V`` into the state's own tensors (``state_dict()`` references stay live)."""
    return _foreach_compute(_foreach_plan(batch, count, cache, frames))


class _ForeachPlan(NamedTuple):
    """A multi-tensor batch with everything read on the host done: the coefficients as Python floats, the
    moments in the frames they are updated in."""

    batch: list[_Batched]
    host_count: int | None  # the host counter for prepare_step; None under torch.compile (t is not needed there)
    layouts: list[Layout]
    moments: list[torch.Tensor]  # M, or its view in the parameter's shape when it has no basis
    seconds: list[torch.Tensor]  # V, likewise
    coefficients: tuple[Any, Any, Any, Any]  # b1_t, b2_t, 1 - b1_t, 1 - b2_t: Python floats, or 0-d tensors
    eta: Any
    counters: list[torch.Tensor]  # the host counters "step", advanced by :func:`_foreach_traced`


def _foreach_plan(
    batch: list[_Batched], count: int | None, cache: Mapping[int, _Frame], frames: dict[int, _Frame]
) -> _ForeachPlan:
    """The host side of :func:`_foreach_adam`: ``b_t`` from the host counter, the moments' frames."""
    first = batch[0]
    cfg = first.item.cfg
    b1, b2, c1, c2 = _host_betas(cfg, first.state.count, first.state.M.dtype)  # prepare_step's t, host counter
    layouts = [layout_for(tuple(entry.item.p.shape), cfg) for entry in batch]
    moments, seconds = [], []
    for entry, layout in zip(batch, layouts, strict=True):
        state = entry.state
        unrotated = state.P is None and state.Q is None  # updated in the parameter's shape, where G is
        moments.append(_param_frame(state.M, layout, cache, frames) if unrotated else state.M)
        seconds.append(_param_frame(state.V, layout, cache, frames) if unrotated else state.V)
    eta = learning_rate(cfg, first.item.lr)
    counters = [entry.item.flat["step"] for entry in batch]
    return _ForeachPlan(batch, count, layouts, moments, seconds, (b1, b2, c1, c2), eta, counters)


def _as_graph_inputs(plan: _ForeachPlan) -> _ForeachPlan:
    """The plan's step-dependent numbers (``b_t``, ``eta``) as 0-d host tensors of the state dtype, holding the
    same values: Dynamo turns a Python float into a constant of the graph (a recompile at every step), a tensor
    into an input.  The multi-tensor ops compute with a Python scalar in the tensors' dtype, so the bits are the
    same.  On the host (as torch.optim's step counters), so making them costs no copy to an accelerator."""
    dtype = plan.batch[0].state.M.dtype
    b1, b2, c1, c2 = (torch.tensor(c, dtype=dtype) for c in plan.coefficients)
    eta = torch.tensor(_number(plan.eta), dtype=dtype)
    return plan._replace(coefficients=(b1, b2, c1, c2), eta=eta)


def _foreach_math(plan: _ForeachPlan) -> None:
    """The tensor side of :func:`_foreach_adam`, computed and committed (no host read: it is what
    ``torch.compile`` puts in a graph)."""
    _foreach_compute(plan)()


def _foreach_compute(plan: _ForeachPlan) -> Callable[[], None]:
    """The tensor side of :func:`_foreach_adam` into new tensors; returns the commit that writes them."""
    batch, layouts, moments, seconds = plan.batch, plan.layouts, plan.moments, plan.seconds
    b1, b2, c1, c2 = plan.coefficients
    eta = plan.eta
    cfg = batch[0].item.cfg
    dtype = batch[0].state.M.dtype
    xp = torch_namespace()
    params = [entry.item.p for entry in batch]
    grads: list[torch.Tensor] = []
    for entry in batch:
        state, item = entry.state, entry.item
        if state.P is None and state.Q is None:
            grads.append(item.grad if item.grad.dtype == dtype else item.grad.to(dtype))
        else:  # the core's G~ = P^T G Q, set to its structure on a refresh step (the bases come from this G)
            grads.append(prepare_step(state, item.grad, cfg, item.p, entry.refreshed, xp, plan.host_count).g_rot)
    new_v = torch._foreach_mul(seconds, b2)
    scratch = torch._foreach_mul(grads, grads)
    torch._foreach_mul_(scratch, c2)
    torch._foreach_add_(new_v, scratch)  # V_t = b2_t V + (1 - b2_t) G~^2
    new_m = torch._foreach_mul(grads, c1)
    scratch = torch._foreach_mul(moments, b1)
    torch._foreach_add_(new_m, scratch)  # M_t = (1 - b1_t) G~ + b1_t M
    roots = _foreach_root(list(new_v))
    torch._foreach_add_(roots, cfg.eps)
    directions = list(torch._foreach_div(new_m, roots))  # U~ = M_t / (sqrt(V_t) + eps)
    del roots, scratch
    for k, (entry, layout) in enumerate(zip(batch, layouts, strict=True)):
        state = entry.state
        if state.P is not None or state.Q is not None:
            unrotated = _unrotate_as_eager if torch.compiler.is_compiling() else _unrotate
            directions[k] = from_work(unrotated(directions[k], state.P, state.Q, layout.transposed), layout, xp)
    if decays(cfg):
        weights = params if params[0].dtype == dtype else [p.to(dtype) for p in params]
        torch._foreach_add_(directions, torch._foreach_mul(weights, cfg.weight_decay))  # D + lambda W
    torch._foreach_mul_(directions, -eta)  # delta = -eta (D + lambda W)
    if params[0].dtype != dtype:
        directions = [d.to(params[0].dtype) for d in directions]

    def commit() -> None:  # copies between tensors of equal shapes and dtypes, nothing allocated
        torch._foreach_add_(params, directions)
        torch._foreach_copy_(moments, new_m)
        torch._foreach_copy_(seconds, new_v)

    return commit


@torch.library.custom_op("adadiag_ref::foreach_sqrt", mutates_args=())
def _foreach_root(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The library's root of each tensor, correctly rounded (:func:`adadiag_ref._xp.sqrt`): one
    ``torch._foreach_sqrt`` on CUDA (whose root is), NumPy's root per tensor on the CPU (where eager ``torch.sqrt``
    is MKL VML's on x86 builds, one ulp off in some entries; :func:`adadiag_ref._xp.sqrt_each`).

    One custom operation of the dispatcher: a compiled graph keeps it opaque, so a compiled step has an eager one's
    bits on any backend of ``torch.compile`` (Inductor's own loops root correctly too, but ``aot_eager`` would run
    eager ``torch.sqrt``), and an op count sees one operation on every device, as on CUDA."""
    if not xs or xs[0].device.type != "cpu":
        return list(torch._foreach_sqrt(xs))
    return sqrt_each(list(xs), torch_namespace())


@_foreach_root.register_fake
def _(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


def _unrotate(u: torch.Tensor, P: torch.Tensor | None, Q: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """The core's ``P U~ Q^T`` (:func:`~adadiag_ref.optim.rotation.unrotate`) on torch tensors."""
    return unrotate(u, P, Q, torch_namespace(), transposed=transposed)


_unrotate_as_eager = torch.library.custom_op(
    "adadiag_ref::unrotate", _unrotate, mutates_args=(), tags=(torch.Tag.needs_exact_strides,)
)
""":func:`_unrotate` as one opaque operation of a compiled graph, on its operands' eager strides: Inductor may
lay ``U~`` (its own kernel's output) out otherwise, and BLAS then multiplies in another order (last-bit
differences); so a compiled step keeps the bits of an eager one."""
_unrotate_as_eager.register_fake(_unrotate)


def _foreach_traced(plans: list[_ForeachPlan]) -> None:
    """Under ``torch.compile``: the multi-tensor updates :meth:`CoreOptimizer._step_on_host` deferred, then their
    counters advanced; only tensor operations, so Dynamo compiles them into one graph."""
    for plan in plans:
        _foreach_math(plan)
        torch._foreach_add_(plan.counters, 1)


def _bases(state: Any) -> dict[str, torch.Tensor]:
    return {f: getattr(state, f) for f in ("P", "Q") if getattr(state, f) is not None}


def _checked_state(saved: Mapping[str, Any], p: torch.Tensor, cfg: BaseConfig, index: int) -> dict[str, torch.Tensor]:
    """A saved per-parameter state converted to this parameter (dtype, device), or ``ValueError``."""
    expected = from_core_state(_sharded.init(p, cfg) if _sharded.is_sharded(p) else ar.init(p.detach(), cfg))
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
            if not isinstance(number, int | float) or number < 0 or number != int(number):
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
