"""The multi-parameter engine (``adadiag_ref.Engine``, issue 31) against per-parameter ``ar.step``, and its device
proxies on ``array_api_strict`` (:mod:`adadiag_ref.perf.traffic`: a host conversion is a synchronisation on a GPU,
a namespace call a kernel launch).

* every optimizer, float64 and float32, on NumPy, ``array_api_strict`` and CPU torch, over a LLaMA-like set of
  shapes (wide, tall, square, 1-D, conv, 0-D; two of each matrix shape, so that the rotation stacks hold
  several matrices), refreshes at t = 1 and t = 4: the parameters and states of ``ar.step``;
* a step without refresh converts at most once (the finiteness verdict) with the defaults, never with
  ``check=False``;
* the namespace calls of a step without refresh do not depend on the number of layers, for every family (the
  factored ones step one stack per parameter shape);
* a non-finite gradient names its parameter and leaves every state and parameter as it was;
* ``routes()`` says which code runs; ``from_states`` takes states over; ``bench --gpu``'s CuPy rows run the engine;
* the group kernels (NumPy, numba): a group without rotation stepped in place, a rotated group's tail written
  through the parameters' addresses, nothing gathered but the rotated gradients: ``ar.step``'s bits for any
  shapes, chunk sizes and hyperparameters (hypothesis); snapshots, aliasing, strided views, an array ``lr`` and
  ``in_place=False`` handled; the NumPy GEMM phase spread over threads with the same bits.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
from conftest import _load_backend
from hypothesis import given
from hypothesis import strategies as st

import adadiag_ref as ar
from adadiag_ref._xp import to_numpy
from adadiag_ref.perf.traffic import count_traffic

xs = pytest.importorskip("array_api_strict")

OPTIMIZERS = list(ar.OPTIMIZERS)
ENTRYWISE = [name for name in OPTIMIZERS if ar.make_config(name).family == "adam"]
# one LLaMA block in miniature: attention (square), up (wide), down (tall), a norm (1-D), a conv kernel, a scalar
BLOCK = [(8, 8), (8, 20), (20, 8), (20,), (4, 2, 3, 3), ()]
SHAPES = BLOCK + BLOCK[:3]  # a second layer's matrices: stacks of two per work shape
VIEW_CALLS = {"reshape", "__getitem__", "astype", "matrix_transpose"}  # no kernel: views or same-dtype no-ops


def _kernels_available() -> bool:
    from adadiag_ref import _kernels

    return bool(_kernels.AVAILABLE)


def _strict(a: np.ndarray) -> Any:
    return xs.asarray(a.copy())  # its own memory: array_api_strict wraps a NumPy array without copying it


def _torch(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(a.copy())


BACKENDS = {"numpy": lambda a: a.copy(), "strict": _strict, "torch": _torch}


def _stream(shapes: list[tuple[int, ...]], dtype: Any, steps: int, seed: int = 0) -> tuple[list, list]:
    """Parameters and ``steps`` gradient lists (host arrays); the third step's gradients zero."""
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(steps)]
    grads[2] = [np.zeros_like(g) for g in grads[2]]
    return params, grads


def _assert_close(got: Any, want: Any, exact: bool, dtype: Any, rtol: float | None = None) -> None:
    got, want = to_numpy(got), to_numpy(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    if exact:
        np.testing.assert_array_equal(got, want)
    else:  # a fused kernel's rounding (float32: a few ulps of the moments carried through U~ and the GEMMs)
        rtol = rtol if rtol is not None else 1e-12 if np.dtype(dtype) == np.float64 else 1e-5
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(float(np.max(np.abs(want), initial=0)), 1e-30))


def _assert_states(got: Any, want: Any, exact: bool, dtype: Any, rtol: float | None = None) -> None:
    assert type(got) is type(want)
    assert int(got.count) == int(want.count)
    for field in got._fields[1:-1]:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert tuple(a.shape) == tuple(b.shape), field
            _assert_close(a, b, exact, dtype, rtol)


def _in_lockstep(engine: Any, params: list, host_params: list, stream: list, cfg: Any, convert: Any) -> tuple:
    """Every step of ``stream`` by ``engine`` (in place into ``params``) and by per-parameter ``ar.step`` from the
    same ``host_params``; returns the reference's parameters and states."""
    singles = [convert(p) for p in host_params]
    states = [ar.init(w, cfg) for w in singles]
    for k, grads in enumerate(stream):
        returned = engine.step([convert(g) for g in grads], params)
        assert all(r is p for r, p in zip(returned, params, strict=True))  # in place
        pairs = [ar.step(s, convert(g), cfg, w, count=k) for s, g, w in zip(states, grads, singles, strict=True)]
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    return singles, states


# ----------------------------------------------------------------------------- the results of ar.step


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_engine_equals_step_per_parameter(name: str, dtype: Any, backend: str) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    convert = BACKENDS[backend]
    kernels = "auto" if backend == "numpy" else "reference"  # NumPy: the numba kernels on both sides
    cfg = ar.make_config(name, update_freq=3, weight_decay=0.1, kernels=kernels)
    host_params, stream = _stream(SHAPES, dtype, steps=5)
    engine_params = [convert(p) for p in host_params]
    engine = ar.Engine(engine_params, cfg)
    singles, states = _in_lockstep(engine, engine_params, host_params, stream, cfg, convert)
    # bit for bit on array_api_strict and CPU torch (the reference's arithmetic on both sides; in host memory the
    # engine's GEMMs are per matrix, as rotation.rotate's) and for the Adam family on NumPy, whose numba kernels
    # compute each entry with the reference's expressions in its order (and NumPy's matmul over a stack calls BLAS
    # per matrix); to rounding for Adafactor and Hfac on NumPy (their kernels sum the factored statistics in
    # another order than the reference ar.step)
    exact = backend != "numpy" or cfg.family == "adam"
    for i, (w, want) in enumerate(zip(engine_params, singles, strict=True)):
        _assert_close(w, want, exact, dtype)
        _assert_states(engine.state(i), states[i], exact, dtype)
        assert engine.count(i) == 5


