"""``batch_dims``: a parameter of shape ``(*B, *S)`` is ``prod(B)`` independent parameters of shape ``S``.

Every test compares a stack with the runs of its matrices one by one: through ``ar.replay`` (NumPy, the owned
step), ``ar.step``, ``ar.multi_step`` on torch tensors (the flat group and ``refresh_bases``), the torch adapter
and the jitted optax aliases; against the loop references of ``tests/reference.py``; and over random shapes.

Tolerance: float64, rtol 1e-12 (``atol = 1e-12 max |W|`` for entries near zero).  On NumPy a stack's bases are
each matrix's own ``canonical_svd`` (``canonical_svd_batch`` does not stack on the host) and its moment update is
the same formulas, so the only differences are the order of a few reductions (``sum`` over the last two axes of a
stack against ``sum`` of one matrix): ~1e-16 relative, as measured (max 1.5e-16 over the eight optimizers).
"""

from __future__ import annotations

import math
import warnings

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference

import adadiag_ref as ar
from adadiag_ref.memory import state_nbytes
from adadiag_ref.optim.core import NonFiniteGradientWarning
from adadiag_ref.optim.families import family_of

NAMES = list(ar.OPTIMIZERS)
RTOL = 1e-12
STEPS, FREQ = 8, 3  # refreshes at t = 1, 4, 7
SHAPES = {"wide": (3, 5), "tall": (5, 3), "square": (4, 4), "conv": (2, 3, 2), "vector": (4,)}
OPTIONS = dict(lr=2e-2, betas=(0.9, 0.99), weight_decay=0.05, update_freq=FREQ)


def _stream(batch: tuple[int, ...], shape: tuple[int, ...], steps: int = STEPS, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((*batch, *shape)), rng.standard_normal((steps, *batch, *shape))


def assert_close(actual, expected, rtol: float = RTOL) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * float(np.max(np.abs(expected))))


def _each(batch: tuple[int, ...]):
    return list(np.ndindex(*batch))


def _separate(name: str, w0: np.ndarray, grads: np.ndarray, batch: tuple[int, ...], **options) -> np.ndarray:
    """The trajectory of every matrix of the stack run alone (``batch_dims=0``), restacked like the stack's."""
    out = np.empty((grads.shape[0], *w0.shape))
    for index in _each(batch):
        out[(slice(None), *index)] = ar.replay(name, w0[index], grads[(slice(None), *index)], **options)
    return out


# ----------------------------------------------------------------------------- the core


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("name", NAMES)
def test_replay_of_a_stack_is_each_matrix_alone(name, shape, kernels):
    """``(E, *S)`` with ``batch_dims=1``: each of the E slices equals its own run through three refreshes, with
    the fast routes allowed (``kernels="auto"``: numba on NumPy, which must decline the stack) or not."""
    w0, grads = _stream((3,), shape)
    got = ar.replay(name, w0, grads, batch_dims=1, kernels=kernels, **OPTIONS)
    assert_close(got, _separate(name, w0, grads, (3,), kernels=kernels, **OPTIONS))


@pytest.mark.parametrize("name", NAMES)
def test_a_stack_matches_the_loop_references(name):
    """Independent of the library's unbatched code: each expert against the paper's loop reference."""
    w0, grads = _stream((2,), (3, 5))
    eps = ar.default_eps(name)
    got = ar.replay(name, w0, grads, batch_dims=1, eps=eps, **OPTIONS)
    for e in range(2):
        want = reference(name, w0[e], list(grads[:, e]), lr=OPTIONS["lr"], betas=OPTIONS["betas"], eps=eps,
                         wd=OPTIONS["weight_decay"], T=FREQ)  # fmt: skip
        assert_close(got[:, e], want)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [(2, 2), (1,)], ids=["batch_dims=2", "E=1"])
def test_two_batch_dims_and_a_single_expert(name, batch):
    w0, grads = _stream(batch, (5, 3), seed=1)
    got = ar.replay(name, w0, grads, batch_dims=len(batch), **OPTIONS)
    assert_close(got, _separate(name, w0, grads, batch, **OPTIONS))


