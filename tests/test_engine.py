"""The in-place engine of ``adadiag-ref bench`` (adadiag_ref.perf.engine) against the functional reference.

The engine keeps AdaDiag's state in preallocated float32 buffers and runs its
elementwise passes as numba kernels; the reference is ``ar.update`` on the same
``P``, ``G`` and ``W``.  Same formulas, same order, same BLAS calls, so the
parameters must agree bit for bit after several steps.
"""

from __future__ import annotations

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref import _kernels
from adadiag_ref.memory import ParamSpec
from adadiag_ref.optim.families.adam import AdamState

pytestmark = pytest.mark.skipif(not _kernels.AVAILABLE, reason="numba is not installed")


@pytest.mark.parametrize("parallel", [False, True])
def test_adadiag_engine_equals_functional_update(parallel: bool) -> None:
    from adadiag_ref.perf.engine import AdaDiagEngine

    specs = [ParamSpec("blocks.0.q", (24, 40), "block"), ParamSpec("blocks.0.down", (40, 24), "block")]
    eng = AdaDiagEngine(specs, lr=1e-2, parallel_elementwise=parallel)
    cfg = ar.make_config("adadiag", lr=1e-2, update_freq=None)
    reference = []
    for it in eng.items:
        m, n = it["W"].shape
        state = AdamState(count=np.zeros((), np.int32), P=it["P"].copy(), Q=None,
                          M=np.zeros((m, n), np.float32), V=np.zeros((m, n), np.float32))  # fmt: skip
        reference.append([state, it["G"].copy(), it["W"].copy()])
    for _ in range(3):
        eng.step()
        for item in reference:
            delta, item[0] = ar.update(item[0], item[1], cfg, item[2])
            item[2] = item[2] + delta
    for it, (state, _, w) in zip(eng.items, reference, strict=True):
        np.testing.assert_array_equal(it["W"], w)
        np.testing.assert_array_equal(it["M"], state.M)
        np.testing.assert_array_equal(it["V"], state.V)
