"""The refresh-step rule (docs/spec.md, section 5): a refresh step's ``G~`` set to its exact-arithmetic structure.

Two properties, on the inputs where an entrywise threshold failed (issue 33, item 1):

* the zeroed entries are exactly the structural zeros of ``Sigma`` (two-sided) or ``Sigma Q^T`` (one-sided), with
  the rank of the refresh's ``canonical_svd``: no real entry is zeroed (float32 included), no rounding noise
  survives;
* NumPy, torch and the jitted optax alias then agree to the golden float64 tolerance for all eight optimizers on
  repeated (exact clusters from random orthogonal factors), rank-deficient and well-separated spectra.
"""

from __future__ import annotations

from typing import Any

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest
from conftest import to_np
from hypothesis import given, settings
from hypothesis import strategies as st

import adadiag_ref as ar
from adadiag_ref._xp import namespace
from adadiag_ref.golden.generator import TOLERANCES
from adadiag_ref.optim import core

NAMES = list(ar.OPTIMIZERS)
SPECTRA = ("repeated", "rank_deficient", "separated")
SEEDS = range(20)
STEPS, FREQ = 4, 3  # refreshes at t = 1 and t = 4, on the spectrum's gradient
HYPER = {"lr": 0.01, "weight_decay": 0.1, "update_freq": FREQ}
# wide, tall (transposed work frame), and a long side that is not rotated (max_basis_dim: only P rotates)
FRAMES = (((6, 10), {}), ((10, 6), {}), ((4, 24), {"max_basis_dim": 16}))


def _orthogonal(rng: np.random.Generator, k: int) -> np.ndarray:
    """A random orthogonal ``k x k`` matrix (Haar: QR of a Gaussian with the signs of ``R``'s diagonal)."""
    q, r = np.linalg.qr(rng.standard_normal((k, k)))
    return q * np.sign(np.diag(r))


