"""Pure functional optimizers (``init``, ``refresh_basis``, ``update``, ``step``: the reference), the engine (the
one fast executor) and the embedding toolkit: the pieces of one step that a framework adapter builds on (the work
frame, the prepared step, the step's coefficients, the library's square root), each the function the reference
itself calls."""

from .._xp import namespace, sqrt, warn_at_caller
from .checkpoint import register_torch_safe_globals
from .core import (
    NonFiniteGradientWarning,
    SlowRefreshWarning,
    StepInput,
    check_inputs,
    check_orientation,
    check_state,
    init,
    preconditioned_direction,
    prepare_step,
    refresh_basis,
    refresh_due,
    rotate,
    step,
    unrotate,
    update,
    work_dtype,
)
from .engine import Engine, Route, explain_route
from .inplace import supports_in_place, update_in_place
from .layout import (
    Layout,
    flatten_in_memory_order,
    from_work,
    layout_for,
    split_batch,
    to_work,
    transposed_frame,
    work_view,
)
from .multi import multi_step, refresh_bases
from .schedules import beta_hats, host_step, learning_rate
from .tail import decays
from .traced import refresh_when_due, traced_refresh_due

__all__ = [
    "Engine",
    "Layout",
    "NonFiniteGradientWarning",
    "Route",
    "SlowRefreshWarning",
    "StepInput",
    "beta_hats",
    "check_inputs",
    "check_orientation",
    "check_state",
    "decays",
    "explain_route",
    "flatten_in_memory_order",
    "from_work",
    "host_step",
    "init",
    "layout_for",
    "learning_rate",
    "multi_step",
    "namespace",
    "preconditioned_direction",
    "prepare_step",
    "refresh_bases",
    "refresh_basis",
    "refresh_due",
    "refresh_when_due",
    "register_torch_safe_globals",
    "rotate",
    "split_batch",
    "sqrt",
    "step",
    "supports_in_place",
    "to_work",
    "traced_refresh_due",
    "transposed_frame",
    "unrotate",
    "update",
    "update_in_place",
    "warn_at_caller",
    "work_dtype",
    "work_view",
]
