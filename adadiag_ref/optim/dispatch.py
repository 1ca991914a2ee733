"""Which code computes a family's direction: the reference family function or its numba kernel.

The reference is the family's ``direction`` (:mod:`adadiag_ref.optim.families`),
generic array-API code.  On float32/float64 NumPy arrays the numba kernels of
:mod:`adadiag_ref._kernels` compute the same formulas, in the same order, in one
or two fused passes; they agree with the reference to rounding (only the
positive sums ``sum(G~^2 + eps)`` and ``sum(U^2)`` are accumulated sequentially
instead of pairwise; tested at ``rtol = 1e-12`` in float64 against the reference
selected through the same config option, ``tests/test_kernels.py``).

The choice is the config's :attr:`~adadiag_ref.config.BaseConfig.kernels`
(``"auto"``, ``"numba"`` or ``"reference"``), never the environment: two
configs that compare equal run the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _kernels
from .._xp import Array, Namespace
from ..config import AdafactorConfig, BaseConfig, HfacConfig
from .families import FAMILIES, Moments, State
from .families.adafactor import second_moment_decay
from .schedules import beta_hat

__all__ = ["KERNEL_DIRECTIONS", "direction", "uses_kernels"]


def uses_kernels(cfg: BaseConfig, xp: Namespace, *arrays: Array | None) -> bool:
    """Whether a step of ``cfg`` on ``arrays`` runs the numba kernels.

    True when ``cfg.kernels`` is not ``"reference"``, numba imported, and every
    array is a float32/float64 NumPy array of one dtype (``None`` entries skipped).
    """
    return cfg.kernels != "reference" and _kernels.usable(xp, *arrays)


def _adam(state: Any, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """Kernel form of the Adam family direction (``M_t``, ``V_t``, ``U = M_t / (sqrt(V_t) + eps)``)."""
    b1_t = beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction)
    b2_t = beta_hat(cfg.betas[1], t, xp, bias_correction=cfg.bias_correction)
    M, V, U = _kernels.adam_direction(state.M, state.V, g, b1_t, b2_t, cfg.eps)
    return U, {"M": M, "V": V}


def _adafactor(state: Any, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """Kernel form of the Adafactor family direction (factored ``V_t``, clip, optional momentum)."""
    assert isinstance(cfg, AdafactorConfig)
    b1_t = beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction) if cfg.momentum else None
    M0 = state.M if cfg.momentum else None
    beta2_t = second_moment_decay(cfg, t, xp)
    U, M, r, s = _kernels.adafactor_direction(state.r, state.s, M0, g, cfg.eps, beta2_t, b1_t, cfg.clip_threshold)
    return U, {"M": M, "r": r, "s": s}


def _hfac(state: Any, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """Kernel form of the Hfac family direction (factored first and second moments)."""
    assert isinstance(cfg, HfacConfig)
    b1_t = beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction)
    b2_t = beta_hat(cfg.betas[1], t, xp, bias_correction=cfg.bias_correction)
    U, u, v, r, s = _kernels.hfac_direction(
        state.u, state.v, state.r, state.s, g, cfg.eps, b1_t, b2_t, cfg.clip_threshold
    )
    return U, {"u": u, "v": v, "r": r, "s": s}


KERNEL_DIRECTIONS: dict[str, Callable[[Any, Array, Array, BaseConfig, Namespace], tuple[Array, Moments]]] = {
    "adam": _adam,
    "adafactor": _adafactor,
    "hfac": _hfac,
}
"""Per family, the numba implementation of ``FAMILIES[family].direction`` (same signature, same results)."""


def direction(state: State, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """``U~, moments = FAMILIES[cfg.family].direction(state, G~, t, cfg)``, by the code ``cfg.kernels`` selects."""
    family = FAMILIES[cfg.family]
    if uses_kernels(cfg, xp, g, *(getattr(state, name) for name in family.moment_fields)):
        return KERNEL_DIRECTIONS[cfg.family](state, g, t, cfg, xp)
    return family.direction(state, g, t, cfg, xp)