# a 2 x 3 matrix first puts every later block's first entry off a fresh tensor's 64-byte alignment
OFF_ALIGNMENT = [(2, 3), (8, 8), (8, 8), (8, 20), (20, 8), (20, 8), (5, 7), (5, 7), (7,)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_cpu_torch_blocks_off_alignment_step_like_the_core_with_one_copy_per_block(
    name: str, dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU torch the GEMMs of a small rotation block whose first entry is off a fresh tensor's alignment (MKL
    rounds otherwise there) read and write the block's own aligned arrays, one copy per block: ``ar.step``'s bits,
    refresh steps included, and no copy of a matrix whose size is a multiple of 64 bytes (each was copied apart,
    as it was used, before)."""
    pytest.importorskip("torch")
    from adadiag_ref.optim import engine as engine_module

    copied: Counter[tuple[int, ...]] = Counter()
    aligned_copy = engine_module._aligned_copy

    def counting(x: Any) -> Any:
        assert x.data_ptr() % 64, "a matrix at a fresh tensor's alignment is its own GEMM operand, not copied"
        copied[tuple(x.shape)] += 1
        return aligned_copy(x)

    monkeypatch.setattr(engine_module, "_aligned_copy", counting)
    cfg = ar.make_config(name, update_freq=3, weight_decay=0.1, kernels="reference")
    host_params, stream = _stream(OFF_ALIGNMENT, dtype, steps=5)
    params = [_torch(p) for p in host_params]
    engine = ar.Engine(params, cfg)
    singles, states = _in_lockstep(engine, params, host_params, stream, cfg, _torch)
    for i, want in enumerate(singles):
        _assert_close(params[i], want, True, dtype)
        _assert_states(engine.state(i), states[i], True, dtype)
    assert not {shape: n for shape, n in copied.items() if 4 * shape[0] * shape[1] % 64 == 0}, copied
    assert copied, "the 5 x 7 matrices (35 entries) lie off the alignment in their own block too: copied apart"


def _lazily_negated(g: Any) -> Any:
    import torch

    return torch._neg_view(-g)  # the values of g; its memory holds -g, to be negated as it is read


def _not_contiguous(g: Any) -> Any:
    return g.t().contiguous().t() if g.ndim == 2 else g[None].expand(2, *g.shape)[1]  # a 1-d one: stride 0 ahead


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("odd", [_lazily_negated, _not_contiguous], ids=["negated-view", "not-contiguous"])
@pytest.mark.parametrize("name", ["adamw", "adadiag"])
def test_cpu_torch_group_kernels_read_by_address_only_gradients_stored_as_they_are(name: str, odd: Any,
                                                                                  dtype: Any) -> None:  # fmt: skip
    """The group kernels read a CPU tensor's memory by address, so a gradient whose memory does not hold its values
    in order (a lazily negated view, a non-contiguous one) among plain ones sends the step another way: each
    step equals the step with every gradient materialised, bit for bit, and reads no memory as values."""
    pytest.importorskip("torch")
    if not _kernels_available():
        pytest.skip("numba is not installed: no group kernels")
    cfg = ar.make_config(name, update_freq=2, weight_decay=0.1)
    shapes = [(4, 6), (6,), (6, 4), (5,)]
    host_params, stream = _stream(shapes, dtype, steps=4)
    plain_params, odd_params = [_torch(p) for p in host_params], [_torch(p) for p in host_params]
    plain, oddly = ar.Engine(plain_params, cfg), ar.Engine(odd_params, cfg)
    for step, grads in enumerate(stream):
        plain.step([_torch(g) for g in grads], plain_params)
        given_grads = [_torch(g) for g in grads]
        given_grads[step % len(shapes)] = odd(given_grads[step % len(shapes)])  # one odd gradient a step
        oddly.step(given_grads, odd_params)
        for want, got in zip(plain_params, odd_params, strict=True):
            _assert_close(got, want, True, dtype)
    for i in range(len(shapes)):
        _assert_states(oddly.state(i), plain.state(i), True, dtype)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_live_engine_writes_the_states_it_handed_out(name: str, backend: str) -> None:
    """``from_states(live=True)``: the states handed out before any step show the engine's state after five
    (refresh steps included), equal to ``ar.step``'s: every step writes the same arrays in place.  Without
    ``live`` they are snapshots, left as they were."""
    if backend == "torch":
        pytest.importorskip("torch")
    convert = BACKENDS[backend]
    cfg = ar.make_config(name, update_freq=2, weight_decay=0.1)
    host_params, stream = _stream(SHAPES, np.float64, steps=5)
    params, snapshot_params = [convert(p) for p in host_params], [convert(p) for p in host_params]
    live = ar.Engine.from_states([ar.init(p, cfg) for p in params], params, cfg, count=0, live=True)
    snapshot = ar.Engine.from_states([ar.init(p, cfg) for p in params], snapshot_params, cfg, count=0)
    held = [live.state(i) for i in range(len(params))]
    kept = [snapshot.state(i) for i in range(len(params))]
    singles, states = _in_lockstep(live, params, host_params, stream, cfg, convert)
    for grads in stream:
        snapshot.step([convert(g) for g in grads], snapshot_params)
    exact = backend == "torch" or cfg.family == "adam"  # NumPy's Adafactor and Hfac kernels sum in another order
    for i, want in enumerate(states):
        _assert_states(held[i]._replace(count=want.count), want, exact, np.float64)  # its counter is the caller's
        _assert_states(kept[i], ar.init(convert(host_params[i]), cfg), True, np.float64)
        _assert_close(params[i], singles[i], exact, np.float64)


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adafactor"])
def test_finite_reads_one_verdict_and_writes_nothing(name: str) -> None:
    """``Engine.finite``: ``True`` for finite gradients, ``False`` for a NaN or an Inf in any one of them; nothing
    of the engine or the parameters changes."""
    cfg = ar.make_config(name, update_freq=2)
    host_params, stream = _stream(SHAPES, np.float32, steps=3)
    params = [p.copy() for p in host_params]
    engine = ar.Engine(params, cfg)
    assert engine.finite(stream[0]) is True
    for index, bad in [(0, np.nan), (3, np.inf), (len(SHAPES) - 1, -np.inf)]:
        grads = [g.copy() for g in stream[0]]
        grads[index].reshape(-1)[-1] = bad
        assert engine.finite(grads) is False
    for i, p in enumerate(host_params):
        _assert_states(engine.state(i), ar.init(p, cfg), True, np.float32)
        np.testing.assert_array_equal(params[i], p)
        assert engine.count(i) == 0


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_finite_refuses_a_gradient_of_another_shape_or_dtype_before_reading_it(backend: str) -> None:
    """``Engine.finite`` reads a group's gradients by address: a gradient smaller than its parameter, or of another
    dtype, must raise ``ValueError`` naming it (as :meth:`~adadiag_ref.Engine.step` does), never be read past its
    end or as the wrong type."""
    cfg = ar.make_config("adamw", update_freq=None)
    shapes = [(300_000,), (7, 5)]
    params = [np.zeros(s, np.float32) for s in shapes]
    grads = [np.ones(s, np.float32) for s in shapes]
    if backend == "torch":
        torch = pytest.importorskip("torch")
        params, grads = [torch.from_numpy(p) for p in params], [torch.from_numpy(g) for g in grads]
    engine = ar.Engine(params, cfg)
    assert engine.finite(grads) is True
    short = grads[0][:3]
    wide = grads[0].double() if backend == "torch" else grads[0].astype(np.float64)
    for bad, words in [(short, r"shape \(3,\)"), (wide, "float64")]:
        with pytest.raises(ValueError, match=words) as error:
            engine.finite([bad, grads[1]])
        assert "0" in str(error.value) and "nothing was read" in str(error.value)


def test_a_gradient_given_new_memory_between_finite_and_step_is_read_anew() -> None:
    """The kernels keep the gradients' address table from :meth:`~adadiag_ref.Engine.finite` for the step after
    it; a gradient tensor that got other memory in between (``g.data = ...``, ``g.set_(...)``) or lost its
    contiguity in place must be read where it is now, never at its old address."""
    torch = pytest.importorskip("torch")
    cfg = ar.make_config("adamw", update_freq=None)
    shapes = [(64, 64), (300,)]
    base = [torch.randn(s, dtype=torch.float64) for s in shapes]
    clean = [torch.randn(s, dtype=torch.float64) for s in shapes]
    params = [b.clone() for b in base]
    engine = ar.Engine(params, cfg)
    grads = [c.clone() for c in clean]
    grads[0][0, 0] = float("nan")
    assert engine.finite(grads) is False
    old = grads[0].data  # the NaN's memory stays alive (and readable) at its old address
    grads[0].data = clean[0].clone()
    assert engine.finite(grads) is True
    grads[0].set_(old)  # back to the NaN's memory, then fixed by a new tensor in the same object
    assert engine.finite(grads) is False
    grads[0].set_(clean[0].t().contiguous().t())  # same values, new memory
    assert engine.finite(grads) is True
    old = grads[0].data
    grads[0].data = (clean[0] * 2).t().contiguous().t()  # (64, 64) strided in place of the checked memory
    engine.step(grads, params)
    expected = ar.Engine([b.clone() for b in base], cfg)
    want = [b.clone() for b in base]
    expected.step([grads[0].contiguous(), grads[1]], want)
    for got, ref in zip(params, want, strict=True):
        assert torch.equal(got, ref)


def test_a_parameter_restrided_over_its_own_memory_is_written_by_its_strides() -> None:
    """A parameter's address table is kept while the same tensors come back at the same addresses; a square
    parameter made a transposed view of its own memory (``p.data = p.data.t()``: same address, same shape) must be
    written through its strides, as a fresh tensor of those values would be."""
    torch = pytest.importorskip("torch")
    cfg = ar.make_config("adamw", update_freq=None, weight_decay=0.1)
    shapes = [(64, 64), (300,)]
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes]
    stream = [[torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes] for _ in range(2)]
    params, twins = [b.clone() for b in base], [b.clone() for b in base]
    engine, reference = ar.Engine(params, cfg), ar.Engine(twins, cfg)
    engine.step(stream[0], params)
    reference.step(stream[0], twins)
    params[0].data = params[0].data.t()  # same memory and shape, transposed strides
    twins = [twins[0].t().contiguous(), twins[1]]
    engine.step(stream[1], params)
    reference.step(stream[1], twins)
    for got, want in zip(params, twins, strict=True):
        assert torch.equal(got, want)


def test_a_live_engine_refuses_jax() -> None:
    jnp = pytest.importorskip("jax.numpy")
    cfg = ar.make_config("adamw")
    params = [jnp.zeros((3, 2))]
    with pytest.raises(TypeError, match="immutable"):
        ar.Engine.from_states([ar.init(p, cfg) for p in params], params, cfg, live=True)


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp", "adafactor", "hfacdiag"])
def test_multi_step_equals_step_on_every_layout(name: str) -> None:
    """``multi_step`` (through the engine) with mappings, per-parameter counts and low-precision parameters."""
    torch = pytest.importorskip("torch")
    cfg = ar.make_config(name, update_freq=2, weight_decay=0.05)
    gen = torch.Generator().manual_seed(3)
    params = {f"p{i}": torch.randn(s, generator=gen, dtype=torch.bfloat16) for i, s in enumerate(SHAPES)}
    states = {k: ar.init(v, cfg) for k, v in params.items()}
    singles = dict(params)
    single_states = dict(states)
    for k in range(3):
        grads = {key: torch.randn(v.shape, generator=gen, dtype=torch.bfloat16) for key, v in params.items()}
        params, states = ar.multi_step(states, grads, cfg, params, count=k)
        for key in singles:
            singles[key], single_states[key] = ar.step(single_states[key], grads[key], cfg, singles[key], count=k)
    exact = name in ("adamw", "adafactor")  # no batched torch GEMM or stacked decomposition (see above)
    for key in singles:
        assert params[key].dtype == torch.bfloat16
        got, want = params[key].float().numpy(), singles[key].float().numpy()
        if exact:
            np.testing.assert_array_equal(got, want)
        else:  # a float32 rounding difference in delta may move W_{t+1} by one bfloat16 ulp (2^-8 relative)
            np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * float(np.abs(want).max()))
        _assert_states(states[key], single_states[key], exact, np.float32)


@given(
    rows=st.integers(1, 7),
    cols=st.integers(1, 7),
    copies=st.integers(1, 3),
    beta2=st.sampled_from([0.9, 0.999]),
    weight_decay=st.sampled_from([0.0, 0.1]),
    name=st.sampled_from(["adamw", "adadiag", "adadiag_pp", "adafacdiag"]),
)
def test_engine_equals_step_for_any_shapes_and_hyperparameters(rows, cols, copies, beta2, weight_decay, name):
    cfg = ar.make_config(name, update_freq=2, betas=(0.9, beta2), weight_decay=weight_decay, kernels="reference")
    shapes = [(rows, cols)] * copies + [(cols, rows), (cols,)]
    host_params, stream = _stream(shapes, np.float64, steps=3, seed=rows * 10 + cols)
    params = [_strict(p) for p in host_params]
    engine = ar.Engine(params, cfg)
    singles, states = [_strict(p) for p in host_params], [ar.init(_strict(p), cfg) for p in host_params]
    for k, grads in enumerate(stream):
        engine.step([_strict(g) for g in grads], params)
        pairs = [ar.step(s, _strict(g), cfg, w, count=k) for s, g, w in zip(states, grads, singles, strict=True)]
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    for i, want in enumerate(singles):
        _assert_close(params[i], want, True, np.float64)
        _assert_states(engine.state(i), states[i], True, np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("weight_decay", [0.0, 0.05], ids=["no-decay", "decay"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_engine_equals_step_on_cupy(name: str, weight_decay: float) -> None:
    """On a CUDA device: the engine (the CuPy direction kernels over flat groups, cuBLAS batched GEMMs, stacked
    cuSOLVER refreshes) against per-parameter ``ar.step`` (the reference in CuPy's array ops), float32, to rounding;
    with and without weight decay (the default configuration's kernels).

    The stacked decompositions are other cuSOLVER routines than the single ones, so the bases agree to the
    conditioning of each refresh, not to a few ulps: an H100 run (2026-11-26) found AdaDiag++'s ``Q`` of the
    8 x 8 parameter 2.1e-5 apart in the directions of its two smallest singular values, where
    ``kappa = eps / gap = 2.9e-6``.  So each parameter's tolerance is golden's conformance tolerance
    (docs/golden.md, "Tolerances"): ``max(rtol, kappa)`` for the parameter and ``max(rtol, 100 kappa)`` for the
    states, ``kappa`` the worst refresh of its gradient stream (``replay.trajectory_conditioning``)."""
    cp = _load_backend("cupy")
    cfg = ar.make_config(name, update_freq=3, weight_decay=weight_decay)
    host_params, stream = _stream(SHAPES, np.float32, steps=5)
    params = [cp.asarray(p) for p in host_params]
    engine = ar.Engine(params, cfg)
    singles = [cp.asarray(p) for p in host_params]
    states = [ar.init(w, cfg) for w in singles]
    for k, grads in enumerate(stream):
        engine.step([cp.asarray(g) for g in grads], params)
        pairs = [ar.step(s, cp.asarray(g), cfg, w, count=k) for s, g, w in zip(states, grads, singles, strict=True)]
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    for i, (w, want) in enumerate(zip(params, singles, strict=True)):
        kappa = _conditioning(cfg, [grads[i] for grads in stream]) if w.ndim >= 2 else 0.0
        _assert_close(w, want, False, np.float32, max(1e-5, kappa))
        _assert_states(engine.state(i), states[i], False, np.float32, max(1e-5, 100 * kappa))


def _conditioning(cfg: Any, grads: list[np.ndarray]) -> float:
    """The worst ``kappa`` of the refreshes of one parameter's gradient stream (``replay.trajectory_conditioning``)."""
    from adadiag_ref.replay import trajectory_conditioning

    return float(trajectory_conditioning(cfg, np.stack(grads))[-1])


# ----------------------------------------------------------------------------- the device proxies


def _warm_engine(name: str, layers: int, seed: int = 1) -> tuple[Any, list, list]:
    """An engine over ``layers`` copies of :data:`BLOCK` (float32, array_api_strict), after its refresh step."""
    rng = np.random.default_rng(seed)
    shapes = BLOCK * layers
    params = [_strict(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    engine = ar.Engine(params, ar.make_config(name, update_freq=10, weight_decay=0.1))
    engine.step([_strict(rng.standard_normal(s).astype(np.float32)) for s in shapes], params)
    grads = [_strict(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    return engine, params, grads


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_without_refresh_converts_once_with_the_check_and_never_without(name: str) -> None:
    engine, params, grads = _warm_engine(name, layers=2)
    with count_traffic() as checked:
        engine.step(grads, params)
    with count_traffic() as unchecked:
        engine.step(grads, params, check=False)
    assert checked.host_conversions == 1, dict(checked.conversions)  # the one reduced verdict
    assert checked.bytes_to_host == 1  # a boolean
    assert unchecked.host_conversions == 0, dict(unchecked.conversions)
    assert engine.count(0) == 3


def _step_calls(name: str, layers: int, check: bool, in_place: bool) -> Counter:
    engine, params, grads = _warm_engine(name, layers)
    with count_traffic() as traffic:
        engine.step(grads, params, check=check, in_place=in_place)
    return Counter({k: v for k, v in traffic.calls.items() if k not in VIEW_CALLS})


@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_makes_as_many_calls_for_2_layers_as_for_8(name: str, check: bool) -> None:
    """Every call but views is the same for 2 and 8 layers of the same shapes: one gather, batched GEMMs per work
    shape, the family's direction and the tail once per group, one verdict; Adafactor and Hfac (factored
    moments) one ``routed_update`` per stack of a parameter shape.  Written in place, each parameter takes one
    ``x[...] = value`` more (the write into the caller's array; nothing else grows)."""
    few, many = _step_calls(name, 2, check, in_place=False), _step_calls(name, 8, check, in_place=False)
    assert many == few, (many - few, few - many)
    few_in_place, many_in_place = _step_calls(name, 2, check, True), _step_calls(name, 8, check, True)
    assert many_in_place - few_in_place == Counter({"__setitem__": 6 * len(BLOCK)})
    assert few_in_place - few == Counter({"__setitem__": 2 * len(BLOCK)})


# ----------------------------------------------------------------------------- failure leaves everything as it was


def _snapshot(engine: Any, params: list) -> list:
    arrays = [to_numpy(p).copy() for p in params]
    for i in range(len(params)):
        state = engine.state(i)
        arrays += [to_numpy(getattr(state, f)).copy() for f in state._fields if getattr(state, f) is not None]
    return arrays


@pytest.mark.parametrize("backend", ["numpy", "strict"])
@pytest.mark.parametrize("refresh", [False, True], ids=["plain", "refresh"])
@pytest.mark.parametrize("name", ["adamw", "adadiag_pp", "hfacdiag"])
def test_a_non_finite_gradient_names_its_parameter_and_changes_nothing(name: str, refresh: bool, backend: str) -> None:
    convert = BACKENDS[backend]
    cfg = ar.make_config(name, update_freq=2)
    host_params, stream = _stream(SHAPES, np.float32, steps=3)
    params = {f"layer.{i}": convert(p) for i, p in enumerate(host_params)}
    engine = ar.Engine(params, cfg)
    engine.step({k: convert(g) for k, g in zip(params, stream[0], strict=True)}, params)  # t = 1 (a refresh)
    if refresh:
        engine.step({k: convert(g) for k, g in zip(params, stream[1], strict=True)}, params)  # t = 3 refreshes
    bad = [g.copy() for g in stream[1]]
    bad[2][1, 3] = np.nan
    bad[4][0, 0, 0, 0] = np.inf
    before = _snapshot(engine, list(params.values()))
    message = r"1 NaN or Inf entry in the gradient of parameter 'layer\.2' \(shape \(20, 8\)\)"
    with pytest.raises(ValueError, match=message):
        engine.step({k: convert(g) for k, g in zip(params, bad, strict=True)}, params)
    after = _snapshot(engine, list(params.values()))
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert engine.count("layer.0") == (2 if refresh else 1)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # G~^2 overflows, as in ar.step
def test_a_huge_finite_gradient_is_no_error() -> None:
    """The verdict is a sum: one that overflows on finite entries is settled exactly, and the step proceeds."""
    cfg = ar.make_config("adamw")
    params = [_strict(np.ones((4, 4), np.float32))]
    engine = ar.Engine(params, cfg)
    engine.step([_strict(np.full((4, 4), 3e38, np.float32))], params)
    assert engine.count(0) == 1


def test_shapes_and_dtypes_are_refused_before_any_work() -> None:
    cfg = ar.make_config("adadiag")
    params = [np.ones((4, 6)), np.ones((3,))]
    engine = ar.Engine(params, cfg)
    with pytest.raises(ValueError, match=r"gradient shape \(6, 4\) does not match parameter shape \(4, 6\)"):
        engine.step([np.ones((6, 4)), np.ones(3)], params)
    with pytest.raises(ValueError, match="gradient dtype float32 does not match parameter dtype float64"):
        engine.step([np.ones((4, 6), np.float32), np.ones(3)], params)
    with pytest.raises(ValueError, match="engine was built for shape"):
        engine.step([np.ones((4, 6)), np.ones(3)], [np.ones((4, 6)), np.ones(4)])
    with pytest.raises(ValueError, match="2 parameters"):
        engine.step([np.ones((4, 6))], params)
    assert engine.count(0) == 0


# ----------------------------------------------------------------------------- routes, states, adapters of the engine


def test_routes_say_which_code_runs_each_part() -> None:
    cfg = ar.make_config("adadiag_pp")
    params = {"q": _strict(np.zeros((8, 8), np.float32)), "k": _strict(np.zeros((8, 8), np.float32)),
              "down": _strict(np.zeros((20, 8), np.float32)), "norm": _strict(np.zeros((20,), np.float32))}  # fmt: skip
    routes = ar.Engine(params, cfg).routes()
    assert set(routes) == set(params)
    assert routes["q"].group == routes["norm"].group  # one flat group: family, dtypes and device are shared
    assert routes["q"].group.startswith("flat group 0: family adam, state float32, parameters float32")
    assert "refresh_bases: one stacked decomposition of the 2 8 x 8 matrices" in routes["q"].refresh
    assert "over 2 8 x 8 matrices (xp.matmul on the stack)" in routes["q"].rotate
    assert "G~ = P^T G Q over 1 8 x 20 matrices" in routes["down"].rotate
    assert "refresh_basis per parameter (the only matrix of its work shape" in routes["down"].refresh
    assert "G~ = P^T G over 1 1 x 20 matrices" in routes["norm"].rotate  # a vector's P = [1]: one side, 1 x 1
    assert "adam.reference.direction" in routes["q"].entrywise and "tail.decayed_step" in routes["q"].entrywise
    assert ar.explain_route(ar.make_config("adamw"), (20, 8)).rotate.startswith("none")

    numpy_route = ar.explain_route(ar.make_config("adadiag"), (8, 20))
    # in host memory the group kernels write a rotated group's moments in place (U~ over G~), then its tail
    assert "in place: adadiag_ref.optim.families.adam.group_route.engine_moments over the flat M, V and G~" in (
        numpy_route.entrywise
    )
    assert "(160 entries), then the tail in place: adadiag_ref.optim.families.adam.group_route.engine_tail" in (
        numpy_route.entrywise
    )
    assert "NumPy: LAPACK per matrix" in numpy_route.refresh
    reference = ar.explain_route(ar.make_config("adadiag", kernels="reference"), (8, 20), np.float64)
    assert "reference" in reference.entrywise and "float64" in reference.group
    factored = ar.explain_route(ar.make_config("hfacdiag"), (8, 20))
    assert factored.group.startswith("per-parameter") and "routed_update" in factored.entrywise
    # a group without rotation blocks (AdamW) takes the family's fused update over the flat group: one call for the
    # moments, the direction and the tail (bit for bit as ar.step, which takes it per parameter)
    fused = ar.explain_route(ar.make_config("adamw"), (8, 20))
    assert "numba_route.update once over the flat group (160 entries): moments, direction and tail" in fused.entrywise
    assert "numba_route.direction" in ar.explain_route(ar.make_config("adadiag"), (8, 20)).entrywise  # with blocks
    if _kernels_available():  # a rotated group's tail by the group kernels (the parameters never gathered)
        assert "tail in place: " in ar.explain_route(ar.make_config("adadiag"), (8, 20)).entrywise


def test_from_states_takes_the_states_over_unchanged() -> None:
    cfg = ar.make_config("adadiag", update_freq=2)
    host_params, stream = _stream(SHAPES, np.float64, steps=3)
    params, states = [_strict(p) for p in host_params], [ar.init(_strict(p), cfg) for p in host_params]
    for k in range(3):
        pairs = [ar.step(s, _strict(g), cfg, w, count=k) for s, g, w in zip(states, stream[k], params, strict=True)]
        params, states = [w for w, _ in pairs], [s for _, s in pairs]
    engine = ar.Engine.from_states(states, params, cfg, count=3)
    for i, state in enumerate(states):
        _assert_states(engine.state(i), state, True, np.float64)
    assert isinstance(engine.states(), list) and engine.count(0) == 3
    with pytest.raises(ValueError, match="state field 'M' has shape"):
        ar.Engine.from_states(states[::-1], params, cfg, count=3)


def test_parameters_at_different_steps_form_groups_of_their_own() -> None:
    """``multi_step`` with one count per parameter: each count its own group, its own refresh schedule."""
    cfg = ar.make_config("adadiag", update_freq=2, kernels="reference")
    host_params, stream = _stream([(6, 9), (6, 9), (9,)], np.float64, steps=4)
    params, states = [_strict(p) for p in host_params], [ar.init(_strict(p), cfg) for p in host_params]
    params[0], states[0] = ar.step(states[0], _strict(stream[3][0]), cfg, params[0], count=0)  # one step ahead
    counts = [1, 0, 0]
    for k in range(3):
        grads = [_strict(g) for g in stream[k]]
        new_params, new_states = ar.multi_step(states, grads, cfg, params, count=counts)
        pairs = [ar.step(s, g, cfg, w, count=c) for s, g, w, c in zip(states, grads, params, counts, strict=True)]
        for got, got_state, (want, want_state) in zip(new_params, new_states, pairs, strict=True):
            _assert_close(got, want, True, np.float64)
            _assert_states(got_state, want_state, True, np.float64)
        params, states, counts = new_params, new_states, [c + 1 for c in counts]
    engine = ar.Engine.from_states(states, params, cfg, count=counts)
    assert len({r.group for r in engine.routes().values()}) == 2
    with pytest.raises(ValueError, match="at least one parameter"):
        ar.Engine([], cfg)


def test_jax_steps_functionally() -> None:
    """JAX's immutable arrays: the engine returns new parameters, refuses ``in_place=True``, and gives
    ``ar.step``'s parameters.  A wide, a tall (transposed work frame) and an unrotated member: eager JAX compiles
    each operation anew per shape (about 30 ms a compile here), and the generic route's handling of every other
    shape is :data:`BLOCK`'s on ``array_api_strict`` (:func:`test_engine_equals_step_per_parameter`)."""
    jnp = pytest.importorskip("jax.numpy")
    cfg = ar.make_config("adadiag", update_freq=2)
    host_params, stream = _stream([(8, 20), (20, 8), (20,)], np.float32, steps=3)
    params = [jnp.asarray(p) for p in host_params]
    engine = ar.Engine(params, cfg)
    with pytest.raises(TypeError, match="immutable"):
        engine.step([jnp.asarray(g) for g in stream[0]], params, in_place=True)
    singles, states = list(params), [ar.init(w, cfg) for w in params]
    for k, grads in enumerate(stream):
        params = engine.step([jnp.asarray(g) for g in grads], params)
        pairs = [ar.step(s, jnp.asarray(g), cfg, w, count=k) for s, g, w in zip(states, grads, singles, strict=True)]
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    for w, want in zip(params, singles, strict=True):
        _assert_close(w, want, False, np.float32)


def test_torch_leaf_parameters_are_written_in_place() -> None:
    torch = pytest.importorskip("torch")
    params = [torch.nn.Parameter(torch.ones(4, 6)), torch.nn.Parameter(torch.ones(6))]
    engine = ar.Engine([p.detach() for p in params], ar.make_config("adamw"))
    engine.step([torch.ones(4, 6), torch.ones(6)], params)
    assert all(bool((p < 1).all()) for p in params) and all(p.requires_grad for p in params)


def test_bench_gpu_cupy_rows_run_the_engine_with_numpy_standing_in() -> None:
    """``bench --gpu``'s CuPy rows (``perf.gpu._CupySteps``) run here with NumPy in CuPy's place: the engine's
    host counter, the parameters updated in place, the results of ``ar.step``."""
    from types import SimpleNamespace

    from adadiag_ref.memory import llama_parameters
    from adadiag_ref.perf.gpu import _CupySteps
    from adadiag_ref.perf.params import QUICK

    class RandomState:
        def __init__(self, seed: int) -> None:
            self.rng = np.random.default_rng(seed)

        def standard_normal(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            return self.rng.standard_normal(shape).astype(dtype)

    fake_cupy = SimpleNamespace(random=SimpleNamespace(RandomState=RandomState), float32=np.float32)
    specs = llama_parameters(QUICK)[:6]
    steps = _CupySteps(fake_cupy, "adadiag", specs, "all")
    initial = [[p.copy() for p in params] for _, params, _ in steps.groups]
    for _ in range(3):
        steps()
    for (engine, params, grads), start in zip(steps.groups, initial, strict=True):
        assert engine.count(0) == 3
        cfg = engine.cfg
        for w0, w, g in zip(start, params, grads, strict=True):
            state, want = ar.init(w0, cfg), w0
            for k in range(3):
                want, state = ar.step(state, g, cfg, want, count=k)
            np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adafacdiag", "adafacdiag_pp", "hfacdiag"])
def test_a_stack_whose_members_refresh_differently_matches_step(name: str) -> None:
    """A factored family's stack (the parameters of one shape, stepped as one ``batch_dims`` stack on a device
    backend) where one member keeps its basis at a refresh step (a NaN gradient, ``check=False``: the refresh
    keeps the old basis) and the others take new ones: the per-member ``refreshed`` flags, against ``ar.step``
    per parameter, bit for bit (array_api_strict, the same reference arithmetic; NaN where ``step`` has NaN)."""
    cfg = ar.make_config(name, update_freq=2, weight_decay=0.1, kernels="reference")
    shapes = BLOCK * 2
    host_params, stream = _stream(shapes, np.float64, steps=4, seed=3)
    stream[2][0] = stream[2][0].copy()
    stream[2][0][1, 2] = np.nan  # t = 3 refreshes: the first (8, 8) matrix keeps its basis, its twin does not
    params = [_strict(p) for p in host_params]
    engine = ar.Engine(params, cfg)
    singles, states = [_strict(p) for p in host_params], [ar.init(_strict(p), cfg) for p in host_params]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, grads in enumerate(stream):
            engine.step([_strict(g) for g in grads], params, check=False)
            pairs = [ar.step(s, _strict(g), cfg, w, count=k, check=False)
                     for s, g, w in zip(states, grads, singles, strict=True)]  # fmt: skip
            singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    assert np.isnan(to_numpy(singles[0])).any() and not np.isnan(to_numpy(singles[len(BLOCK)])).any()
    for i, want in enumerate(singles):
        _assert_close(params[i], want, True, np.float64)
        _assert_states(engine.state(i), states[i], True, np.float64)


# ----------------------------------------------------------------------------- group kernels: in place, no gather

GROUP_SHAPES = [(300, 300), (8, 20), (20,), (), (20, 8)]  # 90000 entries: two chunks of the kernels


def _no_gather(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the group was gathered")

    monkeypatch.setattr(engine, "_native", refuse)


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_group_kernels_step_in_place_without_gathering(
    dtype: Any, weight_decay: float, parallel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AdamW on NumPy: the group's kernels write W, M, V in place, walking the members' own memory (nothing
    gathered, nothing written back), and give ``ar.step``'s bits (the same entry formulas and coefficients)."""
    pytest.importorskip("numba")
    cfg = ar.make_config("adamw", weight_decay=weight_decay)
    host_params, stream = _stream(GROUP_SHAPES, dtype, steps=4)
    params = [p.copy() for p in host_params]
    engine = ar.Engine(params, cfg)
    group = engine._flat[0]
    assert group.kernels is not None and "in place" in engine.routes()[0].entrywise
    group.kernels.parallel = parallel  # both compilations, whatever numba's threading layer
    _no_gather(engine, monkeypatch)
    singles, states = [p.copy() for p in host_params], [ar.init(p, cfg) for p in host_params]
    for k, grads in enumerate(stream):
        returned = engine.step(grads, params)
        assert all(r is p for r, p in zip(returned, params, strict=True))
        pairs = [ar.step(s, g, cfg, w, count=k) for s, g, w in zip(states, grads, singles, strict=True)]
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    for i, (w, want) in enumerate(zip(params, singles, strict=True)):
        _assert_close(w, want, True, dtype)
        _assert_states(engine.state(i), states[i], True, dtype)
    assert group.scratch == {}  # no gathering buffers held: the state is M and V alone


def test_group_kernels_leave_everything_on_a_non_finite_gradient() -> None:
    """Two groups (float32, float64): a NaN in the float64 group's gradients raises naming it, and neither
    group's parameters or moments change (the verdict is read before any kernel writes)."""
    pytest.importorskip("numba")
    cfg = ar.make_config("adamw", weight_decay=0.1)
    rng = np.random.default_rng(1)
    params = {"a": rng.standard_normal((6, 5)).astype(np.float32), "b": rng.standard_normal(7)}
    engine = ar.Engine(params, cfg)
    assert all(g.kernels is not None for g in engine._flat) and len(engine._flat) == 2
    engine.step({k: np.ones_like(v) for k, v in params.items()}, params)
    before = _snapshot(engine, list(params.values()))
    bad = {k: np.ones_like(v) for k, v in params.items()}
    bad["b"][3] = np.nan
    with pytest.raises(ValueError, match=r"1 NaN or Inf entry in the gradient of parameter 'b'"):
        engine.step(bad, params)
    for x, y in zip(before, _snapshot(engine, list(params.values())), strict=True):
        np.testing.assert_array_equal(x, y)
    assert engine.count("a") == engine.count("b") == 1


def test_a_state_handed_out_stays_a_snapshot_under_group_kernels() -> None:
    pytest.importorskip("numba")
    cfg = ar.make_config("adamw")
    params = [np.ones((4, 3)), np.ones(5)]
    engine = ar.Engine(params, cfg)
    engine.step([np.full((4, 3), 0.5), np.full(5, 0.5)], params)
    held = engine.state(0)
    kept = held.M.copy(), held.V.copy()
    engine.step([np.full((4, 3), 2.0), np.full(5, 2.0)], params)
    np.testing.assert_array_equal(held.M, kept[0])  # the step wrote into copies
    np.testing.assert_array_equal(held.V, kept[1])
    assert not np.array_equal(engine.state(0).M, kept[0])


@pytest.mark.parametrize("case", ["transposed", "array lr", "functional", "float64 gradient"])
def test_arrays_the_group_kernels_do_not_take_are_gathered(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter that is a strided view, an array learning rate, ``in_place=False`` or a gradient of another
    dtype (refused by the input check): the step runs the gathering path, with ``ar.step``'s results."""
    pytest.importorskip("numba")
    cfg = ar.make_config("adamw", weight_decay=0.1)
    rng = np.random.default_rng(2)
    base = rng.standard_normal((5, 4)).astype(np.float32)
    params = [base.T if case == "transposed" else base.T.copy(), rng.standard_normal(3).astype(np.float32)]
    grads = [rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(3).astype(np.float32)]
    engine = ar.Engine(params, cfg)
    lr = np.asarray(1e-3, dtype=np.float32) if case == "array lr" else None
    gathered = []
    native = engine._native
    monkeypatch.setattr(engine, "_native", lambda *a, **k: gathered.append(1) or native(*a, **k))
    if case == "float64 gradient":
        with pytest.raises(ValueError):
            engine.step([grads[0].astype(np.float64), grads[1]], params)
        assert engine.count(0) == 0
        return
    originals = [p.copy() for p in params]
    new = engine.step(grads, params, lr=lr, in_place=case != "functional")
    assert gathered
    for got, p, g in zip(new, originals, grads, strict=True):
        want, _ = ar.step(ar.init(p, cfg), g, cfg, p, count=0, lr=lr)
        _assert_close(got, want, True, np.float32)


def test_chunk_table_covers_every_entry_once() -> None:
    from adadiag_ref.optim.families.adam.group_route import chunk_table

    sizes = [0, 5, 16, 17, 1]
    table = chunk_table(sizes, chunk=8)
    covered = [(i, k) for i, lo, hi in table for k in range(lo, hi)]
    assert covered == [(i, k) for i, n in enumerate(sizes) for k in range(n)]
    assert all(hi - lo <= 8 for _, lo, hi in table)


@pytest.mark.gpu
@pytest.mark.parametrize("weight_decay", [0.0, 0.05], ids=["no-decay", "decay"])
def test_cupy_group_kernels_step_in_place_and_skip_on_a_non_finite_gradient(weight_decay: float) -> None:
    """On a CUDA device: AdamW's groups (float32 and float64) stepped by the CUDA group kernels (one launch per
    group over the members' own memory) equal per-parameter ``ar.step`` (the reference, the same entry
    arithmetic; the kernels compiled with ``--fmad=false``; rtol 1e-5 / 1e-12 as for every CuPy comparison); then
    a NaN in the float64 group's gradients: the verdict is read after the launches, which it gated, so nothing
    changed anywhere."""
    cp = _load_backend("cupy")
    cfg = ar.make_config("adamw", weight_decay=weight_decay)
    rng = np.random.default_rng(3)
    host = [rng.standard_normal(s).astype(d) for s, d in [((300, 300), np.float32), ((7,), np.float32),
                                                          ((20, 8), np.float64), ((), np.float64)]]  # fmt: skip
    params = [cp.asarray(p) for p in host]
    engine = ar.Engine(params, cfg)
    assert all(g.kernels is not None for g in engine._flat) and len(engine._flat) == 2
    singles, states = [cp.asarray(p) for p in host], [ar.init(cp.asarray(p), cfg) for p in host]
    for k in range(4):
        grads = [rng.standard_normal(p.shape).astype(p.dtype) for p in host]
        engine.step([cp.asarray(g) for g in grads], params)
        pairs = [ar.step(s, cp.asarray(g), cfg, w, count=k) for s, g, w in zip(states, grads, singles, strict=True)]
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    for i, (w, want) in enumerate(zip(params, singles, strict=True)):
        _assert_close(w, want, False, host[i].dtype)
        _assert_states(engine.state(i), states[i], False, host[i].dtype)
    before = _snapshot(engine, params)
    bad = [cp.ones_like(p) for p in params]
    bad[2][3, 1] = cp.nan
    with pytest.raises(ValueError, match=r"1 NaN or Inf entry in the gradient of parameter \(shape \(20, 8\)\)"):
        engine.step(bad, params)
    for x, y in zip(before, _snapshot(engine, params), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_cupy_rotated_group_tail_is_skipped_on_a_non_finite_gradient(name: str) -> None:
    """On a CUDA device: a rotated group's tail kernel (its parameters written through their addresses) takes the
    verdict as its device flag: a NaN at a step without refresh (the verdict read after the launches) leaves every
    parameter and state as it was.  Its values against ``ar.step``: ``test_engine_equals_step_on_cupy``."""
    cp = _load_backend("cupy")
    cfg = ar.make_config(name, update_freq=10, weight_decay=0.05)
    host_params, stream = _stream(SHAPES, np.float32, steps=3)
    params = [cp.asarray(p) for p in host_params]
    engine = ar.Engine(params, cfg)
    assert all(g.kernels is not None for g in engine._flat)
    for grads in stream[:2]:
        engine.step([cp.asarray(g) for g in grads], params)
    before = _snapshot(engine, params)
    bad = [cp.asarray(g) for g in stream[2]]
    bad[1][2, 3] = cp.nan
    with pytest.raises(ValueError, match=r"1 NaN or Inf entry in the gradient of parameter \(shape \(8, 20\)\)"):
        engine.step(bad, params)
    for x, y in zip(before, _snapshot(engine, params), strict=True):
        np.testing.assert_array_equal(x, y)


def test_group_kernels_write_into_the_arrays_given_at_each_step() -> None:
    """The kernels keep the parameters' address table while the same arrays come back: other arrays at a later
    step (a copy of the model, a freed and reallocated one) are the ones written, never the old memory; the
    results are the gathering path's."""
    pytest.importorskip("numba")
    cfg = ar.make_config("adamw", weight_decay=0.1)
    rng = np.random.default_rng(5)
    start = [rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal(3).astype(np.float32)]
    grads = [rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal(3).astype(np.float32)]
    results = []
    for path in ("kernels", "gathering"):
        first = [p.copy() for p in start]
        engine = ar.Engine(first, cfg)
        if path == "gathering":
            for group in engine._flat:
                group.kernels = None
        engine.step(grads, first)
        second = [p.copy() for p in first]
        kept = [p.copy() for p in first]
        engine.step(grads, second)
        for a, b in zip(first, kept, strict=True):
            np.testing.assert_array_equal(a, b)  # the first arrays were not written at the second step
        results.append(second)
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_unrotated_members_of_a_rotated_optimizer_are_stepped_by_group_kernels(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AdaDiag on NumPy with ``max_basis_dim=4``: the members whose side exceeds it (the 8 x 8, 8 x 20 and 20 x 8
    matrices: ``P = I``) form a group of their own, stepped in place by the group kernels; only the rotated
    members' gradients (the vector, the conv kernel, the scalar: ``m <= 4``) are gathered, for the batched GEMMs,
    and their tail is written by the kernels (no parameter gathered or written back); ``ar.step``'s bits."""
    pytest.importorskip("numba")
    cfg = ar.make_config(name, update_freq=3, weight_decay=0.1, max_basis_dim=4)
    host_params, stream = _stream(SHAPES, np.float32, steps=4)
    params = [p.copy() for p in host_params]
    engine = ar.Engine(params, cfg)
    assert [g.kernels is not None for g in engine._flat] == [True, True] and engine._flat[0].blocks
    rotated = {m.index for m in engine._flat[0].members}
    assert rotated == {i for i, s in enumerate(SHAPES) if s in [(20,), (4, 2, 3, 3), ()]}
    gathered: list[tuple[str, set[int]]] = []
    real = engine._gathered
    monkeypatch.setattr(engine, "_gathered", lambda group, which, arrays: gathered.append(
        (which, {m.index for m in group.members})) or real(group, which, arrays))  # fmt: skip
    singles, states = [p.copy() for p in host_params], [ar.init(p, cfg) for p in host_params]
    for k, grads in enumerate(stream):
        engine.step(grads, params)
        pairs = [ar.step(s, g, cfg, w, count=k) for s, g, w in zip(states, grads, singles, strict=True)]
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    assert gathered and all(g == ("G", rotated) for g in gathered)
    for i, (w, want) in enumerate(zip(params, singles, strict=True)):
        _assert_close(w, want, True, np.float32)
        _assert_states(engine.state(i), states[i], True, np.float32)
    assert "in place" in engine.routes()[0].entrywise and "unrotated" in engine.routes()[0].group


@given(
    shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=5),
    chunk=st.integers(1, 17),
    parallel=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64]),
    lr=st.sampled_from([1e-3, 0.5]),
    betas=st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.0, 0.0)]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    name=st.sampled_from(["adamw", "adadiag", "adadiag_pp"]),
    max_basis_dim=st.sampled_from([4, 8192]),
)
def test_group_kernels_equal_step_for_any_shapes_chunks_and_hyperparameters(
    shapes, chunk, parallel, dtype, lr, betas, weight_decay, name, max_basis_dim
):
    """NumPy engine with its group kernels (the whole step, or a rotated group's tail; members cut into chunks of
    any size, serial or parallel kernels; ``max_basis_dim=4`` splits off unrotated members) against per-parameter
    ``ar.step``: bit for bit over three steps with a refresh."""
    pytest.importorskip("numba")
    from adadiag_ref.optim.families.adam.group_route import chunk_table

    cfg = ar.make_config(name, update_freq=2, lr=lr, betas=betas, weight_decay=weight_decay,
                         max_basis_dim=max_basis_dim)  # fmt: skip
    full = [*shapes, (shapes[0][1],), ()]
    host_params, stream = _stream(full, dtype, steps=3, seed=len(shapes) * 31 + chunk)
    params = [p.copy() for p in host_params]
    engine = ar.Engine(params, cfg)
    for group in engine._flat:
        assert group.kernels is not None
        group.kernels.chunks = chunk_table(group.kernels.sizes, chunk=chunk)
        group.kernels.parallel = parallel
    singles, states = [p.copy() for p in host_params], [ar.init(p, cfg) for p in host_params]
    for k, grads in enumerate(stream):
        engine.step(grads, params)
        pairs = [ar.step(s, g, cfg, w, count=k) for s, g, w in zip(states, grads, singles, strict=True)]
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    for i, want in enumerate(singles):
        _assert_close(params[i], want, True, dtype)
        _assert_states(engine.state(i), states[i], True, dtype)


@pytest.mark.parametrize("aliased", ["twice", "overlapping views"])
def test_parameters_sharing_memory_are_gathered_not_written_twice(aliased: str) -> None:
    """One array handed over as two parameters (or two views of one buffer that overlap): the group kernels would
    write it twice, racing; the step takes the gathering path instead, with its results (each parameter's new
    value from the old one, the last write kept)."""
    pytest.importorskip("numba")
    from adadiag_ref.optim.families.adam.group_route import disjoint

    assert disjoint([0, 16], [4, 4], 4) and not disjoint([0, 12], [4, 4], 4) and not disjoint([8, 8], [1, 1], 4)
    cfg = ar.make_config("adamw", weight_decay=0.1)
    buffer = np.arange(12, dtype=np.float32)
    shared = [buffer, buffer] if aliased == "twice" else [buffer[:8], buffer[4:]]
    twin = buffer.copy()
    twins = [twin, twin] if aliased == "twice" else [twin[:8], twin[4:]]
    grads = [np.ones(p.shape, np.float32) for p in shared]
    engine, reference = ar.Engine(shared, cfg), ar.Engine(twins, cfg)
    for group in reference._flat:
        group.kernels = None  # the gathering path
    engine.step(grads, shared)
    reference.step(grads, twins)
    np.testing.assert_array_equal(buffer, twin)


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_the_threaded_gemm_phase_gives_step_s_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy: a rotation phase large enough to be spread over threads with single-threaded BLAS
    (``blas_threads.run_balanced``) gives the bits of per-parameter ``ar.refresh_basis`` (on BLAS's own threads,
    as the engine's refresh) then ``ar.update`` with BLAS on one thread: each product is the same single-threaded
    BLAS call either way.  OpenBLAS's bits depend on its thread count (0.3.31, float64, 300 x 300: the
    decomposition and the products both), so plain ``ar.step`` on BLAS's own threads agrees to rounding only."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from adadiag_ref.optim import blas_threads

    spread = []
    real = blas_threads.run_balanced

    def spread_over_two(tasks: Any, n_threads: Any = None) -> None:
        spread.append(len(tasks))
        real(tasks, n_threads=2)

    monkeypatch.setattr("adadiag_ref.optim.engine.run_balanced", spread_over_two)
    monkeypatch.setattr("adadiag_ref.optim.engine.spreads", lambda flops: True)  # one job per matrix
    monkeypatch.setattr(blas_threads, "MIN_FLOPS", 0.0)
    cfg = ar.make_config(name, update_freq=2, weight_decay=0.1)
    shapes = [(160, 240), (240, 160), (160, 240), (96,), (300, 300)]
    host_params, stream = _stream(shapes, np.float64, steps=3, seed=11)
    params = [p.copy() for p in host_params]
    engine = ar.Engine(params, cfg)
    singles, states = [p.copy() for p in host_params], [ar.init(p, cfg) for p in host_params]

    def step(state: Any, g: np.ndarray, w: np.ndarray, count: int) -> tuple[np.ndarray, Any]:
        refreshed = False
        if ar.refresh_due(count, cfg):
            new = ar.refresh_basis(state, g, cfg)
            refreshed, state = new.P is not state.P, new
        with threadpoolctl.threadpool_limits(1):
            delta, state = ar.update(state, g, cfg, w, refreshed=refreshed, count=count)
        return w + delta, state

    for k, grads in enumerate(stream):
        engine.step(grads, params)
        pairs = [step(s, g, w, k) for s, g, w in zip(states, grads, singles, strict=True)]
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    assert spread and max(spread) == 5  # the phases were spread, one job per matrix (2 + 1 + 1 + 1 in four blocks)
    for i, want in enumerate(singles):
        _assert_close(params[i], want, True, np.float64)
        _assert_states(engine.state(i), states[i], True, np.float64)


def test_run_balanced_runs_every_job_once_and_raises_their_error() -> None:
    from adadiag_ref.optim.blas_threads import run_balanced

    done: list[int] = []
    run_balanced([(float(k), lambda k=k: done.append(k)) for k in range(7)], n_threads=3)
    assert sorted(done) == list(range(7))

    def fail() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_balanced([(1e9, fail), (1e9, lambda: done.append(99))], n_threads=2)
    assert 99 in done  # the other thread's job ran


def test_a_small_rotation_phase_is_one_call_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``blas_threads.MIN_FLOPS`` a NumPy rotation phase is not spread: one job per block (each a batched
    call over the block's stack), not one per matrix, whose Python costs more than the products of small ones."""
    from adadiag_ref.optim import blas_threads

    jobs: list[int] = []
    real = blas_threads.run_balanced

    def record(tasks: Any, n_threads: Any = None) -> None:
        jobs.append(len(tasks))
        real(tasks, n_threads)

    monkeypatch.setattr("adadiag_ref.optim.engine.run_balanced", record)
    cfg = ar.make_config("adadiag", weight_decay=0.1)
    params = [np.ones(s, np.float32) for s in [(8, 8)] * 5 + [(8, 20)] * 3]
    engine = ar.Engine(params, cfg)
    engine.step([np.full(p.shape, 0.5, np.float32) for p in params], params)
    assert jobs and set(jobs) == {2}  # two blocks (8 x 8: five matrices; 8 x 20: three), per phase


# ----------------------------------------------------------------------------- CPU torch tensors: the group kernels


@pytest.mark.skipif(not _kernels_available(), reason="numba is not installed")
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", ENTRYWISE)
def test_engine_over_cpu_torch_tensors_runs_the_group_kernels(name: str, dtype: Any) -> None:
    """An engine over CPU torch tensors steps an unrotated group in place by the numba group kernels (the tensors'
    memory by ``data_ptr()``), and writes a rotated group's tail so: the reference's arithmetic and, in host
    memory, its GEMMs per matrix (``mm``, not a batched ``bmm``, which rounds otherwise), so ``ar.step``'s bits on
    the same tensors for every parameter; a NaN then raises with nothing changed.  ``max_basis_dim=4`` leaves the
    larger matrices unrotated, so that a rotated optimizer has members of both kinds."""
    torch = pytest.importorskip("torch")
    cfg = ar.make_config(name, update_freq=3, weight_decay=0.1, max_basis_dim=4)
    host_params, stream = _stream(SHAPES, dtype, steps=5)
    params = [_torch(p) for p in host_params]
    engine = ar.Engine(params, cfg)
    routes = engine.routes()
    unrotated = [i for i, s in enumerate(SHAPES) if not ar.layout_for(s, cfg).rotate_left]
    rotated = [i for i in range(len(SHAPES)) if i not in unrotated]
    assert unrotated and (name == "adamw" or rotated)
    assert all("engine_step over the members' own memory" in routes[i].entrywise for i in unrotated), routes
    assert all("engine_tail over the members' own memory" in routes[i].entrywise for i in rotated), routes
    singles, states = _in_lockstep(engine, params, host_params, stream, cfg, _torch)
    for i, (w, want) in enumerate(zip(params, singles, strict=True)):
        _assert_close(w, want, True, dtype)
        _assert_states(engine.state(i), states[i], True, dtype)
    before = _snapshot(engine, params)
    bad = [torch.ones_like(p) for p in params]
    bad[unrotated[0]].view(-1)[5] = float("nan")
    message = rf"1 NaN or Inf entry in the gradient of parameter \(shape \({SHAPES[unrotated[0]][0]}, "
    with pytest.raises(ValueError, match=message):
        engine.step(bad, params)
    for x, y in zip(before, _snapshot(engine, params), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(not _kernels_available(), reason="numba is not installed")
def test_engine_follows_a_cpu_torch_parameter_whose_storage_was_replaced() -> None:
    """A torch tensor keeps its Python identity when its storage is replaced (``p.data = ...``): the group kernels
    read its address again at every step, so the step writes the new storage, as ``ar.step`` on it would."""
    torch = pytest.importorskip("torch")
    cfg = ar.make_config("adamw", weight_decay=0.1)
    params = [torch.nn.Parameter(torch.randn(6, 5, dtype=torch.float64)) for _ in range(3)]
    engine = ar.Engine(params, cfg)
    grads = [torch.randn(6, 5, dtype=torch.float64) for _ in params]
    engine.step(grads, params)
    old = params[1].data
    params[1].data = old.clone() + 1.0  # new memory, the same Parameter object
    want = params[1].detach().clone()
    state = engine.state(1)
    expected, _ = ar.step(state, grads[1], cfg, want, count=1)
    kept = old.clone()
    engine.step(grads, params)
    assert torch.equal(params[1].detach(), expected)
    assert torch.equal(old, kept)  # the replaced storage is not written


@pytest.mark.skipif(not _kernels_available(), reason="numba is not installed")
def test_engine_over_cpu_torch_tensors_cuts_its_kernels_over_torchs_threads_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU torch tensors the group kernels' chunk table is cut into guided pieces over ``torch.get_num_threads()``
    threads (``torch_route.split_rows``, here forced on small tensors): the same bits on 1 and on 3 threads."""
    torch = pytest.importorskip("torch")
    from adadiag_ref.optim.families.adam import torch_route

    monkeypatch.setattr(torch_route, "SPLIT_MIN_SIZE", 333)
    cuts: list[int] = []
    real_cuts = torch_route.guided_cuts
    monkeypatch.setattr(torch_route, "guided_cuts", lambda *a: cuts.append(1) or real_cuts(*a))
    results = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            gen = torch.Generator().manual_seed(5)
            params = [torch.randn(s, generator=gen, dtype=torch.float32) for s in [(30, 70), (2001,), (9, 4)]]
            grads = [[torch.randn(p.shape, generator=gen, dtype=torch.float32) for p in params] for _ in range(4)]
            engine = ar.Engine(params, ar.make_config("adamw", weight_decay=0.1))
            for g in grads:
                engine.step(g, params)
            results[n] = [p.clone() for p in params] + [engine.state(i).V.clone() for i in range(len(params))]
    finally:
        torch.set_num_threads(threads)
    assert cuts  # the 3-thread run was cut into pieces
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[3], strict=True))


SCHEDULED = [((0.9, 0.999), 0.1), ((0.85, 0.99), 0.0), ((0.95, 0.999), 0.05), ((0.3, 0.5), 0.2), ((0.9, 0.9), 0.1)]
"""Per-step ``(betas, weight_decay)``: OneCycleLR's ``cycle_momentum`` moves ``beta_1`` at every step, a schedule
the weight decay, here switched off and on again."""


@pytest.mark.skipif(not _kernels_available(), reason="numba is not installed")
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", ["adamw", "adadiag"])
def test_a_step_s_own_betas_and_weight_decay_are_the_group_kernels_scalars(
    name: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's own ``betas`` and ``weight_decay`` (a scheduler's) still run the group kernels, with ``ar.step``'s
    bits under the same keywords: an unrotated group's whole step in place (AdamW's without gathering), a rotated
    group's moments and tail.  Before, such a step took the gathering path: AdamW over 3 M float32 entries of CPU
    torch tensors then took 10x the time of a step under the engine's own config.  (AdaDiag's largest matrix is
    64 x 64: a 300 x 300 one is decomposed and multiplied by OpenBLAS threads, whose bits differ between calls.)"""
    if backend == "torch":
        pytest.importorskip("torch")
    convert = BACKENDS[backend]
    cfg = ar.make_config(name, update_freq=2, weight_decay=0.1)
    shapes = GROUP_SHAPES if name == "adamw" else [(64, 64), *GROUP_SHAPES[1:]]
    host_params, stream = _stream(shapes, np.float32, steps=len(SCHEDULED))
    params = [convert(p) for p in host_params]
    engine = ar.Engine(params, cfg)
    ran: Counter[str] = Counter()
    for group in engine._flat:
        assert group.kernels is not None
        for kernel in ("step", "moments", "tail"):
            original = getattr(group.kernels, kernel)
            monkeypatch.setattr(group.kernels, kernel,
                                lambda *a, _k=kernel, _f=original, **kw: ran.update([_k]) or _f(*a, **kw))  # fmt: skip
    if name == "adamw":
        _no_gather(engine, monkeypatch)
    singles, states = [convert(p) for p in host_params], [ar.init(convert(p), cfg) for p in host_params]
    for k, (grads, (betas, weight_decay)) in enumerate(zip(stream, SCHEDULED, strict=True)):
        engine.step([convert(g) for g in grads], params, betas=betas, weight_decay=weight_decay)
        pairs = [ar.step(s, convert(g), cfg, w, count=k, betas=betas, weight_decay=weight_decay)
                 for s, g, w in zip(states, grads, singles, strict=True)]  # fmt: skip
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    wanted: Counter[str] = Counter()
    for group in engine._flat:
        wanted.update(["moments", "tail"] if group.blocks else ["step"])
    assert ran == Counter({kernel: len(SCHEDULED) * n for kernel, n in wanted.items()}), (ran, wanted)
    for i, (w, want) in enumerate(zip(params, singles, strict=True)):
        _assert_close(w, want, True, np.float32)
        _assert_states(engine.state(i), states[i], True, np.float32)
