"""Frozen, hashable hyperparameter configurations.

Every optimizer is described by one frozen dataclass.  Being hashable, a config
can be a static argument under ``jax.jit``; being frozen, it cannot drift between
steps.  Invalid values raise ``ValueError`` at construction, before any state
exists.

The eight public optimizers are three families times a rotation mode
(``sides``): 0 = identity basis (the baseline), 1 = one-sided ``G~ = P^T G``,
2 = two-sided ``G~ = P^T G Q``.

==================  ===========  =====
name                family       sides
==================  ===========  =====
``adamw``           adam         0
``adadiag``         adam         1
``adadiag_pp``      adam         2
``adafactor``       adafactor    0
``adafacdiag``      adafactor    1
``adafacdiag_pp``   adafactor    2
``hfac``            hfac         0
``hfacdiag``        hfac         1
==================  ===========  =====
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NamedTuple

__all__ = [
    "BASIS_METHODS",
    "KERNELS",
    "OPTIMIZERS",
    "STEP_VALUES",
    "AdafactorConfig",
    "AdamConfig",
    "BaseConfig",
    "HfacConfig",
    "OptimizerSpec",
    "check_learning_rate",
    "default_eps",
    "host_number",
    "make_config",
    "step_config",
]

Beta2Schedule = Literal["bias_corrected", "adafactor"]
Kernels = Literal["auto", "numba", "reference"]

KERNELS: tuple[str, ...] = ("auto", "numba", "reference")
"""Values of :attr:`BaseConfig.kernels`: who computes a family's moment update (numba on NumPy, CuPy on CUDA)."""

BASIS_METHODS = ("svd", "gram", "auto")
"""Values of ``basis_method``: the route of a basis refresh (:func:`adadiag_ref.linalg.canonical_svd`)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_clip_threshold(value: Any) -> None:
    _check(value is None or (_finite_number(value) and value > 0), f"clip_threshold must be > 0 or None, got {value!r}")


def _is_traced(value: Any) -> bool:
    """Whether ``value`` is a JAX tracer (a value under ``jax.jit``, unknown until run); JAX not imported here."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(value, jax.core.Tracer)


@functools.cache
def numba_available() -> bool:
    """Whether numba can be imported (found without importing it: configs stay cheap to build)."""
    return importlib.util.find_spec("numba") is not None


_FIXED_MOMENTUM = "_fixed_momentum"
"""Instance attribute of a :func:`step_config` result whose beta_1 is traced: whether ``M`` exists, decided by the
base config (``beta_1 > 0`` of a tracer cannot be decided while tracing)."""


