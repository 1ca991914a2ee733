"""A family defined in this file alone, registered from outside the package, runs through every surface.

The family is heavy-ball momentum in the rotated space ("HeavyBall", and "HeavyBallDiag" with ``G~ = P^T G``):

    M_t = EMA_b1[G~],   U~ = M_t;      continuous: W' = -P M Q^T,  M' = a (G~ - M)
    H = L + <M, M> / (2a),             dH/dt = -<M, M>  (without weight decay)

It goes through ``step``, ``replay``, ``update_in_place``, the torch adapter, the optax adapter and the ODE
checker with no library file edited (``docs/extending.md``), and each surface is compared with a loop written
here straight from the equations above.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref.config import BaseConfig, OptimizerSpec
from adadiag_ref.optim.families import FAMILIES, FamilySpec, Flow, FlowField, register_family
from adadiag_ref.optim.schedules import beta_hat

# ----------------------------------------------------------------------------- the family, as a user writes it


@dataclass(frozen=True)
class HeavyBallConfig(BaseConfig):
    """Heavy-ball momentum; only ``betas[0]`` is used."""

    family: str = field(default="heavyball", init=False)


class HeavyBallState(NamedTuple):
    count: Any
    P: Any
    Q: Any
    M: Any
    param_shape: Any = None


class HeavyBallODEState(NamedTuple):
    W: Any
    M: Any


def moment_shapes(cfg: BaseConfig, m: int, n: int) -> dict[str, tuple[int, ...] | None]:
    return {"M": (m, n)}


def direction(state: HeavyBallState, g: Any, t: Any, cfg: BaseConfig, xp: Any) -> tuple[Any, dict[str, Any]]:
    b1_t = beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction)
    M = b1_t * state.M + (1.0 - b1_t) * g
    return M, {"M": M}


FLOW = Flow(
    state_type=HeavyBallODEState,
    default_eps=1e-8,
    max_sides=1,
    fields=lambda c: ("W", "M"),
    update_order=lambda c: (("M",), ("W",)),
    vector_field=lambda c, s, G, xp: FlowField(lambda: s.M, {"M": lambda: c.a * (G - s.M)}),
    hamiltonian=lambda c, s, loss, xp: loss + xp.sum(s.M * s.M) / (2 * c.a),
    hamiltonian_rate=lambda c, s, G, xp: -xp.sum(s.M * s.M),
    initial_moments=lambda c, G0, zero, f, xp: {"M": xp.zeros_like(G0) if zero else G0},
)

SPEC = FamilySpec("heavyball", HeavyBallConfig, HeavyBallState, moment_shapes, direction, flow=FLOW)
OPTIMIZERS = {
    "heavyball": OptimizerSpec(HeavyBallConfig, 0, "HeavyBall"),
    "heavyballdiag": OptimizerSpec(HeavyBallConfig, 1, "HeavyBallDiag"),
}


@pytest.fixture(scope="module", autouse=True)
def registered() -> Any:
    """Registered for this module only: the library's tables are restored afterwards."""
    register_family(SPEC, OPTIMIZERS)
    yield
    del FAMILIES["heavyball"]
    for name in OPTIMIZERS:
        del ar.OPTIMIZERS[name]


# ----------------------------------------------------------------------------- a loop straight from the equations


def reference_trajectory(name: str, w0: np.ndarray, grads: np.ndarray, lr: float, b1: float, T: int) -> np.ndarray:
    """W_{t+1} = W_t - lr P M_t (P refreshed from G_t at t = 1, 1 + T, ...; the left singular vectors, signs
    fixed by the library's canonical SVD), M_t = b1_hat M_{t-1} + (1 - b1_hat) P^T G_t."""
    w, M, P, out = w0.copy(), np.zeros_like(w0), np.eye(w0.shape[0]), []
    for k, g in enumerate(grads):
        t = k + 1
        if name == "heavyballdiag" and (t == 1 or (t - 1) % T == 0):
            P = ar.canonical_svd(g, compute_q=False).P
        b1_hat = b1 * (1 - b1 ** (t - 1)) / (1 - b1**t)
        M = b1_hat * M + (1 - b1_hat) * (P.T @ g)
        w = w - lr * (P @ M)
        out.append(w)
    return np.stack(out)