def _singular_values(kind: str, k: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "repeated":  # two exact clusters, (2, 2, 2) and (1, 1), then distinct values
        return np.concatenate([[2.0, 2.0, 2.0, 1.0, 1.0], np.linspace(0.9, 0.1, max(k - 5, 0))])[:k]
    if kind == "rank_deficient":
        return np.concatenate([np.sort(rng.uniform(0.5, 2.0, k - 2))[::-1], np.zeros(2)])
    if kind == "inverse":  # 1/i
        return 1.0 / np.arange(1, k + 1)
    return np.sort(rng.uniform(0.1, 3.0, k))[::-1]  # separated


def _spectrum_gradient(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """``U[:, :k] diag(s) V[:, :k]^T`` with random orthogonal ``U``, ``V`` and the spectrum ``kind``
    (``"gaussian"``: a standard normal matrix)."""
    if kind == "gaussian":
        return rng.standard_normal(shape)
    a, b = shape
    k = min(a, b)
    U, V = _orthogonal(rng, a), _orthogonal(rng, b)
    return (U[:, :k] * _singular_values(kind, k, rng)) @ V[:, :k].T


def _exact_support(rank: int, shape: tuple[int, int], two_sided: bool) -> np.ndarray:
    """Where ``Sigma`` (two-sided: ``i == j < rank``) or ``Sigma Q^T`` (one-sided: rows ``i < rank``) is nonzero."""
    support = np.zeros(shape, dtype=bool)
    if two_sided:
        support[np.arange(rank), np.arange(rank)] = True
    else:
        support[:rank] = True
    return support


def _refresh_step_g_rot(name: str, grad: Any, options: dict[str, Any]) -> tuple[np.ndarray, int, bool]:
    """``G~`` of a refresh step as the core makes it, the refresh's rank, and whether both sides rotate."""
    cfg = ar.make_config(name, **options)
    state = ar.refresh_basis(ar.init(grad, cfg), grad, cfg)
    g_rot = core.prepare_step(state, grad, cfg, grad, True, namespace(grad)).g_rot
    g = to_np(grad)
    rank = ar.canonical_svd(g.T if g.shape[0] > g.shape[1] else g, compute_q=False).rank
    return to_np(g_rot), rank, state.Q is not None


def _assert_exact_structure(g_rot: np.ndarray, rank: int, two_sided: bool) -> None:
    support = _exact_support(rank, g_rot.shape, two_sided)
    real_zeroed = int(np.sum(support & (g_rot == 0)))
    noise_kept = int(np.sum(~support & (g_rot != 0)))
    assert (real_zeroed, noise_kept) == (0, 0), (
        f"{real_zeroed} of {support.sum()} real entries zeroed, {noise_kept} structural zeros kept (rank {rank})"
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["gaussian", "inverse", "rank_deficient", "repeated"])
@pytest.mark.parametrize(
    ("name", "shape", "options"),
    [
        ("adadiag", (64, 160), {}),
        ("adadiag", (160, 64), {}),  # tall: the transposed work frame
        ("adadiag_pp", (64, 160), {}),
        ("adadiag_pp", (160, 64), {}),
        ("adadiag_pp", (64, 160), {"max_basis_dim": 100}),  # the long side is not rotated: one-sided structure
    ],
)
def test_a_refresh_step_zeroes_exactly_the_structural_zeros(name, shape, options, kind, dtype) -> None:
    grad = _spectrum_gradient(kind, shape, np.random.default_rng(7)).astype(dtype)
    g_rot, rank, two_sided = _refresh_step_g_rot(name, grad, options)
    assert two_sided == (name == "adadiag_pp" and not options)
    if kind != "rank_deficient":
        assert rank == min(shape)  # every row (one-sided) or diagonal entry (two-sided) is real signal
    _assert_exact_structure(g_rot, rank, two_sided)


@pytest.mark.parametrize("scale", [1e-25, 1e25])
@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_the_refresh_step_structure_does_not_depend_on_the_gradient_scale(name, scale) -> None:
    # float32 squares of 1e-25 underflow and of 1e25 overflow: the rank must come from scaled norms
    grad = _spectrum_gradient("rank_deficient", (8, 20), np.random.default_rng(5))
    g_rot, rank, two_sided = _refresh_step_g_rot(name, (scale * grad).astype(np.float32), {})
    assert rank == 6
    _assert_exact_structure(g_rot, rank, two_sided)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_the_refresh_step_structure_is_the_same_on_every_backend(xp, name, dtype) -> None:
    frames = (((48, 120), {}), ((120, 48), {}), ((24, 120), {"max_basis_dim": 100}))
    for (shape, options), kind in zip(frames, ("repeated", "rank_deficient", "inverse"), strict=True):
        grad = _spectrum_gradient(kind, shape, np.random.default_rng(3)).astype(dtype)
        g_rot, rank, two_sided = _refresh_step_g_rot(name, xp.asarray(grad), options)
        _assert_exact_structure(g_rot, rank, two_sided)


def test_the_refresh_step_structure_follows_a_traced_flag_under_jit() -> None:
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    g_rot = jnp.asarray(np.random.default_rng(4).standard_normal((5, 8)))
    structure = jax.jit(lambda g, r: core.refresh_step_structure(g, True, r, jnp))
    np.testing.assert_array_equal(structure(g_rot, jnp.asarray(False)), g_rot)  # not a refresh: G~ as it is
    refreshed = structure(g_rot, jnp.asarray(True))
    np.testing.assert_array_equal(refreshed, core.refresh_step_structure(g_rot, True, True, jnp))  # eager
    np.testing.assert_array_equal(refreshed, np.diag(np.diag(np.asarray(g_rot)[:, :5]), k=0) @ np.eye(5, 8))


def _stream(kind: str, seed: int, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``w0`` and ``STEPS`` Gaussian gradients, those of the refresh steps replaced by a ``kind`` spectrum."""
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(shape)
    grads = rng.standard_normal((STEPS, *shape))
    for t in range(0, STEPS, FREQ):
        grads[t] = _spectrum_gradient(kind, shape, rng)
    return w0, grads


def _cases() -> list[tuple[str, int, tuple[int, int], dict[str, Any]]]:
    """Every spectrum for every seed, the frames taken in turn."""
    return [(kind, seed, *FRAMES[seed % len(FRAMES)]) for kind in SPECTRA for seed in SEEDS]


def _assert_golden_close(got: np.ndarray, ref: np.ndarray, w0: np.ndarray, label: str) -> None:
    """The golden float64 check: ``|x - y| <= atol_factor max|W| + rtol |y|`` (docs/golden.md, Tolerances)."""
    tol = TOLERANCES["float64"]
    atol = tol.atol_factor * max(float(np.max(np.abs(w0))), float(np.max(np.abs(ref))))
    excess = np.max(np.abs(got - ref) / (atol + tol.rtol * np.abs(ref)))
    assert excess <= 1.0, f"{label}: {excess:.3g} x the golden tolerance"


@pytest.mark.parametrize("name", NAMES)
def test_torch_agrees_with_numpy_to_the_golden_tolerance_on_refresh_spectra(name) -> None:
    torch = pytest.importorskip("torch")
    for kind, seed, shape, options in _cases():
        w0, grads = _stream(kind, seed, shape)
        ref = ar.replay(name, w0, grads, **HYPER, **options)
        got = ar.replay(name, torch.from_numpy(w0), torch.from_numpy(grads), **HYPER, **options).numpy()
        _assert_golden_close(got, ref, w0, f"{name} {kind} seed {seed} {shape}")


@pytest.mark.usefixtures("jax_x64")
@pytest.mark.parametrize("name", NAMES)
def test_the_jitted_optax_alias_agrees_with_numpy_to_the_golden_tolerance_on_refresh_spectra(name) -> None:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp
    from adadiag_ref.adapters import optax as ao

    updates = {}  # one jitted update per frame: compiled once per shape
    for kind, seed, shape, options in _cases():
        w0, grads = _stream(kind, seed, shape)
        if shape not in updates:
            opt = ao.ALIASES[name](HYPER["lr"], weight_decay=HYPER["weight_decay"], update_freq=FREQ, **options)
            updates[shape] = opt, jax.jit(opt.update)
        opt, update = updates[shape]
        params = jnp.asarray(w0)
        state = opt.init(params)
        trajectory = []
        for g in grads:
            step, state = update(jnp.asarray(g), state, params)
            params = optax.apply_updates(params, step)
            trajectory.append(np.asarray(params))
        ref = ar.replay(name, w0, grads, **HYPER, **options)
        _assert_golden_close(np.stack(trajectory), ref, w0, f"{name} {kind} seed {seed} {shape}")


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    kind=st.sampled_from(SPECTRA),
    frame=st.sampled_from(FRAMES),
    seed=st.integers(0, 2**32 - 1),
)
def test_torch_agrees_with_numpy_on_refresh_spectra_over_many_seeds(name, kind, frame, seed) -> None:
    """The torch check above over arbitrary seeds (the long profile: 300 draws)."""
    torch = pytest.importorskip("torch")
    shape, options = frame
    w0, grads = _stream(kind, seed, shape)
    ref = ar.replay(name, w0, grads, **HYPER, **options)
    got = ar.replay(name, torch.from_numpy(w0), torch.from_numpy(grads), **HYPER, **options).numpy()
    _assert_golden_close(got, ref, w0, f"{name} {kind} seed {seed} {shape}")