@pytest.mark.parametrize("name", NAMES)
def test_step_carries_the_batch_in_its_state(name):
    """``ar.step`` (not replay's owned step): the state has ``P`` ``(*B, m, m)`` and moments ``(*B, ...)``, and
    equals the separate runs; ``batch_dims=0`` keeps today's rule for the same tensor (one ``E x (d f)`` matrix)."""
    cfg = ar.make_config(name, batch_dims=1, **OPTIONS)
    w0, grads = _stream((4,), (5, 3))
    state, w = ar.init(w0, cfg), w0
    for g in grads:
        w, state = ar.step(state, g, cfg, w, name="experts")
    assert_close(w, _separate(name, w0, grads, (4,), **OPTIONS)[-1])
    single = ar.init(w0[0], ar.make_config(name))
    for field in state._fields[1:-1]:
        value, alone = getattr(state, field), getattr(single, field)
        assert (value is None) == (alone is None), field
        if value is not None:
            assert value.shape == (4, *alone.shape), field
    assert state.param_shape.shape == (0, 4, 5, 3)
    if cfg.sides:
        assert ar.init(w0, ar.make_config(name)).P.shape == (4, 4)  # the default: (4, 15), transposed: m = 4


def test_multi_step_on_torch_stacks_and_refreshes_as_one():
    """``multi_step`` on a device-style backend (torch): the flat group of the Adam family and ``refresh_bases``
    (one stacked decomposition per stack) give each expert what ``multi_step`` gives it as a parameter of its
    own (the separate runs are compared on torch too: ``refresh_bases``' stacked route completes AdaDiag++'s
    ``Q`` of a tall matrix in another null-space basis than NumPy's single SVD, 1.5e-10 apart after 8 steps)."""
    torch = pytest.importorskip("torch")
    for name in ("adadiag_pp", "adafacdiag", "hfacdiag"):
        w0, grads = _stream((3,), (5, 3))
        stacked = ar.make_config(name, batch_dims=1, **OPTIONS)
        params, states = [torch.tensor(w0)], [ar.init(torch.tensor(w0), stacked)]
        alone = ar.make_config(name, **OPTIONS)
        experts = [torch.tensor(w0[e]) for e in range(3)]
        expert_states = [ar.init(p, alone) for p in experts]
        for k in range(STEPS):
            params, states = ar.multi_step(states, [torch.tensor(grads[k])], stacked, params, count=k)
            expert_grads = [torch.tensor(grads[k, e]) for e in range(3)]
            experts, expert_states = ar.multi_step(expert_states, expert_grads, alone, experts, count=k)
        assert_close(params[0].numpy(), np.stack([p.numpy() for p in experts]))


@pytest.mark.parametrize("name", ["adadiag", "adamw", "adafacdiag_pp"])
def test_update_in_place_on_numpy_stack(name):
    """``update_in_place`` of a stack equals ``update``."""
    cfg = ar.make_config(name, batch_dims=1, **OPTIONS)
    w0, grads = _stream((3,), (4, 6))
    state = ar.refresh_basis(ar.init(w0, cfg), grads[0], cfg)
    delta, want = ar.update(state, grads[0], cfg, w0, refreshed=True)
    w = w0.copy()
    got = ar.update_in_place(state, grads[0], cfg, w, refreshed=True)
    assert_close(w, w0 + delta)
    for field in family_of(cfg).moment_fields:
        assert_close(getattr(got, field), getattr(want, field))


def test_a_stack_refreshes_as_one_unit_under_the_failure_policy():
    """A NaN in one expert's gradient (``check=False``): every expert keeps its previous basis, with the warning."""
    cfg = ar.make_config("adadiag", batch_dims=1, **OPTIONS)
    w0, grads = _stream((3,), (3, 5))
    state = ar.refresh_basis(ar.init(w0, cfg), grads[0], cfg)
    bad = grads[1].copy()
    bad[1, 0, 0] = np.nan
    with pytest.warns(NonFiniteGradientWarning, match="NaN or Inf"):
        kept = ar.refresh_basis(state, bad, cfg)
    assert kept.P is state.P
    with pytest.raises(ValueError, match="left unchanged"):
        ar.refresh_basis(state, bad, cfg, on_nonfinite="raise")


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    batch=st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple),
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple),
    seed=st.integers(0, 2**16),
)
def test_property_any_stack_is_its_matrices(name, batch, shape, seed):
    w0, grads = _stream(batch, shape, steps=5, seed=seed)
    options = dict(OPTIONS, update_freq=2)
    got = ar.replay(name, w0, grads, batch_dims=len(batch), **options)
    assert_close(got, _separate(name, w0, grads, batch, **options))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("value", [-1, 1.5, True, "1", None])
