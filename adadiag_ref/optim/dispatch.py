"""Which code computes a family's direction ``U~``: the first of its direction routes that applies, else its
reference.

The reference is the family's ``direction`` (:attr:`~adadiag_ref.optim.families.FamilySpec.direction`),
generic array-API code.  A route (``Routes.direction``, e.g. the numba kernels on float32/float64 NumPy
arrays) computes the same formulas, in the same order, and says ``None`` when it does not apply: to another
backend, dtype or layout, or when ``cfg.kernels == "reference"``.  A family without a route takes the
reference.  A stack of matrices (``batch_dims > 0``: ``G~`` of shape ``(*B, m, n)``) always takes the
reference, whose statistics are per matrix; no route sees it.  The choice is the config's
:attr:`~adadiag_ref.config.BaseConfig.kernels` and the arrays, never
the environment: two configs that compare equal run the same code.
"""

from __future__ import annotations

from .._xp import Array, Namespace
from ..config import BaseConfig
from .families import Moments, family_of

__all__ = ["direction"]


def direction(state: object, g: Array, t: Array, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """``U~, moments = direction(S_{t-1}, G~, t, cfg)`` by the first applicable route, else the reference."""
    spec = family_of(cfg)
    # the routes take single matrices (or a flat group); a stack (*B, m, n) takes the reference, which works per
    # matrix over the last two axes
    for route in spec.routes.direction if g.ndim <= 2 else ():
        found = route(state, g, t, cfg, xp)
        if found is not None:
            return found
    return spec.direction(state, g, t, cfg, xp)