@dataclass(frozen=True)
class BaseConfig:
    """Hyperparameters shared by every family (the paper's symbols in brackets).

    Attributes:
        name: registry name of the optimizer (``adadiag``, ...).
        lr: learning rate [eta].
        betas: moment coefficients [beta_1, beta_2].  ``beta_1 = 0`` turns momentum off.
        eps: smoothing term [epsilon].  Adam family: added after ``sqrt(V)``.
            Adafactor and Hfac families: added to ``G~^2``.
        weight_decay: decoupled weight decay [lambda], ``W <- W - eta (U + lambda W)``.
        update_freq: basis refresh period [T].  The basis is refreshed at step
            ``t = 1`` and whenever ``(t - 1) mod T == 0``; ``None`` means T = infinity
            (refreshed once, at t = 1, then fixed).
        sides: 0 (identity basis), 1 (``P`` only) or 2 (``P`` and ``Q``).
        max_basis_dim: a side longer than this is not rotated (its basis is I).  The
            default 8192 comes from the measured refresh time per side (docs/reliability.md).
        bias_correction: use the paper's beta-hat EMAs (Adam's bias correction).
            ``False`` uses the raw betas (the ODE's semi-implicit Euler form).
        state_dtype: ``"float32"`` or ``"float64"`` to override the default state
            dtype (float64 for float64 parameters, float32 otherwise).
        basis_method: how a refresh computes ``P`` (:data:`BASIS_METHODS`,
            ``docs/performance.md``): ``"svd"``, the reference (the canonical SVD
            of ``G_t``); ``"gram"``, the fast route for float32 (``P`` from the
            eigenvectors of ``G_t G_t^T`` formed in float64, same canonical rules);
            ``"auto"`` (default), the Gram route where it is both faster and
            accurate (float32, one-sided, not JAX), the SVD everywhere else.  Under
            ``"gram"`` and ``"auto"`` an SVD is canonicalised by the numba steps
            (equal to ``"svd"``'s reference loop to rounding; a two-sided refresh
            completes ``Q`` 15-30x faster).  In float64 every method is the SVD,
            so golden runs are exact to their tolerance.
        kernels: who computes the moment update and direction ``U~`` of a step
            on float32/float64 arrays.  ``"reference"``: the generic array-API
            family code (:mod:`adadiag_ref.optim.families`), always.
            ``"numba"``: the fused numba kernels (:mod:`adadiag_ref._kernels`)
            on NumPy arrays, which compute the same formulas in the same order
            and agree with the reference to rounding (tested at ``rtol = 1e-12``
            in float64); needs numba installed (``ValueError`` otherwise); on
            any other backend, CuPy included, the reference.  ``"auto"``
            (default): the fused kernels of the arrays' backend: numba on NumPy
            when numba is importable, the CuPy kernels
            (:mod:`adadiag_ref._kernels.cupy_kernels`, ``cupy.ElementwiseKernel``
            passes, equal to the reference to rounding) on CuPy, else the
            reference.  On float32/float64 CPU torch tensors ``update_in_place``
            (the torch adapter's step) runs the Adam family through the numba
            kernels too (``"auto"`` or ``"numba"``), on NumPy views of the
            tensors and with torch's own ``sqrt``, bit for bit the torch
            reference.  JAX and CUDA torch always take the reference code.  An
            execution choice, not a hyperparameter: golden files do not record it.
        batch_dims: how many leading dimensions of a parameter index independent
            matrices.  A parameter of shape ``(*B, *S)`` with ``len(B) == batch_dims``
            is ``prod(B)`` independent parameters of shape ``S``, each optimized
            exactly as a parameter of shape ``S`` alone (its own bases, moments,
            clipping and parameter scale); the state carries the leading ``B``
            (``P`` of shape ``(*B, m, m)``, moments ``(*B, m, n)``) and a refresh
            decomposes the whole stack at once
            (:func:`~adadiag_ref.linalg.canonical_svd_batch`).  For stacked
            expert weights ``(E, d, f)`` (``batch_dims=1``) and stacked attention
            heads (``docs/embedding.md``).  The default 0 is the unbatched rule
            (an ``(E, d, f)`` tensor is one ``E x (d f)`` matrix, as a conv kernel).
            A parameter with fewer than ``batch_dims`` dimensions raises ``ValueError``.
            The fused kernels (``kernels``) take single matrices: a stack takes
            the reference code, whose statistics are per matrix.
    """

    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    update_freq: int | None = 200
    sides: int = 0
    max_basis_dim: int = 8192
    bias_correction: bool = True
    state_dtype: str | None = None
    basis_method: str = "auto"
    kernels: Kernels = "auto"
    batch_dims: int = 0

    family: str = field(default="adam", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _check(_finite_number(self.lr) and self.lr >= 0, f"lr must be a finite number >= 0, got {self.lr!r}")
        _check(len(self.betas) == 2, f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        b1, b2 = self.betas
        _check(0.0 <= b1 < 1.0, f"beta1 must be in [0, 1), got {b1!r}")
        _check(0.0 <= b2 < 1.0, f"beta2 must be in [0, 1), got {b2!r}")
        # eps > 0: with eps = 0 a zero second moment divides by zero (NaN, or ZeroDivisionError in numba)
        _check(_finite_number(self.eps) and self.eps > 0, f"eps must be a finite number > 0, got {self.eps!r}")
        _check(
            _finite_number(self.weight_decay) and self.weight_decay >= 0,
            f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}",
        )
        _check(
            self.update_freq is None
            or (isinstance(self.update_freq, int) and not isinstance(self.update_freq, bool) and self.update_freq >= 1),
            f"update_freq must be a positive int or None (never refresh after t = 1), got {self.update_freq!r}",
        )
        _check(self.sides in (0, 1, 2), f"sides must be 0, 1 or 2, got {self.sides!r}")
        _check(
            isinstance(self.max_basis_dim, int) and self.max_basis_dim >= 1,
            f"max_basis_dim must be a positive int, got {self.max_basis_dim!r}",
        )
        _check(isinstance(self.bias_correction, bool), "bias_correction must be a bool")
        _check(
            self.state_dtype in (None, "float32", "float64"),
            f"state_dtype must be None, 'float32' or 'float64', got {self.state_dtype!r}",
        )
        _check(
            isinstance(self.basis_method, str) and self.basis_method in BASIS_METHODS,
            f"basis_method must be one of {', '.join(repr(m) for m in BASIS_METHODS)}, got {self.basis_method!r}",
        )
        _check(
            isinstance(self.batch_dims, int) and not isinstance(self.batch_dims, bool) and self.batch_dims >= 0,
            f"batch_dims must be an int >= 0 (leading dimensions that index independent matrices), "
            f"got {self.batch_dims!r}",
        )
        _check(self.kernels in KERNELS, f"kernels must be one of {', '.join(map(repr, KERNELS))}, got {self.kernels!r}")
        _check(
            self.kernels != "numba" or numba_available(),
            'kernels="numba" needs numba, which is not installed: pip install "adadiag-ref[numba]", '
            'or use kernels="auto" (numba when installed) or "reference"',
        )

    @property
    def momentum(self) -> bool:
        """Whether a first moment is kept (beta_1 > 0; with a traced beta_1, the base config's: :func:`step_config`)."""
        fixed = self.__dict__.get(_FIXED_MOMENTUM)
        return bool(self.betas[0] > 0.0) if fixed is None else fixed

    def replace(self, **changes: Any) -> BaseConfig:
        """A copy with ``changes`` applied (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        values.update(changes)
        return type(self)(**values)


@dataclass(frozen=True)
class AdamConfig(BaseConfig):
    """AdamW, AdaDiag (Algorithm 1, one-sided) and AdaDiag++ (two-sided)."""

    family: str = field(default="adam", init=False)


@dataclass(frozen=True)
class AdafactorConfig(BaseConfig):
    """Adafactor and AdafacDiag (Algorithm "AdafacDiag"), with or without momentum.

    Extra attributes:
        clip_threshold: ``d`` in ``clip(U) = U / max(1, RMS(U) / d)``; ``None`` disables clipping.
        beta2_schedule: ``"bias_corrected"`` (the paper: beta-hat of ``betas[1]``) or
            ``"adafactor"`` (the original ``beta2_t = 1 - t^(-decay_rate)``).
        decay_rate: exponent of the ``"adafactor"`` schedule (0.8).
        relative_step: step size ``rho_t = min(lr, 1 / sqrt(t))`` instead of ``lr``.
        scale_parameter: multiply the step size by ``max(eps2, RMS(W_t))``.
        eps2: floor of the parameter scale (1e-3).
        momentum_enabled: ``None`` follows ``betas[0] > 0``; ``False`` forces it off.
    """

    eps: float = 1e-30
    clip_threshold: float | None = 1.0
    beta2_schedule: Beta2Schedule = "bias_corrected"
    decay_rate: float = 0.8
    relative_step: bool = False
    scale_parameter: bool = False
    eps2: float = 1e-3
    momentum_enabled: bool | None = None
    family: str = field(default="adafactor", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_clip_threshold(self.clip_threshold)
        _check(
            self.beta2_schedule in ("bias_corrected", "adafactor"),
            f"beta2_schedule must be 'bias_corrected' or 'adafactor', got {self.beta2_schedule!r}",
        )
        _check(
            _finite_number(self.decay_rate) and self.decay_rate > 0, f"decay_rate must be > 0, got {self.decay_rate!r}"
        )
        _check(_finite_number(self.eps2) and self.eps2 >= 0, f"eps2 must be >= 0, got {self.eps2!r}")
        _check(
            not (self.momentum_enabled is True and self.betas[0] == 0.0),
            "momentum=True needs beta1 > 0",
        )

    @property
    def momentum(self) -> bool:
        """Whether the first moment ``M`` is kept (with a traced beta_1, the base config's: :func:`step_config`)."""
        if self.momentum_enabled is False and self.__dict__.get(_FIXED_MOMENTUM) is None:
            return False
        return super().momentum


@dataclass(frozen=True)
class HfacConfig(BaseConfig):
    """Hfac and HfacDiag (Algorithm "HfacDiag").

    Extra attributes:
        clip_threshold: ``d`` of the clipped normalised-gradient term; ``None`` disables clipping.
    """

    eps: float = 1e-30
    clip_threshold: float | None = 1.0
    family: str = field(default="hfac", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_clip_threshold(self.clip_threshold)


class OptimizerSpec(NamedTuple):
    """One optimizer of the registry: a family's config type with a number of rotated sides.

    Attributes:
        config_type: the family's config class (its ``family`` field names the family).
        sides: 0 (the baseline, identity basis), 1 (``G~ = P^T G``) or 2 (``G~ = P^T G Q``).
        class_name: the torch adapter's class name (``AdaDiagPP`` for ``adadiag_pp``).
        summary: one line on what it is, in the paper's symbols (the adapters' docstrings).
    """

    config_type: type[BaseConfig]
    sides: int
    class_name: str
    summary: str = ""


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(AdamConfig, 0, "AdamW", "AdamW (identity basis), the baseline of AdaDiag."),
    "adadiag": OptimizerSpec(
        AdamConfig,
        1,
        "AdaDiag",
        "AdaDiag (Algorithm 1): Adam moments in the one-sided eigenbasis, ``G~ = P^T G``.",
    ),
    "adadiag_pp": OptimizerSpec(
        AdamConfig,
        2,
        "AdaDiagPP",
        "AdaDiag++: Adam moments in the two-sided basis, ``G~ = P^T G Q``.",
    ),
    "adafactor": OptimizerSpec(
        AdafactorConfig,
        0,
        "Adafactor",
        "Adafactor: factored second moment ``V = r s^T / (1^T r)`` (identity basis).",
    ),
    "adafacdiag": OptimizerSpec(
        AdafactorConfig,
        1,
        "AdafacDiag",
        "AdafacDiag: Adafactor in the one-sided basis ``G~ = P^T G``.",
    ),
    "adafacdiag_pp": OptimizerSpec(
        AdafactorConfig,
        2,
        "AdafacDiagPP",
        "AdafacDiag++: Adafactor in the two-sided basis ``G~ = P^T G Q``.",
    ),
    "hfac": OptimizerSpec(HfacConfig, 0, "Hfac", "Hfac: factored first and second moments (identity basis)."),
    "hfacdiag": OptimizerSpec(HfacConfig, 1, "HfacDiag", "HfacDiag: Hfac in the one-sided basis ``G~ = P^T G``."),
}
"""The optimizer registry, by name: the library's eight, then any added by
:func:`adadiag_ref.optim.families.register_family` (which adds the family's entry beside it)."""


def default_eps(name: str) -> float:
    """The paper's smoothing term for ``name``: 1e-8 (Adam family), 1e-30 (factored families)."""
    cls, _ = _lookup(name)
    return float(next(f.default for f in fields(cls) if f.name == "eps"))  # type: ignore[arg-type]


def _lookup(name: str) -> tuple[type[BaseConfig], int]:
    try:
        entry = OPTIMIZERS[name]
        return entry.config_type, entry.sides
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}") from None


def make_config(name: str, **options: Any) -> BaseConfig:
    """Build the validated config of optimizer ``name``.

    ``momentum=`` is accepted as an alias of ``momentum_enabled=`` for the
    Adafactor family; ``eps=None`` selects the family default.
    """
    cls, sides = _lookup(name)
    if "momentum" in options:
        if not issubclass(cls, AdafactorConfig):
            raise ValueError(f"'momentum' is an option of the Adafactor family only, not of {name!r}")
        options["momentum_enabled"] = options.pop("momentum")
    if options.get("eps", 0.0) is None:
        options.pop("eps")
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    allowed = {f.name for f in fields(cls) if f.init} - {"name", "sides"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown option(s) for {name!r}: {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return cls(name=name, sides=sides, **options)


STEP_VALUES = frozenset({"lr", "betas", "eps", "weight_decay", "clip_threshold", "decay_rate", "eps2"})
"""The numeric hyperparameters one step may override (:func:`step_config`); every other field shapes the state
(``sides``, ``betas``' momentum, ``batch_dims``, ...) or chooses the code (``kernels``, ``basis_method``)."""


def host_number(value: Any) -> float | None:
    """``value`` as a Python number when it is known on the host without a wait, else ``None``.

    A Python number is itself; a NumPy scalar or 0-d array its ``item()``; a 0-d CPU array of torch or JAX
    (not traced) its value.  A traced value (``jax.jit``, ``torch.compile``), or an array on a device (CUDA),
    gives ``None``: reading it would stop the trace or wait on the device.  An array of more than one entry
    raises ``ValueError`` (a hyperparameter is a scalar).
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return value
    shape = getattr(value, "shape", None)
    if shape is None or _is_traced(value):
        return None
    if len(shape) != 0:
        raise ValueError(f"a hyperparameter must be a scalar, got an array of shape {tuple(shape)}")
    module = type(value).__module__
    if module.startswith("numpy"):
        return value.item()  # type: ignore[no-any-return]
    if module.startswith("torch"):
        import torch

        if value.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        return value.item()  # type: ignore[no-any-return]
    if module.startswith("jax"):
        devices = value.devices()
        return value.item() if all(d.platform == "cpu" for d in devices) else None  # type: ignore[no-any-return]
    return None


def check_learning_rate(lr: Any) -> None:
    """``ValueError`` unless a per-step ``lr`` known on the host (:func:`host_number`) is a finite number >= 0,
    the rule of ``make_config``; an ``lr`` that is not (traced, on a device) is taken as it is."""
    value = host_number(lr)
    if value is not None:
        _check(_finite_number(value) and value >= 0, f"lr must be a finite number >= 0, got {lr!r}")


@functools.lru_cache(maxsize=256)
def _replaced(cfg: BaseConfig, changes: tuple[tuple[str, Any], ...]) -> BaseConfig:
    """``cfg.replace(**changes)``, validated by ``__post_init__`` (kept: a schedule repeats its values)."""
    return cfg.replace(**dict(changes))


def step_config(
    cfg: BaseConfig, *, momentum: bool | None = None, cast: Callable[[Any], Any] | None = None, **values: Any
) -> BaseConfig:
    """The config one step runs with: ``cfg`` with the per-step hyperparameters ``values`` (``None``: keep).

    ``step_config(cfg, weight_decay=lambda_t, betas=(beta_1, beta_2))`` is what ``step``, ``update``,
    ``multi_step`` and ``Engine.step`` use for their ``weight_decay=`` and ``betas=`` keywords, and the optax
    adapter for ``optax.inject_hyperparams``.  Only the numeric hyperparameters of :data:`STEP_VALUES`
    (``lr``, ``betas``, ``eps``, ``weight_decay``, ``clip_threshold``, ``decay_rate``, ``eps2``) may change.

    * A value known on the host (:func:`host_number`: a Python number, a NumPy value, a CPU array) is
      validated by :func:`make_config`'s rules (``ValueError``, naming it) and stored as a Python number: the
      result equals ``cfg.replace(...)`` with it, so a step computes the same bits as with a rebuilt config.
    * Any other value (a JAX tracer under ``jax.jit``, an array on a device) cannot be read without stopping
      the trace or waiting on the device: it is stored unvalidated (its producer's to check), through ``cast``
      when given (the core casts to the state dtype, so that a float64 value does not promote a float32 step).
      The result is then not hashable: not a static argument.
    * ``betas`` may not turn the first moment on or off (``beta_1 = 0`` against ``beta_1 > 0``): the state's
      fields were made by the config (``ValueError``).  With a traced ``beta_1`` the first moment is ``momentum``
      (default: ``cfg.momentum``).

    Returns ``cfg`` itself when nothing changes.
    """
    values = {k: v for k, v in values.items() if v is not None}
    unknown = sorted(set(values) - STEP_VALUES)
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)} cannot change per step (it shapes the state or chooses the code); the per-step "
            f"hyperparameters are {', '.join(sorted(STEP_VALUES))}"
        )
    if not values:
        return cfg
    concrete: dict[str, Any] = {}
    traced: dict[str, Any] = {}
    for key, value in values.items():
        if key == "betas":
            betas = tuple(value)
            _check(len(betas) == 2, f"betas must be a pair (beta1, beta2), got {value!r}")
            read = tuple(host_number(b) for b in betas)
            if all(b is not None for b in read):
                concrete[key] = read
            else:  # both cast: a traced pair computes as arrays throughout, as one whose two betas are traced
                for index, b in enumerate(read):
                    _check(b is None or 0.0 <= b < 1.0, f"beta{index + 1} must be in [0, 1), got {b!r}")
                traced[key] = betas if cast is None else tuple(cast(b) for b in betas)
        else:
            number = host_number(value)
            if number is None:
                traced[key] = value if cast is None else cast(value)
            else:
                concrete[key] = number
    try:
        new = _replaced(cfg, tuple(sorted(concrete.items()))) if concrete else cfg
    except TypeError:  # an unhashable config (itself a step's, with traced values): validate without the cache
        new = cfg.replace(**concrete)
    if "betas" in concrete and new.momentum != cfg.momentum:
        raise ValueError(
            f"betas={concrete['betas']!r} would turn the first moment {'on' if new.momentum else 'off'}: the "
            f"state of {cfg.name!r} was made {'with' if cfg.momentum else 'without'} it; keep beta1 "
            f"{'> 0' if cfg.momentum else '= 0'} per step"
        )
    if not traced:
        return new
    new = copy.copy(new)  # the one place a config takes unvalidated (traced) values: this function
    if "betas" in traced:
        object.__setattr__(new, _FIXED_MOMENTUM, cfg.momentum if momentum is None else bool(momentum))
    for key, value in traced.items():
        object.__setattr__(new, key, value)
    return new
