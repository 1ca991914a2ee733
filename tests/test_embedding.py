"""The functional core as an embedder meets it (issue 47): a hand-written training loop on any array-API library,
every hyperparameter of a step changeable per step, errors that name the parameter."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from conftest import _load_backend, to_np

import adadiag_ref as ar

NAMES = list(ar.OPTIMIZERS)


# ------------------------------------------------------------------------------------------- the MLP loop


def _mlp_data(seed: int = 47) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "X": rng.standard_normal((16, 5)),
        "Y": rng.standard_normal((16, 3)),
        "fc1.weight": rng.standard_normal((8, 5)) * 0.5,  # wide in the work frame after the transpose: 5 x 8
        "fc2.weight": rng.standard_normal((3, 8)) * 0.5,
        "fc2.bias": rng.standard_normal((3,)) * 0.1,
    }


def _mlp_grads(params: dict[str, Any], X: Any, Y: Any, xp: Any) -> dict[str, Any]:
    """Hand-written gradients of ``0.5 mean ||tanh(X W1^T) W2^T + b - Y||^2`` (no autograd: the embedder's)."""
    W1, W2, b = params["fc1.weight"], params["fc2.weight"], params["fc2.bias"]
    h = xp.tanh(X @ xp.matrix_transpose(W1))
    residual = (h @ xp.matrix_transpose(W2) + b - Y) / X.shape[0]
    dh = (residual @ W2) * (1.0 - h * h)
    return {
        "fc1.weight": xp.matrix_transpose(dh) @ X,
        "fc2.weight": xp.matrix_transpose(residual) @ h,
        "fc2.bias": xp.sum(residual, axis=0),
    }


def _persisted(params: dict[str, Any], states: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """dask arrays computed in memory, in one ``dask.persist`` per step (docs/embedding.md): the graph of the next
    step starts from stored values, so it stays one step long.  One call, not one per array (a graph optimisation
    per call: one per array was 46% of the loop's time, the whole loop 1.5x as long).  Other arrays as they are."""
    if not hasattr(next(iter(params.values())), "persist"):
        return params, states
    import dask

    return dask.persist(params, states)


def _mlp_loop(name: str, xp: Any, steps: int, **options: Any) -> dict[str, np.ndarray]:
    data = _mlp_data()
    X, Y = xp.asarray(data["X"]), xp.asarray(data["Y"])
    cfg = ar.make_config(name, lr=1e-2, update_freq=3, weight_decay=0.01, **options)
    params = {k: xp.asarray(v) for k, v in data.items() if k not in ("X", "Y")}
    states = {k: ar.init(p, cfg) for k, p in params.items()}
    for _ in range(steps):
        grads = _mlp_grads(params, X, Y, xp)
        for k in params:
            params[k], states[k] = ar.step(states[k], grads[k], cfg, params[k], name=k)
        params, states = _persisted(params, states)
    return {k: to_np(v) for k, v in params.items()}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["array_api_strict", "torch", "jax", "dask"])
def test_mlp_loop_matches_numpy_on_every_backend(backend: str, name: str) -> None:
    xp = _load_backend(backend)
    ref = _mlp_loop(name, np, 7)
    got = _mlp_loop(name, xp, 7)
    for k, value in ref.items():
        # float64; the backends' own LAPACK and summation orders, through a few normalised steps: 1e-12 relative
        np.testing.assert_allclose(got[k], value, rtol=1e-12, atol=1e-12 * np.abs(value).max(), err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_mlp_loop_on_dask_fifty_steps(name: str) -> None:
    """The issue's target: 50 steps on dask, a refresh every 3, equal to NumPy to 1e-12, the graph bounded by a
    persist per step (without it AdamW took 192 s)."""
    xp = _load_backend("dask")
    # kernels="reference" on both sides: NumPy's default numba kernels agree with the reference code to rounding,
    # which Hfac's normalisation amplifies to ~3e-11 over 50 steps; the backend is what this compares
    ref = _mlp_loop(name, np, 50, kernels="reference")
    got = _mlp_loop(name, xp, 50, kernels="reference")
    for k, value in ref.items():
        np.testing.assert_allclose(got[k], value, rtol=1e-12, atol=1e-12 * np.abs(value).max(), err_msg=k)


def test_dask_first_refresh_converts_without_dlpack() -> None:
    """The issue's reproduction: dask arrays have no ``__dlpack__``; the first refresh reads them to the host."""
    da = pytest.importorskip("dask.array")
    w = da.from_array(np.ones((4, 6)))
    cfg = ar.make_config("adadiag")
    new_w, state = ar.step(ar.init(w, cfg), w, cfg, w)
    ref_w, ref_state = ar.step(ar.init(np.ones((4, 6)), cfg), np.ones((4, 6)), cfg, np.ones((4, 6)))
    np.testing.assert_array_equal(np.asarray(state.P), ref_state.P)
    np.testing.assert_array_equal(np.asarray(new_w), ref_w)


class _NoLinalg:
    """An array namespace without ``linalg`` (as ndonnx): NumPy's, the ``linalg`` extension hidden."""

    def __getattr__(self, attribute: str) -> Any:
        if attribute == "linalg":
            raise AttributeError(attribute)
        import array_api_compat.numpy as compat_numpy

        return getattr(compat_numpy, attribute)


def test_a_namespace_without_linalg_gets_one_line_before_any_change() -> None:
    xp = _NoLinalg()
    w = np.ones((4, 6))
    cfg = ar.make_config("adadiag")
    state = ar.init(w, cfg, xp=xp)
    P = state.P.copy()
    with pytest.raises(TypeError, match=r"has no linalg, which the refresh of parameter 'w'") as e:
        ar.step(state, w, cfg, w, name="w", xp=xp)
    assert "\n" not in str(e.value)
    np.testing.assert_array_equal(state.P, P)
    assert int(state.count) == 0
    # a family without rotation never asks for linalg
    adamw = ar.make_config("adamw")
    ar.step(ar.init(w, adamw, xp=xp), w, adamw, w, xp=xp)


# ---------------------------------------------------------------------------- hyperparameters per step


def _inputs(shape: tuple[int, ...] = (4, 6), seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal((5, *shape))


@pytest.mark.parametrize("name", NAMES)
def test_weight_decay_and_betas_per_step_equal_a_rebuilt_config(name: str) -> None:
    """``step(weight_decay=, betas=)`` at every step is, bit for bit, ``step`` under ``cfg.replace(...)``."""
    w0, grads = _inputs()
    cfg = ar.make_config(name, lr=1e-2, update_freq=2)
    schedule = [(0.1 * k, (0.8 + 0.02 * k, 0.99 - 0.001 * k)) for k in range(len(grads))]
    w_a, s_a = w0, ar.init(w0, cfg)
    w_b, s_b = w0, ar.init(w0, cfg)
    for g, (wd, betas) in zip(grads, schedule, strict=True):
        w_a, s_a = ar.step(s_a, g, cfg, w_a, weight_decay=wd, betas=betas)
        w_b, s_b = ar.step(s_b, g, cfg.replace(weight_decay=wd, betas=betas), w_b)
    np.testing.assert_array_equal(w_a, w_b)
    assert not np.array_equal(w_a, ar.replay(name, w0, grads, lr=1e-2, update_freq=2)[-1])  # the values took effect


def test_weight_decay_per_step_under_jit_equals_rebuilding_the_config(jax_x64: Any) -> None:
    """A traced ``weight_decay`` changed every step under ``jax.jit`` equals the config rebuilt each step (static),
    bit for bit; no recompilation for the traced one."""
    import jax
    import jax.numpy as jnp

    w0, grads = _inputs()
    cfg = ar.make_config("adadiag", lr=1e-2)
    traced = jax.jit(lambda s, g, w, wd: ar.update(s, g, cfg, w, weight_decay=wd, refreshed=True))
    rebuilt = jax.jit(lambda s, g, w, c: ar.update(s, g, c, w, refreshed=True), static_argnums=3)
    w = jnp.asarray(w0)
    state = ar.refresh_basis(ar.init(w, cfg), jnp.asarray(grads[0]), cfg)
    for k, g in enumerate(grads):
        wd = 0.05 * (k + 1)
        d_traced, s_traced = traced(state, jnp.asarray(g), w, jnp.asarray(wd))
        d_rebuilt, s_rebuilt = rebuilt(state, jnp.asarray(g), w, cfg.replace(weight_decay=wd))
        np.testing.assert_array_equal(np.asarray(d_traced), np.asarray(d_rebuilt))
        np.testing.assert_array_equal(np.asarray(s_traced.M), np.asarray(s_rebuilt.M))
        w, state = w + d_traced, s_traced
    assert traced._cache_size() == 1


def test_weight_decay_traced_in_float32_computes_in_float32(jax_x64: Any) -> None:
    """A float64 traced ``lambda`` does not promote a float32 step (it is cast to the state dtype)."""
    import jax
    import jax.numpy as jnp

    w = jnp.ones((4, 6), jnp.float32)
    cfg = ar.make_config("adamw")
    state = ar.init(w, cfg)
    delta, new = jax.jit(lambda wd: ar.update(state, w, cfg, w, weight_decay=wd))(jnp.asarray(0.1, jnp.float64))
    assert delta.dtype == jnp.float32 and new.M.dtype == jnp.float32


@pytest.mark.parametrize(
    ("keyword", "value", "match"),
    [
        ("lr", float("nan"), "lr must be a finite number >= 0"),
        ("lr", -1.0, "lr must be a finite number >= 0"),
        ("lr", np.float32("inf"), "lr must be a finite number >= 0"),
        ("weight_decay", float("nan"), "weight_decay must be a finite number >= 0"),
        ("weight_decay", -0.1, "weight_decay must be a finite number >= 0"),
        ("betas", (0.9, 1.0), r"beta2 must be in \[0, 1\)"),
        ("betas", (0.0, 0.999), "would turn the first moment off"),
    ],
)
def test_invalid_step_hyperparameters_are_refused_with_nothing_changed(keyword: str, value: Any, match: str) -> None:
    w, grads = _inputs()
    cfg = ar.make_config("adadiag")
    state = ar.init(w, cfg)
    P = state.P.copy()
    with pytest.raises(ValueError, match=match):
        ar.step(state, grads[0], cfg, w, **{keyword: value})
    with pytest.raises(ValueError, match=match):
        ar.update(state, grads[0], cfg, w, **{keyword: value})
    with pytest.raises(ValueError, match=match):
        ar.multi_step([state], [grads[0]], cfg, [w], **{keyword: value})
    engine = ar.Engine([w], cfg)
    with pytest.raises(ValueError, match=match):
        engine.step([grads[0]], [w], **{keyword: value})
    np.testing.assert_array_equal(state.P, P)
    assert int(state.count) == 0 and engine.count(0) == 0
    np.testing.assert_array_equal(w, _inputs()[0])


def test_only_numeric_hyperparameters_change_per_step() -> None:
    from adadiag_ref.config import step_config

    cfg = ar.make_config("adadiag")
    with pytest.raises(ValueError, match="sides cannot change per step"):
        step_config(cfg, sides=2)
    assert step_config(cfg) is cfg and step_config(cfg, weight_decay=None) is cfg


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adafactor", "hfacdiag"])
def test_engine_step_weight_decay_equals_an_engine_built_with_it(name: str) -> None:
    rng = np.random.default_rng(5)
    shapes = [(4, 6), (6, 4), (7,)]
    params_a = [rng.standard_normal(s) for s in shapes]
    params_b = [p.copy() for p in params_a]
    cfg = ar.make_config(name, lr=1e-2, update_freq=2)
    engine = ar.Engine(params_a, cfg)
    states_b = [ar.init(p, cfg) for p in params_b]
    for k in range(4):
        grads = [rng.standard_normal(s) for s in shapes]
        wd = 0.1 * (k + 1)
        engine.step(grads, params_a, weight_decay=wd, betas=(0.85, 0.99))
        rebuilt = cfg.replace(weight_decay=wd, betas=(0.85, 0.99))
        params_b, states_b = ar.multi_step(states_b, grads, rebuilt, params_b, count=k)
    for a, b in zip(params_a, params_b, strict=True):
        # the engine's direct kernels (built for cfg) stand aside for such a step: the gathered path, the same
        # formulas in the same order as the rebuilt config's
        np.testing.assert_array_equal(a, b)


def test_engine_config_cannot_be_replaced_silently() -> None:
    w = np.ones((4, 6))
    cfg = ar.make_config("adamw")
    engine = ar.Engine([w], cfg)
    with pytest.raises(AttributeError, match=r"weight_decay= .* to Engine.step"):
        engine.cfg = dataclasses.replace(cfg, weight_decay=0.5)
    assert engine.cfg is cfg


# ------------------------------------------------------------------------------- errors naming the parameter


def test_a_transposed_gradient_names_the_parameter_in_one_line() -> None:
    w = np.ones((8, 16))
    cfg = ar.make_config("adadiag")
    state = ar.init(w, cfg)
    for call in (
        lambda: ar.step(state, w.T, cfg, w, name="fc1.weight"),
        lambda: ar.update(state, w.T, cfg, w, name="fc1.weight"),
        lambda: ar.check_inputs(state, w.T, cfg, w, name="fc1.weight"),
    ):
        with pytest.raises(ValueError, match=r"parameter 'fc1.weight': gradient shape \(16, 8\)") as e:
            call()
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"parameter 'fc1\.weight': gradient dtype float32"):
        ar.step(state, w.astype(np.float32), cfg, w, name="fc1.weight")


def test_multi_step_lists_missing_and_extra_keys() -> None:
    cfg = ar.make_config("adamw")
    params = {"a": np.ones((2, 3)), "b": np.ones(3)}
    states = {k: ar.init(p, cfg) for k, p in params.items()}
    with pytest.raises(ValueError, match=r"grads must have the parameters' keys: it lacks 'b'; it has 'c', which is"):
        ar.multi_step(states, {"a": params["a"], "c": params["b"]}, cfg, params)
    with pytest.raises(ValueError, match=r"states must have the parameters' keys: it lacks 'a'"):
        ar.multi_step({"b": states["b"]}, params, cfg, params)


def test_mixed_backends_are_refused_at_the_first_call(jax_x64: Any) -> None:
    import jax.numpy as jnp
    import torch

    cfg = ar.make_config("adadiag")
    w = np.ones((4, 6))
    jw = jnp.asarray(w)
    state = ar.init(jw, cfg)._replace(P=np.eye(4))  # a NumPy basis beside a JAX parameter
    with pytest.raises(TypeError, match=r"parameter 'fc' is a jax array but its optimizer state's 'P' is a numpy"):
        ar.step(state, jw, cfg, jw, name="fc")
    torch_state = ar.init(torch.ones(4, 6, dtype=torch.float64), cfg)
    with pytest.raises(TypeError, match="parameter 'fc' is a numpy array but its optimizer state's 'count' is a torch"):
        ar.step(torch_state, w, cfg, w, name="fc")
    with pytest.raises(TypeError, match="parameter 'fc' is a numpy array but its gradient a torch array"):
        ar.step(ar.init(w, cfg), torch.ones(4, 6, dtype=torch.float64), cfg, w, name="fc")


def test_a_state_of_another_dtype_than_state_dtype_is_refused() -> None:
    w = np.ones((4, 6))
    state64 = ar.init(w, ar.make_config("adadiag"))
    cfg32 = ar.make_config("adadiag", state_dtype="float32")
    with pytest.raises(ValueError, match=r"parameter 'w': the optimizer state holds float64.*state_dtype='float32'"):
        ar.step(state64, w, cfg32, w, name="w")


def test_xp_accepts_the_plain_modules() -> None:
    torch = pytest.importorskip("torch")
    cfg = ar.make_config("adadiag")
    w = np.random.default_rng(0).standard_normal((4, 6))
    ref, _ = ar.step(ar.init(w, cfg, xp=np), w, cfg, w, xp=np)
    tw = torch.asarray(w)
    got, _ = ar.step(ar.init(tw, cfg, xp=torch), tw, cfg, tw, xp=torch)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12)
    route = ar.explain_route(cfg, (4, 6), torch.float64, xp=torch)
    assert "torch" in route.group or route.entrywise
    np.testing.assert_array_equal(ar.rotate(w, np.eye(4), xp=np), w)
    np.testing.assert_array_equal(ar.unrotate(w, None, np.eye(6), xp=np), w)


# ------------------------------------------------------------------------------------ one's own jitted loop


def _jitted_loop(cfg: Any, w0: np.ndarray, grads: np.ndarray) -> Any:
    """An embedder's jitted step from the public toolkit: the traced refresh, then the traceable update."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def train_step(state: Any, g: Any, w: Any) -> Any:
        (state,), (refreshed,) = ar.refresh_when_due([state], [g], cfg, names=["w"])
        delta, state = ar.update(state, g, cfg, w, refreshed=refreshed)
        return w + delta, state

    w = jnp.asarray(w0)
    state = ar.init(w, cfg)
    for g in grads:
        w, state = train_step(state, jnp.asarray(g), w)
    assert train_step._cache_size() == 1  # jitted once: the refresh is a lax.cond, not a Python branch
    return w


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp", "hfacdiag", "adamw"])
def test_the_public_jit_toolkit_reproduces_eager_step(jax_x64: Any, name: str) -> None:
    w0, grads = _inputs()
    cfg = ar.make_config(name, lr=1e-2, update_freq=2)
    eager = ar.replay(name, w0, grads, lr=1e-2, update_freq=2)[-1]
    # float64; XLA's GEMMs against NumPy's BLAS through five normalised steps: 1e-12 relative
    np.testing.assert_allclose(np.asarray(_jitted_loop(cfg, w0, grads)), eager, rtol=1e-12, atol=1e-12)


def test_traced_refresh_due_is_refresh_due(jax_x64: Any) -> None:
    import jax.numpy as jnp

    for period in (None, 1, 3):
        cfg = ar.make_config("adadiag", update_freq=period)
        for count in range(8):
            assert bool(ar.traced_refresh_due(jnp.asarray(count), cfg)) == ar.refresh_due(count, cfg)


def test_eager_functions_under_jit_point_to_the_toolkit(jax_x64: Any) -> None:
    import jax
    import jax.numpy as jnp

    w = jnp.ones((4, 6))
    cfg = ar.make_config("adadiag")
    state = ar.init(w, cfg)
    for function in (
        lambda s, g: ar.step(s, g, cfg, w),
        lambda s, g: ar.refresh_basis(s, g, cfg),
        lambda s, g: ar.check_inputs(s, g, cfg, w),
    ):
        with pytest.raises(TypeError, match=r"is eager .* adadiag_ref\.refresh_when_due") as e:
            jax.jit(function)(state, w)
        assert "\n" not in str(e.value)


def test_states_load_with_torch_weights_only(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    types_added = ar.register_torch_safe_globals()
    assert {ar.AdamState, ar.AdafactorState, ar.HfacState} <= set(types_added)
    w = torch.randn(4, 6, dtype=torch.float64)
    for name in ("adadiag_pp", "hfacdiag", "adafactor"):
        cfg = ar.make_config(name)
        _, state = ar.step(ar.init(w, cfg), w, cfg, w)
        torch.save(state, tmp_path / "state.pt")
        loaded = torch.load(tmp_path / "state.pt", weights_only=True)
        assert type(loaded) is type(state)
        for a, b in zip(loaded, state, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_the_warnings_and_route_types_are_exported() -> None:
    from adadiag_ref.optim.core import NonFiniteGradientWarning, SlowRefreshWarning
    from adadiag_ref.optim.engine import Route
    from adadiag_ref.optim.layout import Layout

    assert ar.NonFiniteGradientWarning is NonFiniteGradientWarning and ar.SlowRefreshWarning is SlowRefreshWarning
    assert ar.Route is Route and ar.Layout is Layout
    assert isinstance(ar.explain_route(ar.make_config("adadiag"), (4, 6)), ar.Route)
