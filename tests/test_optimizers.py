"""The optimizers against the loop references, torch.optim and the shape rules."""

from __future__ import annotations

import numpy as np
import pytest
from reference import reference

import adadiag_ref as ar

NAMES = list(ar.OPTIMIZERS)
# float64 agreement with the loop references.  The library and the references
# compute the same formulas in a different order (vectorised vs loops), so they
# differ by rounding: ~1e-16 relative per step, amplified by the normalisation
# G~/sqrt(V).  rtol 1e-12 leaves 4 orders of magnitude of margin; entries that
# pass close to zero get the absolute floor 1e-12 * max|W|.
RTOL = 1e-12


def _stream(rng: np.random.Generator, shape: tuple[int, ...], steps: int) -> tuple[np.ndarray, np.ndarray]:
    w0 = rng.standard_normal(shape)
    grads = rng.standard_normal((steps, *shape))
    return w0, grads


def assert_traj_close(actual: np.ndarray, expected: np.ndarray, rtol: float = RTOL) -> None:
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(3, 5), (4, 4)])
def test_matches_loop_reference_over_several_refreshes(name: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(11)
    w0, grads = _stream(rng, shape, 10)
    grads[4] = 0.0  # a zero gradient on a refresh step (t = 5, T = 2)
    grads[6] = np.outer(rng.standard_normal(shape[0]), rng.standard_normal(shape[1]))  # rank 1, refresh (t = 7)
    kw = dict(lr=3e-2, betas=(0.9, 0.99), weight_decay=0.05)
    eps = 1e-8 if ar.make_config(name).family == "adam" else 1e-30
    got = ar.replay(name, w0, grads, eps=eps, update_freq=2, **kw)
    want = reference(name, w0, list(grads), lr=kw["lr"], betas=kw["betas"], eps=eps, wd=kw["weight_decay"], T=2)
    assert_traj_close(got, want)


@pytest.mark.parametrize("name", ["adafactor", "adafacdiag", "adafacdiag_pp", "hfac", "hfacdiag"])
def test_momentum_off_matches_reference(name: str) -> None:
    rng = np.random.default_rng(5)
    w0, grads = _stream(rng, (3, 4), 7)
    got = ar.replay(name, w0, grads, lr=1e-2, betas=(0.0, 0.999), update_freq=3)
    want = reference(name, w0, list(grads), lr=1e-2, betas=(0.0, 0.999), eps=1e-30, wd=0.0, T=3, momentum=False)
    assert_traj_close(got, want)


def test_momentum_option_equals_zero_beta1() -> None:
    rng = np.random.default_rng(6)
    w0, grads = _stream(rng, (3, 4), 6)
    a = ar.replay("adafacdiag", w0, grads, lr=1e-2, momentum=False, update_freq=2)
    b = ar.replay("adafacdiag", w0, grads, lr=1e-2, betas=(0.0, 0.999), update_freq=2)
    np.testing.assert_array_equal(a, b)
    c = ar.replay("adafacdiag", w0, grads, lr=1e-2, update_freq=2)
    assert np.max(np.abs(a - c)) > 1e-6  # momentum on by default when beta1 > 0
    assert ar.init(w0, ar.make_config("adafacdiag", momentum=False)).M is None


def test_adamw_equals_torch_adamw() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w0, grads = _stream(rng, (5, 7), 20)
    got = ar.replay("adamw", w0, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    p = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)
    want = []
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
        want.append(p.detach().numpy().copy())
    # torch stores raw EMAs and divides by (1 - beta^t); the library uses the
    # paper's beta-hat EMA.  Equal in exact arithmetic, so only rounding differs.
    assert_traj_close(got, np.stack(want))


def test_adafactor_equals_torch_adafactor() -> None:
    """torch.optim.Adafactor = our adafactor with the original Adafactor options (docs/spec.md).

    Coinciding options: no momentum, beta2_t = 1 - t^-0.8, relative step
    rho_t = min(lr, 1/sqrt(t)), parameter scale max(eps2, RMS(W_{t-1})), d = 1,
    no weight decay (torch decays with lr * lambda, not with the scaled step).
    torch clamps V below at eps1^2 instead of adding eps to G^2; with eps = 1e-30
    and O(1) gradients neither regularisation is active.
    """
    torch = pytest.importorskip("torch")
    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor needs torch >= 2.5")
    rng = np.random.default_rng(1)
    for shape in [(4, 6), (6, 4), (5,)]:
        w0, grads = _stream(rng, shape, 15)
        got = ar.replay(
            "adafactor",
            w0,
            grads,
            lr=1e-2,
            betas=(0.0, 0.999),
            eps=1e-30,
            beta2_schedule="adafactor",
            relative_step=True,
            scale_parameter=True,
        )
        p = torch.tensor(w0, requires_grad=True)
        opt = torch.optim.Adafactor([p], lr=1e-2, foreach=False)
        want = []
        for g in grads:
            p.grad = torch.tensor(g)
            opt.step()
            want.append(p.detach().numpy().copy())
        assert_traj_close(got, np.stack(want))


def test_adafactor_equals_optax_adafactor() -> None:
    """optax.adafactor = our adafactor with a constant lr and parameter scaling (docs/spec.md)."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    for shape in [(4, 6), (6, 4), (5,)]:
        w0, grads = _stream(rng, shape, 15)
        got = ar.replay(
            "adafactor",
            w0,
            grads,
            lr=1e-2,
            betas=(0.0, 0.999),
            eps=1e-30,
            beta2_schedule="adafactor",
            scale_parameter=True,
        )
        tx = optax.adafactor(learning_rate=1e-2, min_dim_size_to_factor=1, multiply_by_parameter_scale=True)
        w = jnp.asarray(w0)
        state = tx.init(w)
        want = []
        for g in grads:
            updates, state = tx.update(jnp.asarray(g), state, w)
            w = optax.apply_updates(w, updates)
            want.append(np.asarray(w))
        # optax computes beta2_t = 1 - t^-0.8 in float32 even under x64
        # (optax._src.factorized._decay_rate_pow), so the two agree to float32
        # precision of that one scalar: ~1e-8 relative per step.
        assert_traj_close(got, np.stack(want), rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_tall_matrix_is_the_transposed_wide_problem(name: str) -> None:
    rng = np.random.default_rng(3)
    w0, grads = _stream(rng, (6, 3), 7)
    tall = ar.replay(name, w0, grads, lr=1e-2, update_freq=3, weight_decay=0.01)
    wide = ar.replay(name, w0.T.copy(), np.swapaxes(grads, 1, 2).copy(), lr=1e-2, update_freq=3, weight_decay=0.01)
    assert_traj_close(tall, np.swapaxes(wide, 1, 2))
    cfg = ar.make_config(name)
    lay = ar.layout_for((6, 3), cfg)
    assert (lay.rows, lay.cols, lay.transposed) == (3, 6, True)
    if cfg.sides:
        assert ar.init(w0, cfg).P.shape == (3, 3)


@pytest.mark.parametrize("name", NAMES)
def test_conv_kernel_is_reshaped(name: str) -> None:
    rng = np.random.default_rng(4)
    w0, grads = _stream(rng, (4, 2, 3, 3), 6)
    conv = ar.replay(name, w0, grads, lr=1e-2, update_freq=2)
    flat = ar.replay(name, w0.reshape(4, 18), grads.reshape(6, 4, 18), lr=1e-2, update_freq=2)
    np.testing.assert_array_equal(conv, flat.reshape(6, 4, 2, 3, 3))


@pytest.mark.parametrize("name", NAMES)
def test_vector_parameter_reduces_to_baseline(name: str) -> None:
    rng = np.random.default_rng(5)
    w0, grads = _stream(rng, (7,), 6)
    baseline = {"adam": "adamw", "adafactor": "adafactor", "hfac": "hfac"}[ar.make_config(name).family]
    got = ar.replay(name, w0, grads, lr=1e-2, update_freq=2)
    want = ar.replay(baseline, w0, grads, lr=1e-2, update_freq=2)
    assert_traj_close(got, want)
    state = ar.init(w0, ar.make_config(name))
    assert state.Q is None
    if state.P is not None:
        assert state.P.shape == (1, 1)


def test_max_basis_dim_disables_rotation_of_long_sides() -> None:
    cfg = ar.make_config("adadiag_pp", max_basis_dim=5)
    assert ar.layout_for((4, 9), cfg)[4:6] == (True, False)
    assert ar.layout_for((6, 9), cfg)[4:6] == (False, False)
    st = ar.init(np.zeros((4, 9)), cfg)
    assert st.P.shape == (4, 4) and st.Q is None
    # a side that is never rotated is never decomposed: a 1 x 100000 gradient is fine
    big = ar.make_config("adadiag_pp", max_basis_dim=64)
    w = np.zeros((2, 100_000))
    s = ar.refresh_basis(ar.init(w, big), np.ones_like(w), big)
    assert s.P.shape == (2, 2) and s.Q is None


@pytest.mark.parametrize("name", NAMES)
def test_identity_basis_gives_baseline(name: str) -> None:
    """With P = Q = I (never refreshed) each rotated optimizer is its baseline."""
    cfg = ar.make_config(name, lr=1e-2)
    base = ar.make_config({"adam": "adamw", "adafactor": "adafactor", "hfac": "hfac"}[cfg.family], lr=1e-2)
    rng = np.random.default_rng(8)
    w = rng.standard_normal((3, 5))
    s1, s2 = ar.init(w, cfg), ar.init(w, base)
    w1 = w2 = w
    for _ in range(4):
        g = rng.standard_normal((3, 5))
        d1, s1 = ar.update(s1, g, cfg, w1)
        d2, s2 = ar.update(s2, g, base, w2)
        w1, w2 = w1 + d1, w2 + d2
    np.testing.assert_array_equal(w1, w2)


@pytest.mark.parametrize(
    ("param_dtype", "state_dtype"),
    [(np.float64, np.float64), (np.float32, np.float32), (np.float16, np.float32)],
)
def test_state_dtype_policy(param_dtype: type, state_dtype: type) -> None:
    w = np.ones((3, 4), dtype=param_dtype)
    for name in NAMES:
        st = ar.init(w, ar.make_config(name))
        for field in st[1:]:
            if field is not None:
                assert field.dtype == state_dtype
        new_w, st2 = ar.step(st, np.ones_like(w), ar.make_config(name), w)
        assert new_w.dtype == param_dtype
        assert all(a is None or a.dtype == b.dtype for a, b in zip(st2[1:], st[1:]))


def test_bfloat16_torch_state_is_float32() -> None:
    torch = pytest.importorskip("torch")
    w = torch.ones((3, 4), dtype=torch.bfloat16)
    st = ar.init(w, ar.make_config("adadiag"))
    assert st.M.dtype == torch.float32 and st.P.dtype == torch.float32
    new_w, _ = ar.step(st, torch.full_like(w, 0.5), ar.make_config("adadiag"), w)
    assert new_w.dtype == torch.bfloat16


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_zero_gradient_gives_finite_updates(name: str, dtype: type) -> None:
    w0 = np.random.default_rng(9).standard_normal((3, 4)).astype(dtype)
    traj = ar.replay(name, w0, np.zeros((4, 3, 4), dtype=dtype), lr=1e-2, weight_decay=0.1)
    assert np.all(np.isfinite(traj))
    traj = ar.replay(name, w0, np.zeros((4, 3, 4), dtype=dtype), lr=1e-2)
    np.testing.assert_array_equal(traj[-1], w0)  # no gradient, no decay: nothing moves
    # a rank-1 gradient leaves zero rows and columns in G~ (eps = 1e-30 must not underflow in float32)
    g = np.outer(np.arange(1.0, 4.0), np.ones(4)).astype(dtype)
    traj = ar.replay(name, w0, np.stack([g, g, np.zeros_like(g), g]), lr=1e-2, update_freq=2)
    assert np.all(np.isfinite(traj))


def test_refresh_schedule_is_t_equals_1_then_every_T() -> None:
    cfg = ar.make_config("adadiag", update_freq=3)
    assert [t for t in range(1, 12) if ar.refresh_due(t - 1, cfg)] == [1, 4, 7, 10]
    fixed = ar.make_config("adadiag", update_freq=None)
    assert [t for t in range(1, 12) if ar.refresh_due(t - 1, fixed)] == [1]


def test_refresh_changes_only_the_basis() -> None:
    rng = np.random.default_rng(10)
    cfg = ar.make_config("adadiag_pp")
    w = rng.standard_normal((3, 5))
    _, st = ar.update(ar.init(w, cfg), rng.standard_normal((3, 5)), cfg, w)
    new = ar.refresh_basis(st, rng.standard_normal((3, 5)), cfg)
    assert new.M is st.M and new.V is st.V and new.count is st.count
    assert new.P.shape == st.P.shape and new.Q.shape == st.Q.shape
    assert not np.allclose(new.P, st.P)