def _stream(seed: int = 0, steps: int = 6, shape: tuple[int, int] = (4, 7)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal((steps, *shape))


KW = {"lr": 0.05, "betas": (0.8, 0.999), "update_freq": 3}
# float64 throughout; the library's loop and this one differ only in summation order inside the products
RTOL, ATOL = 1e-12, 1e-13


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_and_replay_follow_the_equations(name: str) -> None:
    w0, grads = _stream()
    want = reference_trajectory(name, w0, grads, KW["lr"], KW["betas"][0], KW["update_freq"])
    np.testing.assert_allclose(np.asarray(ar.replay(name, w0, grads, **KW)), want, rtol=RTOL, atol=ATOL)
    cfg = ar.make_config(name, **KW)
    state, w = ar.init(w0, cfg), w0
    assert type(state) is HeavyBallState and state.M.shape == (4, 7)
    for k, g in enumerate(grads):
        w, state = ar.step(state, g, cfg, w)
        np.testing.assert_allclose(w, want[k], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_in_place_equals_update(name: str) -> None:
    w0, grads = _stream(1)
    cfg = ar.make_config(name, **KW)
    state = ar.refresh_basis(ar.init(w0, cfg), grads[0], cfg)
    delta, want = ar.update(state, grads[0], cfg, w0, refreshed=True)
    w = w0.copy()
    got = ar.update_in_place(state, grads[0], cfg, w, refreshed=True)
    np.testing.assert_array_equal(w, w0 + delta)
    np.testing.assert_array_equal(got.M, want.M)
    assert got.M is state.M  # the caller's buffer, overwritten


def test_bad_input_is_refused_with_the_state_untouched() -> None:
    w0, grads = _stream(2)
    cfg = ar.make_config("heavyballdiag", **KW)
    state = ar.init(w0, cfg)
    bad = grads[0].copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite gradient"):
        ar.step(state, bad, cfg, w0)
    assert int(state.count) == 0 and not np.any(state.M)
    with pytest.raises(ValueError, match="unknown option"):
        ar.make_config("heavyball", clip_threshold=1.0)


def test_torch_adapter_runs_the_family() -> None:
    torch = pytest.importorskip("torch")
    from adadiag_ref.adapters import pytorch

    w0, grads = _stream(3)
    want = reference_trajectory("heavyballdiag", w0, grads, KW["lr"], KW["betas"][0], KW["update_freq"])
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = pytorch.CoreOptimizer([p], name="heavyballdiag", **KW)
    for k, g in enumerate(grads):
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        np.testing.assert_allclose(p.detach().numpy(), want[k], rtol=RTOL, atol=ATOL)
    assert set(opt.state[p]) == {"step", "P", "M", "param_shape"}
    cls = pytorch.optimizer_class("heavyballdiag")  # the class the registry entry names, made once
    assert cls.__name__ == "HeavyBallDiag" and cls.core_name == "heavyballdiag"
    assert pytorch.optimizer_class("heavyballdiag") is cls and issubclass(cls, pytorch.CoreOptimizer)
    with pytest.raises(ValueError, match="unknown optimizer 'nope'"):
        pytorch.optimizer_class("nope")
    restored = pytorch.CoreOptimizer([p], name="heavyballdiag", **KW)
    restored.load_state_dict(opt.state_dict())  # the flat state dict round-trips through the family's state type
    assert torch.equal(restored.state[p]["M"], opt.state[p]["M"])


@pytest.mark.usefixtures("jax_x64")
def test_optax_adapter_runs_the_family_under_jit() -> None:
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    import jax.numpy as jnp
    from adadiag_ref.adapters import optax as ar_optax

    w0, grads = _stream(4)
    want = reference_trajectory("heavyballdiag", w0, grads, KW["lr"], KW["betas"][0], KW["update_freq"])
    tx = ar_optax.core_alias("heavyballdiag", learning_rate=KW["lr"], betas=KW["betas"], update_freq=3)
    params = jnp.asarray(w0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for k, g in enumerate(grads):
        updates, state = update(jnp.asarray(g), state, params)
        params = params + updates
        np.testing.assert_allclose(np.asarray(params), want[k], rtol=RTOL, atol=ATOL)


@pytest.mark.usefixtures("jax_x64")
def test_optax_adapter_takes_injected_hyperparameters_for_the_family() -> None:
    # traced betas are cast to the state's dtype, which the adapter reads from the registered state (not V or r)
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp
    from adadiag_ref.adapters import optax as ar_optax

    w0, grads = _stream(5)
    want = reference_trajectory("heavyballdiag", w0, grads, KW["lr"], KW["betas"][0], KW["update_freq"])
    tx = optax.inject_hyperparams(ar_optax.core_alias, static_args=("name",))(
        name="heavyballdiag", learning_rate=KW["lr"], b1=KW["betas"][0], update_freq=3
    )
    params = jnp.asarray(w0)
    state = jax.jit(tx.init)(params)
    update = jax.jit(tx.update)
    for k, g in enumerate(grads):
        updates, state = update(jnp.asarray(g), state, params)
        params = params + updates
        np.testing.assert_allclose(np.asarray(params), want[k], rtol=RTOL, atol=ATOL)


def test_the_ode_checker_confirms_its_hamiltonian() -> None:
    from adadiag_ref import ode
    from adadiag_ref.ode.systems import systems

    system = ode.make_system("heavyballdiag", a=1.0)
    assert systems()["heavyballdiag"] == ("heavyball", 1) and system.family == "heavyball"
    problem = ode.make_problem("least_squares")
    result = ode.check(system, problem, "dopri5", t_end=5.0, refresh_period=2.5)
    assert result.verdict == "monotone", result.message
    assert result.max_dhdt <= 0


def test_a_family_without_a_continuous_time_form_is_named_by_the_ode_and_skipped_by_the_report() -> None:
    from adadiag_ref import ode, report

    register_family(dataclasses.replace(SPEC, flow=None), OPTIMIZERS, replace=True)  # undone after the test
    with pytest.raises(ValueError, match=r"optimizer 'heavyballdiag' has no continuous-time form.*docs/extending.md"):
        ode.make_system("heavyballdiag")
    with pytest.raises(ValueError, match="unknown system 'nonesuch'"):
        ode.make_system("nonesuch")
    lines: list[str] = []
    rows = report.ode_summary(out=lines.append, progress=False, t_end=0.5, refresh_period=0.25)
    library = [name for name in ar.OPTIMIZERS if name not in OPTIMIZERS]
    assert [row.optimizer for row in rows] == library  # the library's rows are all there
    for name in OPTIMIZERS:
        (line,) = [x for x in lines if x.startswith(name + " ")]
        assert "skipped" in line and "no continuous-time form" in line, line


def test_registration_is_checked_before_anything_is_written() -> None:
    @dataclass(frozen=True)
    class Other(BaseConfig):
        family: str = field(default="other", init=False)

    before = (dict(FAMILIES), dict(ar.OPTIMIZERS))
    with pytest.raises(ValueError, match="already registered: heavyball"):
        register_family(SPEC, {"fresh": OptimizerSpec(HeavyBallConfig, 0, "Fresh")})
    with pytest.raises(ValueError, match="not the family's name"):
        register_family(FamilySpec("wrong", HeavyBallConfig, HeavyBallState, moment_shapes, direction), {})
    with pytest.raises(ValueError, match="must be a NamedTuple"):
        register_family(FamilySpec("other", Other, HeavyBallODEState, moment_shapes, direction), {})
    other = FamilySpec("other", Other, HeavyBallState, moment_shapes, direction)
    # pytorch.AdamW would otherwise build this family when it is registered before the adapter is imported
    with pytest.raises(ValueError, match="class name 'AdamW' is already the class of optimizer 'adamw'"):
        register_family(other, {"o": OptimizerSpec(Other, 0, "AdamW")})
    with pytest.raises(ValueError, match="class name 'HeavyBall' is already the class of optimizer 'heavyball'"):
        register_family(SPEC, {"heavy": OptimizerSpec(HeavyBallConfig, 0, "HeavyBall")}, replace=True)
    with pytest.raises(ValueError, match="class name 'O' is already the class of optimizer 'o1'"):
        register_family(other, {"o1": OptimizerSpec(Other, 0, "O"), "o2": OptimizerSpec(Other, 1, "O")})
    with pytest.raises(ValueError, match="sides must be 0, 1 or 2"):
        register_family(other, {"o": OptimizerSpec(Other, 3, "O")})
    assert (dict(FAMILIES), dict(ar.OPTIMIZERS)) == before
