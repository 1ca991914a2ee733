"""adadiag-ref: the reference implementation of the AdaDiag family of optimizers.

Paper: "Improving Adaptive Moment Optimization via Preconditioner
Diagonalization" (Nguyen, Liu, Chen, Liu; UAI 2025).  The core is pure
array-API code (NumPy, CuPy, torch, JAX, array_api_strict); see ``docs/spec.md``
for the exact equations and conventions.
"""

from .config import (
    OPTIMIZERS,
    AdafactorConfig,
    AdamConfig,
    BaseConfig,
    HfacConfig,
    default_eps,
    make_config,
    step_config,
)
from .linalg import CanonicalSVD, canonical_svd
from .memory import state_nbytes
from .optim import (
    Engine,
    Layout,
    NonFiniteGradientWarning,
    Route,
    SlowRefreshWarning,
    check_inputs,
    explain_route,
    init,
    layout_for,
    multi_step,
    refresh_bases,
    refresh_basis,
    refresh_due,
    refresh_when_due,
    register_torch_safe_globals,
    rotate,
    step,
    traced_refresh_due,
    unrotate,
    update,
    update_in_place,
)
from .optim.families import AdafactorState, AdamState, HfacState
from .replay import replay

__version__ = "0.1.0"

__all__ = [
    "OPTIMIZERS",
    "AdafactorConfig",
    "AdafactorState",
    "AdamConfig",
    "AdamState",
    "BaseConfig",
    "CanonicalSVD",
    "Engine",
    "HfacConfig",
    "HfacState",
    "Layout",
    "NonFiniteGradientWarning",
    "Route",
    "SlowRefreshWarning",
    "__version__",
    "canonical_svd",
    "check_inputs",
    "default_eps",
    "explain_route",
    "init",
    "layout_for",
    "make_config",
    "multi_step",
    "refresh_bases",
    "refresh_basis",
    "refresh_due",
    "refresh_when_due",
    "register_torch_safe_globals",
    "replay",
    "rotate",
    "state_nbytes",
    "step",
    "step_config",
    "traced_refresh_due",
    "unrotate",
    "update",
    "update_in_place",
]
