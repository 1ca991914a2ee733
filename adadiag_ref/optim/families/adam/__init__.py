"""The Adam family (AdamW, AdaDiag, AdaDiag++): its reference and its fast routes, side by side.

* :mod:`.reference`: the state types, the discrete direction (Algorithm 1) and the continuous-time form
  (the paper's Adam-ODE, ``H``, ``dH/dt``), in array-API code: the definition every route is tested against;
* :mod:`.numba_route`: the numba kernels (NumPy) of the direction and of an unrotated matrix's whole update;
* :mod:`.cupy_route`: the same as CuPy kernels (CUDA);
* :mod:`.group_route`, :mod:`.cupy_group`: the multi-tensor kernels over many parameters' own memory (the torch
  adapter's CPU group route; the engine's groups without rotation, numba and CUDA);
* :mod:`.torch_route`: the threads that the torch adapter's CPU group kernels are cut over.

The routes run only in the engine (:class:`adadiag_ref.Engine`); the reference never tries them.

:data:`SPEC` is the family's registry entry.
"""

from __future__ import annotations

from ....config import AdamConfig, BaseConfig
from ..common import flow_of, paper_defaults
from ..registry import FamilySpec, Routes
from . import cupy_group, cupy_route, group_route, numba_route, reference
from .reference import AdamODEState, AdamState

__all__ = ["SPEC", "AdamODEState", "AdamState"]


def moment_shapes(cfg: BaseConfig, m: int, n: int) -> dict[str, tuple[int, ...] | None]:
    """``M``, ``V``: ``m x n``."""
    return {"M": (m, n), "V": (m, n)}


SPEC = FamilySpec(
    name="adam",
    config_type=AdamConfig,
    state_type=AdamState,
    moment_shapes=moment_shapes,
    direction=reference.direction,
    flow=flow_of(reference, AdamODEState, *paper_defaults(AdamConfig)),
    routes=Routes(
        direction=(numba_route.direction, cupy_route.direction),
        update=(numba_route.update, cupy_route.update),
        group=(group_route.engine_group, cupy_group.engine_group),
    ),
    report_lr=3e-2,
    entrywise=True,
)