def test_batch_dims_must_be_a_non_negative_int(value):
    with pytest.raises(ValueError, match="batch_dims must be an int >= 0"):
        ar.make_config("adadiag", batch_dims=value)


def test_a_parameter_with_fewer_dimensions_than_batch_dims_is_refused():
    cfg = ar.make_config("adadiag", batch_dims=2)
    with pytest.raises(ValueError, match=r"batch_dims=2 needs a parameter with at least 2 dimensions.*\(4,\)"):
        ar.init(np.zeros(4), cfg)
    state = ar.init(np.zeros((2, 4)), cfg)
    before = {f: None if v is None else np.array(v) for f, v in zip(state._fields, state, strict=True)}
    with pytest.raises(ValueError, match="parameter 'bias' with at least 2 dimensions"):
        ar.step(state, np.ones(4), cfg, np.zeros(4), name="bias")
    for f, v in zip(state._fields, state, strict=True):
        np.testing.assert_array_equal(v, before[f])
    with pytest.raises(ValueError, match="batch_dims"):
        ar.replay("adamw", np.zeros(3), np.zeros((2, 3)), lr=0.1, batch_dims=2)


def test_the_default_is_unchanged_and_left_out_of_golden_manifests():
    from adadiag_ref.golden.format import config_to_dict

    assert ar.make_config("adadiag").batch_dims == 0
    assert "batch_dims" not in config_to_dict(ar.make_config("adadiag"))
    assert config_to_dict(ar.make_config("adadiag", batch_dims=1))["batch_dims"] == 1


# ----------------------------------------------------------------------------- memory


def _paper_elements(name: str, m: int, n: int, momentum: bool = True) -> int:
    """The paper's memory table per ``m x n`` matrix (m <= n): moments plus bases, in elements."""
    return {
        "adamw": 2 * m * n,
        "adadiag": 2 * m * n + m * m,
        "adadiag_pp": 2 * m * n + m * m + n * n,
        "adafactor": (m * n if momentum else 0) + m + n,
        "adafacdiag": (m * n if momentum else 0) + m + n + m * m,
        "adafacdiag_pp": (m * n if momentum else 0) + m + n + m * m + n * n,
        "hfac": 2 * (m + n),
        "hfacdiag": 2 * (m + n) + m * m,
    }[name]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(8, 16, 40), (8, 40, 16), (2, 3, 16, 40)])
def test_memory_counts_each_matrix_of_a_stack(name, shape):
    batch_dims = len(shape) - 2
    m, n = sorted(shape[-2:])
    options = {"momentum": False} if "fac" in name and "hfac" not in name else {}
    got = state_nbytes([shape], name, dtype="bf16", rule="all", batch_dims=batch_dims, **options)
    want = math.prod(shape[:batch_dims]) * _paper_elements(name, m, n, momentum=not options) * 2
    assert got == want


# ----------------------------------------------------------------------------- adapters


@pytest.mark.parametrize("name", NAMES)
def test_torch_param_group_with_batch_dims(name):
    """Experts ``(E, d, f)`` in a group with ``batch_dims=1`` beside an ordinary group: each expert equals its
    own optimizer, on the engine's route and on the per-parameter one (a parameter subclass, which no engine
    steps); a checkpoint round-trips."""
    torch = pytest.importorskip("torch")
    from adadiag_ref.adapters import pytorch as at

    cls = at.OPTIMIZER_CLASSES[name]
    options = dict(lr=OPTIONS["lr"], betas=OPTIONS["betas"], weight_decay=0.05, update_freq=FREQ)
    w0, grads = _stream((3,), (5, 3))
    v0, vgrads = _stream((), (4, 6), seed=3)

    class Tagged(torch.nn.Parameter):  # not plain: update_in_place, not an engine
        pass

    for kind in (torch.nn.Parameter, Tagged):
        experts, dense = kind(torch.tensor(w0)), kind(torch.tensor(v0))
        opt = cls([{"params": [experts], "batch_dims": 1}, {"params": [dense]}], **options)
        for k in range(STEPS):
            if k == 5:  # resume from a checkpoint, between refreshes
                saved = opt.state_dict()
                opt = cls([{"params": [experts], "batch_dims": 1}, {"params": [dense]}], **options)
                opt.load_state_dict(saved)
            experts.grad, dense.grad = torch.tensor(grads[k]), torch.tensor(vgrads[k])
            opt.step()
        assert opt.state[experts]["M" if "M" in opt.state[experts] else "r"].shape[0] == 3
        for e in range(3):
            alone = torch.nn.Parameter(torch.tensor(w0[e]))
            single = cls([alone], **options)
            for k in range(STEPS):
                alone.grad = torch.tensor(grads[k, e])
                single.step()
            assert_close(experts.detach()[e].numpy(), alone.detach().numpy())
        # replay on torch tensors: the same SVD library (a two-sided Q's null-space completion is LAPACK's own)
        assert_close(dense.detach().numpy(), ar.replay(name, torch.tensor(v0), torch.tensor(vgrads), **OPTIONS)[-1])


