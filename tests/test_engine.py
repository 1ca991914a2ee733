"""``adadiag-ref bench`` times what a user runs: :class:`adadiag_ref.perf.bench.EngineSteps` is ``ar.Engine``
over the parameter set (rotated matrices in one engine, the rest in an AdamW one), and its steps are the core's."""

from __future__ import annotations

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref.memory import ParamSpec
from adadiag_ref.perf import bench
from adadiag_ref.perf.params import BETAS, EPS, LR, adadiag_bytes, adadiag_flops, adamw_bytes

pytest.importorskip("threadpoolctl")  # the bench extra

SPECS = [
    ParamSpec("blocks.0.q", (24, 40), "block"),
    ParamSpec("blocks.0.down", (40, 24), "block"),
    ParamSpec("embed", (50, 16), "embedding"),
    ParamSpec("norm", (16,), "norm"),
]


def test_engine_steps_group_by_the_rule_and_step_like_the_core() -> None:
    """The paper's rule: the two block matrices in an AdaDiag engine, embedding and norm in an AdamW one; three
    steps (the first refreshes) equal ``ar.step`` on copies of the same parameters and gradients (float32: rtol
    1e-5, the engine batches its GEMMs per work shape, which may round differently from one product each)."""
    steps = bench.EngineSteps("adadiag", SPECS, "paper", warmup=0)
    assert [sorted(engine.keys) for engine, _, _ in steps.parts] == [["blocks.0.down", "blocks.0.q"], ["embed", "norm"]]
    initial = [[p.copy() for p in params] for _, _, params in steps.parts]
    for _ in range(3):
        steps()
    for (engine, grads, params), start, name in zip(steps.parts, initial, ("adadiag", "adamw"), strict=True):
        cfg = ar.make_config(name, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, update_freq=None)
        for g, w, got in zip(grads, start, params, strict=True):
            state = ar.init(w, cfg)
            for _ in range(3):
                w, state = ar.step(state, g, cfg, w)
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
        assert all(engine.count(key) == 3 for key in engine.keys)
    steps.close()
    assert steps.parts == []


def test_bounds_count_the_rotated_and_unrotated_work() -> None:
    """The rooflines' bounds: AdamW 7 float32 arrays per entry; AdaDiag ``4 m^2 n`` flops per rotated matrix
    (work frame ``m <= n``) and 9 arrays per rotated entry, 7 per unrotated one."""
    entries = 24 * 40 + 40 * 24 + 50 * 16 + 16
    assert adamw_bytes(SPECS) == 28 * entries
    assert adadiag_flops(SPECS, "paper") == 2 * 4 * 24 * 24 * 40
    assert adadiag_bytes(SPECS, "paper") == 4 * (9 * 2 * 960 + 7 * (800 + 16))
    assert adadiag_flops(SPECS, "all") == 2 * 4 * 24 * 24 * 40 + 4 * 16 * 16 * 50  # the embedding too
