"""The Hfac family (Hfac, HfacDiag): its reference and its fast routes.

* :mod:`.reference`: the state types, the discrete direction (Algorithm HfacDiag: factored first and second
  moments) and the continuous-time form with ``H`` and ``dH/dt``;
* :mod:`.numba_route`: the numba kernels (NumPy) of the direction;
* :mod:`.cupy_route`: the CuPy kernels (CUDA) of the direction.

:data:`SPEC` is the family's registry entry.
"""

from __future__ import annotations

from ....config import BaseConfig, HfacConfig
from ..common import flow_of, paper_defaults
from ..registry import FamilySpec, Routes
from . import cupy_route, numba_route, reference
from .reference import HfacODEState, HfacState, normalization_constants

__all__ = ["SPEC", "HfacODEState", "HfacState", "normalization_constants"]


def moment_shapes(cfg: BaseConfig, m: int, n: int) -> dict[str, tuple[int, ...] | None]:
    """``u``, ``r``: ``(m,)``; ``v``, ``s``: ``(n,)``."""
    return {"u": (m,), "v": (n,), "r": (m,), "s": (n,)}


SPEC = FamilySpec(
    name="hfac",
    config_type=HfacConfig,
    state_type=HfacState,
    moment_shapes=moment_shapes,
    direction=reference.direction,
    flow=flow_of(reference, HfacODEState, *paper_defaults(HfacConfig)),
    routes=Routes(direction=(numba_route.direction, cupy_route.direction)),
    report_lr=1e-2,
)
