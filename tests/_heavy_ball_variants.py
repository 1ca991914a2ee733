"""The heavy-ball family of tests/test_extending.py under other names, for tests that register families at run
time (tests/test_ode_checks.py, tests/_ode_plugin_family.py)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import test_extending as heavy_ball

import adadiag_ref as ar
from adadiag_ref.config import OptimizerSpec
from adadiag_ref.optim.families import FAMILIES, FamilySpec, register_family


def heavy_ball_variant(family: str, **flow_changes: Any) -> tuple[FamilySpec, dict[str, OptimizerSpec]]:
    """``(spec, optimizers)`` for ``register_family``: heavy ball as family ``family`` (one unrotated optimizer of
    the same name), its ``Flow`` with ``flow_changes`` applied."""
    config = dataclasses.make_dataclass(
        f"{family.title()}Config",
        [("family", str, dataclasses.field(default=family, init=False))],
        bases=(heavy_ball.HeavyBallConfig,),
        frozen=True,
    )
    spec = dataclasses.replace(
        heavy_ball.SPEC, name=family, config_type=config, flow=heavy_ball.FLOW._replace(**flow_changes)
    )
    return spec, {family: OptimizerSpec(config, 0, family.title())}


@contextlib.contextmanager
def registered_variant(family: str, **flow_changes: Any) -> Iterator[str]:
    """:func:`heavy_ball_variant` registered for the ``with`` block (the library's tables restored after it)."""
    register_family(*heavy_ball_variant(family, **flow_changes))
    try:
        yield family
    finally:
        del FAMILIES[family]
        del ar.OPTIMIZERS[family]
