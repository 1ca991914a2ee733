"""``init`` warns when a rotated side would make each basis refresh slow (docs/reliability.md, refresh time)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref.optim import core

BOUND = 2048  # docs/reliability.md: one refresh of a 2048 side is under a minute on the reference machine


def test_the_documented_bound_and_default() -> None:
    assert core.SLOW_REFRESH_SIDE == BOUND
    assert ar.make_config("adadiag").max_basis_dim == 8192


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_rotated_side_beyond_the_bound_warns_at_init(dtype: type) -> None:
    w = np.zeros((4, BOUND + 1), dtype=dtype)  # two-sided: Q is (BOUND + 1) x (BOUND + 1)
    with pytest.warns(core.SlowRefreshWarning, match=rf"shape \(4, {BOUND + 1}\) has a rotated side of {BOUND + 1}"):
        ar.init(w, ar.make_config("adadiag_pp"))


@pytest.mark.parametrize(
    ("name", "shape", "options"),
    [
        ("adadiag_pp", (4, BOUND), {}),  # at the bound
        ("adadiag_pp", (4, BOUND + 1), {"max_basis_dim": BOUND}),  # the long side is not rotated
        ("adadiag", (4, BOUND + 1), {}),  # one-sided: only the 4-wide side is rotated
        ("adamw", (4, BOUND + 1), {}),  # no rotation
    ],
)
def test_no_warning_when_no_rotated_side_exceeds_the_bound(name: str, shape: tuple[int, int], options: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", core.SlowRefreshWarning)
        ar.init(np.zeros(shape, dtype=np.float32), ar.make_config(name, **options))
