"""Bad input gets a clear error and leaves the state untouched; hypothesis over shapes and hyperparameters."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import adadiag_ref as ar

NAMES = list(ar.OPTIMIZERS)

SHAPES = st.sampled_from([(1, 1), (1, 6), (6, 1), (7, 3), (3, 7), (4, 4), (5,), (2, 3, 2, 2)])


def _snapshot(state) -> list:
    return [None if a is None else np.array(a, copy=True) for a in state]


def _assert_same(state, snap) -> None:
    for a, b in zip(state, snap):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_is_rejected_and_state_untouched(name: str, bad: float) -> None:
    cfg = ar.make_config(name, update_freq=2)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4))
    state = ar.init(w, cfg)
    w, state = ar.step(state, rng.standard_normal((3, 4)), cfg, w)
    snap = _snapshot(state)
    g = rng.standard_normal((3, 4))
    g[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        ar.step(state, g, cfg, w)
    _assert_same(state, snap)


@pytest.mark.parametrize("name", NAMES)
def test_shape_and_dtype_mismatch(name: str) -> None:
    cfg = ar.make_config(name)
    w = np.zeros((3, 4))
    state = ar.init(w, cfg)
    snap = _snapshot(state)
    with pytest.raises(ValueError, match="gradient shape"):
        ar.step(state, np.zeros((4, 3)), cfg, w)
    with pytest.raises(ValueError, match="dtype"):
        ar.step(state, np.zeros((3, 4), dtype=np.float32), cfg, w)
    with pytest.raises(ValueError, match="state field"):
        ar.step(state, np.zeros((3, 5)), cfg, np.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"complex|supported"):
        ar.step(state, np.zeros((3, 4), dtype=np.complex128), cfg, w)
    other = "adafactor" if cfg.family != "adafactor" else "adamw"
    with pytest.raises(ValueError, match="does not belong"):
        ar.step(ar.init(w, ar.make_config(other)), np.zeros((3, 4)), cfg, w)
    _assert_same(state, snap)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("lr", -1.0),
        ("lr", math.nan),
        ("betas", (1.0, 0.9)),
        ("betas", (0.9, -0.1)),
        ("betas", (0.9,)),
        ("eps", -1e-8),
        ("weight_decay", -0.1),
        ("update_freq", 0),
        ("update_freq", 2.5),
        ("max_basis_dim", 0),
        ("state_dtype", "float16"),
    ],
)
def test_invalid_hyperparameters_raise_at_construction(option: str, value: object) -> None:
    with pytest.raises(ValueError):
        ar.make_config("adadiag", **{option: value})


def test_family_options_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown optimizer"):
        ar.make_config("adadiag3")
    with pytest.raises(ValueError, match="unknown option"):
        ar.make_config("adadiag", clip_threshold=1.0)
    with pytest.raises(ValueError, match="Adafactor family"):
        ar.make_config("adadiag", momentum=False)
    with pytest.raises(ValueError, match="beta1 > 0"):
        ar.make_config("adafactor", momentum=True, betas=(0.0, 0.999))
    with pytest.raises(ValueError, match="clip_threshold"):
        ar.make_config("hfac", clip_threshold=0.0)
    with pytest.raises(ValueError, match="beta2_schedule"):
        ar.make_config("adafactor", beta2_schedule="cosine")
    cfg = ar.make_config("adafactor")
    assert hash(cfg) == hash(ar.make_config("adafactor"))
    with pytest.raises(AttributeError):
        cfg.lr = 1.0  # type: ignore[misc]


@given(
    name=st.sampled_from(NAMES),
    shape=SHAPES,
    lr=st.floats(1e-5, 1e-1),
    b1=st.sampled_from([0.0, 0.5, 0.9]),
    b2=st.sampled_from([0.9, 0.99, 0.999]),
    wd=st.floats(0.0, 0.2),
    T=st.sampled_from([1, 2, 3, None]),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_shape_and_hyperparameters_give_finite_well_formed_steps(name, shape, lr, b1, b2, wd, T, seed) -> None:
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(shape)
    grads = rng.standard_normal((4, *shape))
    traj = ar.replay(name, w0, grads, lr=lr, betas=(b1, b2), weight_decay=wd, update_freq=T)
    assert traj.shape == (4, *shape)
    assert np.all(np.isfinite(traj))
    # every update is bounded: Adam-type updates by lr * (1/(1 - beta1) ... ) * sqrt(numel),
    # clipped factored updates by lr * (RMS clip) * sqrt(numel); use a generous common bound.
    steps = np.diff(np.concatenate([w0[None], traj]), axis=0)
    bound = lr * (10.0 * math.sqrt(w0.size) + wd * (np.abs(traj).max() + np.abs(w0).max()) + 10.0)
    assert np.all(np.abs(steps) <= bound)
    # the state keeps its structure across refreshes
    cfg = ar.make_config(name, lr=lr, betas=(b1, b2), weight_decay=wd, update_freq=T)
    s0 = ar.init(w0, cfg)
    s = s0
    w = w0
    for g in grads:
        w, s = ar.step(s, g, cfg, w)
    assert [None if a is None else (a.shape, a.dtype) for a in s] == [
        None if a is None else (a.shape, a.dtype) for a in s0
    ]
    assert int(s.count) == 4
