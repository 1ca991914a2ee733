r"""The one registry of optimizer families: what the core, its fast routes, the adapters, the report and the ODE read.

A family is the moment rule shared by a baseline and its rotated forms (Adam -> AdamW, AdaDiag, AdaDiag++).
Its entry, a :class:`FamilySpec`, says everything the rest of the library needs to know about it:

* the state: the NamedTuple type and, for an ``m x n`` work frame, the shape of every moment field
  (:attr:`FamilySpec.moment_shapes`; ``None`` for a field absent under that config); ``init`` makes them zero;
* the reference discrete form: ``direction(S_{t-1}, G~, t, cfg, xp) -> (U~, moments)`` (array-API code, the
  paper's equations) and ``step_size(cfg, t, W_t, eta, xp) -> eta_t``;
* the continuous-time form (a :class:`~.common.Flow`, or ``None``): vector field, ``H``, ``dH/dt``;
* the fast routes (:class:`Routes`), each a tuple of candidates tried in order: a candidate returns ``None``
  when it does not apply (another backend, dtype or layout, ``kernels="reference"``), and a family without a
  route of some kind simply takes the reference for it;
* presentation: the report's learning rate.

An *optimizer* is a family with a number of rotated sides (0 = the baseline, 1 = ``G~ = P^T G``, 2 =
``G~ = P^T G Q``); its entry is :class:`~adadiag_ref.config.OptimizerSpec` in
:data:`adadiag_ref.config.OPTIMIZERS` (name, family's config type, sides, class name).  The torch classes, the
optax aliases, ``reproduce``'s table, the report's rows and the ODE systems are generated from these two tables.

:func:`register_family` adds a family and its optimizers from outside the package (``docs/extending.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ...config import OPTIMIZERS, BaseConfig, OptimizerSpec
from .common import Flow, Moments, constant_step_size

__all__ = ["FAMILIES", "FamilySpec", "GroupKernels", "Routes", "family_of", "flows", "register_family"]

DirectionRoute = Callable[[Any, Any, Any, BaseConfig, Any], "tuple[Any, Moments] | None"]
"""``(state, G~, t, cfg, xp) -> (U~, moments)``, or ``None`` when the route does not apply."""


class Routes(NamedTuple):
    """A family's fast routes, by entry point; each a tuple of candidates tried in order, first applicable wins.
    Only the engine (:class:`~adadiag_ref.Engine`) runs them: the reference (``init``, ``update``, ``step``) never
    does.

    Every route computes what the reference computes (the same formulas in the same order, so the same bits or,
    for the direction kernels, the same values to rounding), and says ``None`` when it does not apply.

    Attributes:
        direction: ``(state, G~, t, cfg, xp) -> (U~, moments) | None``: the family's direction.
        update: ``(state, layout, t, G~, W, cfg, eta, unrotate, xp) -> (delta, moments) | None``: the whole
            update of one unrotated matrix (or a flat group as a ``1 x N`` row) in the work frame.
        group: ``(cfg, dtype, sizes, device, xp) -> GroupKernels | None``: the engine's multi-tensor step of a
            flat group without rotation (:class:`GroupKernels`), chosen once when the engine is built; ``None`` when the
            family has no such kernels for the backend and dtype.
    """

    direction: tuple[DirectionRoute, ...] = ()
    update: tuple[Callable[..., Any], ...] = ()
    group: tuple[Callable[..., Any], ...] = ()


class GroupKernels(Protocol):
    r"""The step of a whole flat group without rotation (every member unrotated: AdamW, vectors), in place, over
    the members' own arrays: ``M_t = b1 M + (1 - b1) G``, ``V_t = b2 V + (1 - b2) G^2`` (the family's moments,
    in the group's flat arrays) and ``W <- W_t - eta (U + lambda W_t)`` written into each member's parameter,
    with launches independent of the number of members and no gather of ``G`` or ``W`` (the kernels walk the
    members' memory by address).  Made once per group by a :attr:`Routes.group` factory; per step
    :meth:`prepare`, then :meth:`nonfinite` (with the check) and :meth:`step` on what it returned.  A rotated
    group (its gradients gathered for the batched GEMMs) takes :meth:`tail` only: its parameters are not gathered
    and not written back.

    Attributes:
        name: the kernels of the whole step, in words (:meth:`~adadiag_ref.optim.engine.Engine.routes`).
        tail_name: the kernel of a rotated group's tail, in words.
        moments_name: the kernel of :meth:`moments`, in words.
    """

    name: str
    tail_name: str
    moments_name: str

    def prepare(self, params: Sequence[Any] | None, grads: Sequence[Any] | None, eta: Any, cfg: Any) -> Any:
        """This step's members (their addresses) under the step's learning rate ``eta`` and config ``cfg`` (the
        engine's, or a step's :func:`~adadiag_ref.config.step_config` of it: its own betas and weight decay), or
        ``None`` when it cannot run here: an array the kernels cannot walk by address (not dense, or not in the
        memory order of the flat moments), or an ``eta`` or ``cfg`` they do not take (not host numbers).  ``None``
        sends the step to the gathering path.
        ``grads=None``: the parameters only, for :meth:`tail`; ``params=None``: the gradients only, for
        :meth:`nonfinite`."""
        ...

    def nonfinite(self, prepared: Any) -> Any:
        """The number of NaN or Inf entries of the prepared gradients together: a host int, or a 0-d device
        integer array (nothing read back)."""
        ...

    def step(self, prepared: Any, moments: Mapping[str, Any], t: Any, proceed: Any = None) -> None:
        """Write step ``t`` into the prepared parameters and ``moments`` (the flat group's arrays).  ``proceed``:
        ``None``, or a 0-d device boolean; where it is false the kernels write nothing (the engine's finiteness
        verdict, read back afterwards)."""
        ...

    def tail(self, prepared: Any, direction: Any, proceed: Any = None) -> None:
        """The tail of a rotated group, in place: ``W <- W + (-eta)(D + lambda W)`` in each prepared parameter,
        ``D = P U~ Q^T`` the group's flat direction (the members' spans one after another, each in its
        parameter's memory order); ``proceed`` as in :meth:`step`."""
        ...

    def moments(self, prepared: Any, moments: Mapping[str, Any], g_rot: Any, t: Any, proceed: Any = None) -> bool:
        """A rotated group's moments of step ``t`` under the config of ``prepared`` (:meth:`prepare`'s, for the
        tail), in place: ``M <- M_t``, ``V <- V_t`` in the flat ``moments`` and ``U~`` written over the flat ``G~``
        (``g_rot``, the engine's own array); ``proceed`` as in
        :meth:`step` (where it is false nothing is written, and the engine's tail kernel, gated alike, writes
        nothing either).  ``True`` when launched or written, ``False`` having written nothing (the engine then
        computes them into new arrays)."""
        ...


@dataclass(frozen=True)
class FamilySpec:
    """One family's registry entry (module docstring).

    Attributes:
        name: the family's name, ``cfg.family`` of its configs.
        config_type: its frozen config class (a :class:`~adadiag_ref.config.BaseConfig` whose ``family`` is
            ``name``).
        state_type: its state, a NamedTuple ``(count, P, Q, *moments, param_shape)``.
        moment_shapes: ``(cfg, m, n) -> {field: shape or None}`` for every moment field of ``state_type``, in
            its order: the shapes ``init`` creates (zeros) and every step checks.
        direction: the reference ``U~, moments = direction(S_{t-1}, G~, t, cfg, xp)``.
        step_size: ``eta_t = step_size(cfg, t, W_t, eta, xp)`` (default: ``eta_t = eta``).
        flow: the continuous-time form, or ``None`` (then no ODE system is made for it).
        routes: the fast routes (:class:`Routes`).
        report_lr: the learning rate ``adadiag-ref report`` runs it with.
        entrywise: the moment update and the direction are entrywise (entry ``(i, j)`` of ``U~`` and of every
            new moment depends on entry ``(i, j)`` of ``G~`` and of the old moments alone) and ``step_size``
            does not read ``W_t``: then the engine (:class:`~adadiag_ref.optim.engine.Engine`, and
            :func:`~adadiag_ref.multi_step` through it) runs them once over a flat group of many parameters (the
            Adam family; not Adafactor or Hfac, whose factored moments sum rows and columns).
    """

    name: str
    config_type: type[BaseConfig]
    state_type: type
    moment_shapes: Callable[[BaseConfig, int, int], dict[str, tuple[int, ...] | None]]
    direction: Callable[..., tuple[Any, Moments]]
    step_size: Callable[..., Any] = constant_step_size
    flow: Flow | None = None
    routes: Routes = field(default_factory=Routes)
    report_lr: float = 1e-2
    entrywise: bool = False

    @property
    def moment_fields(self) -> tuple[str, ...]:
        """The moment fields of the state, in order (every field but ``count``, ``P``, ``Q``, ``param_shape``)."""
        fields: tuple[str, ...] = self.state_type._fields  # type: ignore[attr-defined]
        return tuple(f for f in fields if f not in ("count", "P", "Q", "param_shape"))


FAMILIES: dict[str, FamilySpec] = {}
"""Every registered family, by name (the library's own three are registered when the package is imported)."""


def family_of(cfg: BaseConfig) -> FamilySpec:
    """The registry entry of ``cfg``'s family; ``ValueError`` naming the registered ones when there is none."""
    try:
        return FAMILIES[cfg.family]
    except KeyError:
        raise ValueError(
            f"no family {cfg.family!r} is registered (registered: {', '.join(FAMILIES)}); see register_family"
        ) from None


def flows() -> dict[str, Flow]:
    """The continuous-time forms of the registered families that have one, by family name."""
    return {name: spec.flow for name, spec in FAMILIES.items() if spec.flow is not None}


def _check_spec(spec: FamilySpec, optimizers: Mapping[str, OptimizerSpec]) -> None:
    """Refuse an entry the core could not run, before anything is registered."""
    if not isinstance(spec, FamilySpec):
        raise TypeError(f"register_family needs a FamilySpec, got {type(spec).__name__}")
    family = getattr(spec.config_type, "__dataclass_fields__", {}).get("family")
    if family is None or not issubclass(spec.config_type, BaseConfig):
        raise TypeError(f"config_type of family {spec.name!r} must be a BaseConfig dataclass")
    if family.default != spec.name:
        raise ValueError(
            f"config_type {spec.config_type.__name__}.family is {family.default!r}, not the family's name "
            f"{spec.name!r}: declare family: str = field(default=NAME, init=False)"
        )
    fields = tuple(getattr(spec.state_type, "_fields", ()))
    if fields[:3] != ("count", "P", "Q") or fields[-1] != "param_shape":
        raise ValueError(
            f"state_type of family {spec.name!r} must be a NamedTuple (count, P, Q, *moments, param_shape), "
            f"got fields {fields}"
        )
    shapes = spec.moment_shapes(spec.config_type(), 2, 3)
    if tuple(shapes) != spec.moment_fields:
        raise ValueError(
            f"moment_shapes of family {spec.name!r} gives fields {tuple(shapes)}, but its state has "
            f"{spec.moment_fields} (same fields, same order)"
        )
    if spec.flow is not None and not isinstance(spec.flow, Flow):
        raise TypeError(f"flow of family {spec.name!r} must be a Flow or None")
    for name, entry in optimizers.items():
        if not isinstance(entry, OptimizerSpec) or entry.config_type is not spec.config_type:
            raise ValueError(f"optimizer {name!r} must be an OptimizerSpec of config_type {spec.config_type.__name__}")
        if entry.sides not in (0, 1, 2):
            raise ValueError(f"optimizer {name!r}: sides must be 0, 1 or 2, got {entry.sides!r}")
        if not name.isidentifier() or not entry.class_name.isidentifier():
            raise ValueError(f"optimizer {name!r} and its class name {entry.class_name!r} must be identifiers")


def _check_class_names(optimizers: Mapping[str, OptimizerSpec]) -> None:
    """Refuse a class name that two optimizers would share: the torch adapter's module attribute of that name
    (``pytorch.AdamW``) would then build whichever was registered last before the adapter was imported."""
    owners = {entry.class_name: name for name, entry in OPTIMIZERS.items() if name not in optimizers}
    for name, entry in optimizers.items():
        other = owners.setdefault(entry.class_name, name)
        if other != name:
            raise ValueError(
                f"optimizer {name!r}: class name {entry.class_name!r} is already the class of optimizer {other!r} "
                "(the torch adapter names one class per optimizer); choose another class_name"
            )


def register_family(spec: FamilySpec, optimizers: Mapping[str, OptimizerSpec], *, replace: bool = False) -> None:
    """Add a family and its optimizers to the registry, from inside the package or outside it.

    After the call, ``make_config(name)`` builds each optimizer's config, and ``init``, ``step``, ``update``,
    ``update_in_place``, ``replay``, ``memory.state_nbytes``, the torch adapter (``CoreOptimizer(params, name)``,
    ``pytorch.optimizer_class(name)``), the optax adapter (``optax.alias(name)``, ``optax.scale_by(name)``) and,
    with a ``flow``, the ODE (``make_system(name)``) run it; a fast route it lacks is the reference.
    ``replace=True`` overwrites an entry of the same name (for a notebook that redefines a family); otherwise a
    name already taken raises ``ValueError``, and so does a ``class_name`` that another optimizer has (also with
    ``replace=True``: it replaces an entry, not another optimizer's torch class).  Checked before anything is
    written: a refused call registers nothing.
    """
    _check_spec(spec, optimizers)
    _check_class_names(optimizers)
    if not replace:
        taken = sorted({spec.name} & set(FAMILIES)) + sorted(set(optimizers) & set(OPTIMIZERS))
        if taken:
            raise ValueError(f"already registered: {', '.join(taken)} (pass replace=True to redefine)")
    FAMILIES[spec.name] = spec
    OPTIMIZERS.update(optimizers)
