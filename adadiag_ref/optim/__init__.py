"""Pure functional optimizers: ``init``, ``refresh_basis``, ``update``, ``step``."""

from .checkpoint import register_torch_safe_globals
from .core import (
    NonFiniteGradientWarning,
    SlowRefreshWarning,
    check_inputs,
    init,
    refresh_basis,
    refresh_due,
    rotate,
    step,
    unrotate,
    update,
)
from .engine import Engine, Route, explain_route
from .inplace import supports_in_place, update_in_place
from .layout import Layout, from_work, layout_for, to_work
from .multi import multi_step, refresh_bases
from .traced import refresh_when_due, traced_refresh_due

__all__ = [
    "Engine",
    "Layout",
    "NonFiniteGradientWarning",
    "Route",
    "SlowRefreshWarning",
    "check_inputs",
    "explain_route",
    "from_work",
    "init",
    "layout_for",
    "multi_step",
    "refresh_bases",
    "refresh_basis",
    "refresh_due",
    "refresh_when_due",
    "register_torch_safe_globals",
    "rotate",
    "step",
    "supports_in_place",
    "to_work",
    "traced_refresh_due",
    "unrotate",
    "update",
    "update_in_place",
]
