"""Optimizer-state memory, computed from the library's own state layout.

:func:`state_nbytes` calls :func:`adadiag_ref.init` on *shape-only stand-ins*
(a tiny namespace whose arrays carry a shape and nothing else), so the count is
exactly what ``init`` would allocate, for any parameter set, without allocating
it.  :data:`LLAMA_CONFIGS` and :func:`llama_parameters` give the parameter
shapes of the LLaMA models of the paper's memory table, and
:func:`paper_memory_table` reproduces that table
("Memory requirements for different optimizers", BF16).

The parameter-handling rule that reproduces the paper (``rule="paper"``):

* only the matrices of the transformer blocks (attention q, k, v, o and MLP
  gate, up, down) are handled by the named optimizer, in the library's work
  frame (``m <= n``; ``P`` is ``m x m``, ``Q`` is ``n x n``, factored moments
  are ``m + n`` vectors);
* the embedding and the LM head are trained by the family's unfactored,
  unrotated baseline: a full second moment ``V``, plus a full first moment
  ``M`` when the optimizer keeps momentum (the Adam-family state of ``adamw``,
  without ``M`` when there is no momentum);
* the RMSNorm weights (vectors) are not counted: the table is about "weight
  parameters of size m x n".  Counting them moves one cell (AdafacDiag w/
  momentum, 130M) from 0.454998 G to 0.455073 G, i.e. across the rounding
  boundary to 0.46;
* only moment estimates and bases are counted (not the step counter), at
  2 bytes per element for bf16;
* the paper's "G" is 1.024e9 bytes (1000 x 1024 x 1000): with 1e9 or 2^30
  every column is off by 2.4 % / 7 %, with 1.024e9 every library row matches
  to the paper's two decimals.

``rule="all"`` instead counts every parameter through the library's layout
(the embedding then gets its own ``P``; ``max_basis_dim`` keeps a
vocabulary-sized ``Q`` from being formed).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .config import BaseConfig, make_config
from .optim import init
from .optim.core import SlowRefreshWarning

__all__ = [
    "LLAMA_CONFIGS",
    "PAPER_GB",
    "PAPER_MEMORY_TABLE",
    "PAPER_ROWS",
    "LlamaConfig",
    "ParamSpec",
    "dtype_nbytes",
    "llama_parameters",
    "paper_memory_table",
    "state_nbytes",
]

PAPER_GB = 1.024e9
"""The unit "G" of the paper's memory table, in bytes (see the module docstring)."""


class ParamSpec(NamedTuple):
    """A parameter by name, shape and role (``block``, ``embedding``, ``head`` or ``norm``)."""

    name: str
    shape: tuple[int, ...]
    role: str = "block"


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int = 32000


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "llama-60m": LlamaConfig(512, 1376, 8, 8),
    "llama-130m": LlamaConfig(768, 2048, 12, 12),
    "llama-350m": LlamaConfig(1024, 2736, 24, 16),
    "llama-1.3b": LlamaConfig(2048, 5461, 24, 32),
}

_DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4, "fp64": 8, "float64": 8}


def dtype_nbytes(dtype: str) -> int:
    """Bytes per element of a dtype name (``bf16``, ``fp32``, ...)."""
    try:
        return _DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPE_BYTES)}") from None


def llama_parameters(model: str | LlamaConfig) -> list[ParamSpec]:
    """Parameters of a LLaMA model in PyTorch's ``(out, in)`` convention (untied embedding and head)."""
    c = LLAMA_CONFIGS[model] if isinstance(model, str) else model
    h, i = c.hidden, c.intermediate
    params = [ParamSpec("embed_tokens", (c.vocab, h), "embedding")]
    for layer in range(c.layers):
        p = f"layers.{layer}."
        params += [ParamSpec(p + f"self_attn.{x}_proj", (h, h)) for x in "qkvo"]
        params += [ParamSpec(p + "mlp.gate_proj", (i, h)), ParamSpec(p + "mlp.up_proj", (i, h))]
        params += [ParamSpec(p + "mlp.down_proj", (h, i))]
        params += [ParamSpec(p + "input_layernorm", (h,), "norm")]
        params += [ParamSpec(p + "post_attention_layernorm", (h,), "norm")]
    params += [ParamSpec("norm", (h,), "norm"), ParamSpec("lm_head", (c.vocab, h), "head")]
    return params


# ----------------------------------------------------------------------------- shape-only stand-ins


class _Shape:
    """A stand-in array: a shape, a dtype name and a device; no data."""

    def __init__(self, shape: tuple[int, ...], dtype: Any = "float32") -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.device = "shape-only"
        self.ndim = len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __add__(self, other: _Shape) -> _Shape:
        """The broadcast sum's shape (``init`` stacks identity bases as ``I + zeros((*B, k, k))``)."""
        return _Shape(tuple(int(d) for d in np.broadcast_shapes(self.shape, other.shape)), self.dtype)


class _ShapeNamespace:
    """Just enough of the array API for :func:`adadiag_ref.init` to lay out a state."""

    float64, float32, float16, int32 = "float64", "float32", "float16", "int32"

    def zeros(self, shape: Any, dtype: Any = None, device: Any = None) -> _Shape:
        return _Shape(shape if isinstance(shape, tuple) else (shape,), dtype)

    def eye(self, n: int, dtype: Any = None, device: Any = None) -> _Shape:
        return _Shape((n, n), dtype)

    def matrix_transpose(self, x: _Shape) -> _Shape:
        return _Shape((*x.shape[:-2], x.shape[-1], x.shape[-2]), x.dtype)


