"""A state meets a parameter of its own shape and orientation, or a clear error (docs/reliability.md).

A ``(7, 9)`` and a ``(9, 7)`` parameter share the ``7 x 9`` work frame, so every
state field has the same shape for both; so do ``(4, 3, 3)`` and ``(4, 9)``.  The
state's ``param_shape`` tells them apart wherever a state meets a parameter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import adadiag_ref as ar

NAMES = list(ar.OPTIMIZERS)
SWAPS = [((7, 9), (9, 7)), ((9, 7), (7, 9)), ((4, 3, 3), (4, 9)), ((4, 9), (9, 4))]


def _snapshot(state: Any, *arrays: np.ndarray) -> list[bytes | None]:
    return [None if a is None else np.asarray(a).tobytes() for a in (*state, *arrays)]


def _trained(name: str, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """A config and the state of a ``shape`` parameter after one step (real bases, non-zero moments)."""
    cfg = ar.make_config(name, lr=1e-2)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape)
    _, state = ar.step(ar.init(w, cfg), rng.standard_normal(shape), cfg, w)
    return cfg, state


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("created", "used"), SWAPS)
def test_every_entry_point_refuses_the_state_of_another_orientation(name: str, created, used) -> None:
    cfg, state = _trained(name, created)
    rng = np.random.default_rng(1)
    w, g = rng.standard_normal(used), rng.standard_normal(used)
    before = _snapshot(state, w, g)
    pattern = rf"created for a parameter of shape {re_shape(created)}, not {re_shape(used)}"
    calls = {
        "step": lambda: ar.step(state, g, cfg, w),
        "step(check=False)": lambda: ar.step(state, g, cfg, w, check=False),
        "check_inputs": lambda: ar.check_inputs(state, g, cfg, w),
        "update": lambda: ar.update(state, g, cfg, w),
        "update_in_place": lambda: ar.update_in_place(state, g, cfg, w),
        "refresh_basis": lambda: ar.refresh_basis(state, g, cfg),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=pattern):
            call()
    assert _snapshot(state, w, g) == before  # state, parameter and gradient bit-identical


@pytest.mark.parametrize("name", ["adadiag", "adafacdiag_pp"])
def test_the_parameter_shape_is_recorded_and_a_matching_state_is_accepted(name: str) -> None:
    cfg, state = _trained(name, (9, 7))
    assert state.param_shape.shape == (0, 9, 7) and state.param_shape.size == 0  # no memory
    w = np.zeros((9, 7))
    new_w, new = ar.step(state, np.ones((9, 7)), cfg, w)
    assert new_w.shape == (9, 7) and new.param_shape is state.param_shape


def re_shape(shape: tuple[int, ...]) -> str:
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")