def test_torch_refuses_a_parameter_with_fewer_dimensions_naming_it():
    torch = pytest.importorskip("torch")
    from adadiag_ref.adapters import pytorch as at

    bias = torch.nn.Parameter(torch.zeros(4))
    opt = at.AdaDiag([{"params": [bias], "param_names": ["experts.bias"], "batch_dims": 2}])
    bias.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"parameter 'experts\.bias' with at least 2 dimensions"):
        opt.step()
    assert not opt.state and torch.equal(bias.detach(), torch.zeros(4))


@pytest.mark.parametrize("name", NAMES)
def test_optax_alias_with_batch_dims_under_jit(name):
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    import jax.numpy as jnp
    from adadiag_ref.adapters import optax as ao

    def run(tx, w, gs):
        params, state = {"w": jnp.asarray(w)}, tx.init({"w": jnp.asarray(w)})
        update = jax.jit(tx.update)
        for g in gs:
            updates, state = update({"w": jnp.asarray(g)}, state, params)
            params = jax.tree.map(lambda p, u: p + u, params, updates)
        return params, state

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        w0, grads = _stream((3,), (5, 3))
        options = dict(weight_decay=0.05, update_freq=FREQ)
        params, state = run(ao.ALIASES[name](OPTIONS["lr"], 0.9, 0.99, batch_dims=1, **options), w0, grads)
        # each expert against its own optax run (jnp against jnp: AdaDiag++ on a tall matrix amplifies the
        # rounding of NumPy's and XLA's GEMMs by 1/eps in its null-space entries, 5e-11 between optax and replay
        # for one (5, 3) matrix alone)
        for e in range(3):
            alone, _ = run(ao.ALIASES[name](OPTIONS["lr"], 0.9, 0.99, **options), w0[e], grads[:, e])
            assert_close(params["w"][e], alone["w"])
        core = ao.core_states(state[0], params, batch_dims=1)["w"]
        want = ar.init(w0, ar.make_config(name, batch_dims=1))
        assert [None if v is None else v.shape for v in core] == [None if v is None else v.shape for v in want]
        with pytest.raises(ValueError, match=r"parameter \"\['bias'\]\" with at least 2 dimensions"):
            ao.ALIASES[name](0.1, batch_dims=2).init({"bias": jnp.zeros(4)})
    finally:
        jax.config.update("jax_enable_x64", previous)


def test_warnings_do_not_leak():
    """The stacked refresh raises no warning of its own on a regular gradient."""
    cfg = ar.make_config("adadiag_pp", batch_dims=1)
    w0, grads = _stream((2,), (3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ar.refresh_basis(ar.init(w0, cfg), grads[0], cfg)


@pytest.mark.parametrize("name", ["adadiag_pp", "adafacdiag", "hfacdiag"])
def test_every_backend_runs_a_stack(xp, name):
    """On each array-API backend (the reference code's per-matrix statistics, the stacked refresh through
    ``canonical_svd_batch``: one stacked decomposition on torch and JAX) each matrix of the stack equals its own
    run on that backend (the backends' SVDs complete AdaDiag++'s null space differently, 1.5e-10 apart, so
    each is compared with itself)."""
    from conftest import to_np

    w0, grads = _stream((2,), (5, 3), steps=5)
    options = dict(OPTIONS, update_freq=2)
    got = to_np(ar.replay(name, xp.asarray(w0), xp.asarray(grads), batch_dims=1, **options))
    for e in range(2):
        alone = ar.replay(name, xp.asarray(w0[e, ...]), xp.asarray(grads[:, e, ...]), **options)
        assert_close(got[:, e], to_np(alone))