_SHAPE_XP = _ShapeNamespace()


def _state_elements(shape: tuple[int, ...], cfg: BaseConfig) -> int:
    """Elements of every array of ``init``'s state except the step counter."""
    with warnings.catch_warnings():  # counting, not training: no refresh will run
        warnings.simplefilter("ignore", SlowRefreshWarning)
        state = init(_Shape(shape), cfg, xp=_SHAPE_XP)
    return sum(getattr(state, f).size for f in state._fields if f != "count" and getattr(state, f) is not None)


def _baseline_elements(shape: tuple[int, ...], cfg: BaseConfig) -> int:
    """The unfactored, unrotated baseline: ``V`` (adamw's layout), plus ``M`` when ``cfg`` keeps momentum."""
    state: Any = init(_Shape(shape), make_config("adamw", max_basis_dim=cfg.max_basis_dim), xp=_SHAPE_XP)
    return int(state.V.size + (state.M.size if cfg.momentum else 0))


def _as_specs(params: Any) -> list[ParamSpec]:
    if isinstance(params, str | LlamaConfig):
        return llama_parameters(params)
    if isinstance(params, Mapping):
        return [ParamSpec(str(k), tuple(getattr(v, "shape", v) or ())) for k, v in params.items()]
    return [
        p if isinstance(p, ParamSpec) else ParamSpec(f"param{k}", tuple(getattr(p, "shape", p)))
        for k, p in enumerate(params if isinstance(params, Iterable) else [params])
    ]


def state_nbytes(
    params: Any,
    cfg: BaseConfig | str,
    *,
    dtype: str = "bf16",
    rule: str = "paper",
    **options: Any,
) -> int:
    """Bytes of optimizer state (moments and bases) for a parameter set.

    Args:
        params: a model name (``"llama-60m"``, ...), a list of shapes, arrays or
            :class:`ParamSpec`, or a mapping name -> shape/array.  Plain shapes
            and arrays count as transformer-block matrices.
        cfg: a config, or an optimizer name (then ``options`` go to
            :func:`~adadiag_ref.make_config`, e.g. ``momentum=False``).
        dtype: element type of the stored state (``bf16`` as in the paper, ``fp32``...).
        rule: ``"paper"`` (embedding and head use the unfactored, unrotated
            baseline, norm vectors are not counted; see the module docstring) or ``"all"`` (every parameter
            through the library's own layout, exactly what ``init`` allocates).
    """
    if isinstance(cfg, str):
        cfg = make_config(cfg, **options)
    elif options:
        cfg = cfg.replace(**options)
    if rule not in ("paper", "all"):
        raise ValueError(f"rule must be 'paper' or 'all', got {rule!r}")
    elements = 0
    for spec in _as_specs(params):
        if rule == "all" or spec.role == "block":
            elements += _state_elements(spec.shape, cfg)
        elif spec.role != "norm":  # rule "paper": norm vectors are not counted, the rest takes the baseline
            elements += _baseline_elements(spec.shape, cfg)
    return elements * dtype_nbytes(dtype)


# ----------------------------------------------------------------------------- the paper's table

PAPER_ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "Adam": ("adamw", {}),
    "AdaDiag": ("adadiag", {}),
    "AdaDiag++": ("adadiag_pp", {}),
    "Adafactor w/ momentum": ("adafactor", {}),
    "Adafactor w/o momentum": ("adafactor", {"momentum": False}),
    "AdafacDiag w/ momentum": ("adafacdiag", {}),
    "AdafacDiag w/o momentum": ("adafacdiag", {"momentum": False}),
    "Hfac": ("hfac", {}),
    "HfacDiag": ("hfacdiag", {}),
}
"""Rows of the paper's table that are optimizers of this library: label -> (name, options)."""

PAPER_MEMORY_TABLE: dict[str, tuple[float, float, float, float]] = {
    "Adam": (0.23, 0.52, 1.44, 5.23),
    "AdaDiag": (0.26, 0.62, 1.78, 6.61),
    "AdaDiag++": (0.36, 0.97, 3.03, 11.59),
    "Adafactor w/ momentum": (0.18, 0.36, 0.85, 2.87),
    "Adafactor w/o momentum": (0.06, 0.10, 0.13, 0.26),
    "AdafacDiag w/ momentum": (0.21, 0.45, 1.19, 4.25),
    "AdafacDiag w/o momentum": (0.09, 0.19, 0.47, 1.63),
    "Hfac": (0.13, 0.19, 0.26, 0.52),
    "HfacDiag": (0.16, 0.29, 0.60, 1.89),
    "GaLore rank-r=m/4": (0.13, 0.28, 0.54, 1.78),
}
"""The paper's numbers (G), columns LLaMA 60M, 130M, 350M, 1.3B; for comparison only."""


def paper_memory_table(
    models: Iterable[str] = tuple(LLAMA_CONFIGS), *, dtype: str = "bf16", rule: str = "paper"
) -> dict[str, dict[str, int]]:
    """Reproduced table: row label -> model -> bytes (divide by :data:`PAPER_GB` for the paper's G)."""
    models = list(models)
    return {
        label: {model: state_nbytes(model, name, dtype=dtype, rule=rule, **opts) for model in models}
        for label, (name, opts) in PAPER_ROWS.items()
    }
