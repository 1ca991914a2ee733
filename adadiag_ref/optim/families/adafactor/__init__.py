"""The Adafactor family (Adafactor, AdafacDiag, AdafacDiag++): its reference and its fast routes.

* :mod:`.reference`: the state types, the discrete direction (Algorithm AdafacDiag: factored second moment,
  clip, optional momentum), the relative step size, and the continuous-time forms with ``H`` and ``dH/dt``;
* :mod:`.numba_route`: the numba kernels (NumPy) of the direction;
* :mod:`.cupy_route`: the CuPy kernels (CUDA) of the direction.

:data:`SPEC` is the family's registry entry.
"""

from __future__ import annotations

from ....config import AdafactorConfig, BaseConfig
from ..common import flow_of, paper_defaults
from ..registry import FamilySpec, Routes
from . import cupy_route, numba_route, reference
from .reference import AdafactorODEState, AdafactorState, second_moment_decay

__all__ = ["SPEC", "AdafactorODEState", "AdafactorState", "second_moment_decay"]


def moment_shapes(cfg: BaseConfig, m: int, n: int) -> dict[str, tuple[int, ...] | None]:
    """``M``: ``m x n`` with momentum, else absent; ``r``: ``(m,)``; ``s``: ``(n,)``."""
    return {"M": (m, n) if cfg.momentum else None, "r": (m,), "s": (n,)}


SPEC = FamilySpec(
    name="adafactor",
    config_type=AdafactorConfig,
    state_type=AdafactorState,
    moment_shapes=moment_shapes,
    direction=reference.direction,
    step_size=reference.step_size,
    flow=flow_of(reference, AdafactorODEState, *paper_defaults(AdafactorConfig)),
    routes=Routes(direction=(numba_route.direction, cupy_route.direction)),
    report_lr=3e-2,
)
