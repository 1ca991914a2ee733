"""The GPU path's CPU proxies (issue 24): host conversions and namespace calls on ``array_api_strict``.

``array_api_strict`` arrays stand in for device arrays (:mod:`adadiag_ref.perf.traffic`): a host conversion is
a synchronisation on a GPU, a namespace call a kernel launch.  Checked here:

* a step without refresh, with the host counter (``count=``) and ``check=False``, converts nothing; with
  ``check=True`` it converts once (the finiteness verdict);
* the host counter changes nothing but where the coefficients are computed: the same trajectory (bit for bit:
  ``array_api_strict`` computes with NumPy, and the host coefficients are NumPy's in the state's precision);
* a refresh of a 512 x 512 matrix with a ``1/i`` spectrum in float32 (the canonical rules' worst case: the
  tail of the spectrum is one wide cluster) makes at most 32 host conversions and 1,000 namespace calls, and
  its counts grow by less than 1.5x from 256 to 512, with the same bases as NumPy's;
* :func:`adadiag_ref.multi_step` reads the verdict once for all parameters, equals ``step`` per parameter, and
  its calls other than views do not grow with the number of parameters (it runs through the engine:
  ``tests/test_optim_engine.py``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import to_np

import adadiag_ref as ar
from adadiag_ref.perf.traffic import count_traffic

xs = pytest.importorskip("array_api_strict")

OPTIMIZERS = list(ar.OPTIMIZERS)
SHAPES = [(6, 9), (9, 6), (5,), (2, 3, 4)]
VIEW_CALLS = {"reshape", "__getitem__", "astype", "matrix_transpose"}  # no kernel: views or same-dtype no-ops


def host(x):
    return np.from_dlpack(x)


def strict(a):
    return xs.asarray(np.asarray(a))


def warmed(name, shape, dtype, rng, *, steps=1, **options):
    """``(cfg, state, W)`` after ``steps`` steps (the first refreshes), on array_api_strict arrays."""
    cfg = ar.make_config(name, update_freq=10, weight_decay=0.1, **options)
    w = strict(rng.standard_normal(shape).astype(dtype))
    state = ar.init(w, cfg)
    for k in range(steps):
        w, state = ar.step(state, strict(rng.standard_normal(shape).astype(dtype)), cfg, w, count=k)
    return cfg, state, w


def spectrum_matrix(side, rng):
    """``U diag(1/i) V^T`` with random orthogonal ``U``, ``V``, in float32."""
    U, _ = np.linalg.qr(rng.standard_normal((side, side)))
    V, _ = np.linalg.qr(rng.standard_normal((side, side)))
    return ((U / np.arange(1, side + 1)) @ V.T).astype(np.float32)


# ----------------------------------------------------------------------------- one step


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_step_without_refresh_converts_nothing(name, shape, dtype):
    rng = np.random.default_rng(0)
    cfg, state, w = warmed(name, shape, dtype, rng)
    g = strict(rng.standard_normal(shape).astype(dtype))
    with count_traffic() as unchecked:
        ar.step(state, g, cfg, w, count=1, check=False)
    with count_traffic() as checked:
        ar.step(state, g, cfg, w, count=1, check=True)
    assert unchecked.host_conversions == 0, dict(unchecked.conversions)
    assert checked.host_conversions == 1, dict(checked.conversions)  # the finiteness verdict


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_host_counter_gives_the_same_trajectory(name):
    """``count=`` against the state's counter, 12 steps with refreshes at 1 and 11: the same bits in float32; in
    float64 within 1e-12 (docs/spec.md, "The step's coefficients": the host counter's coefficients come from the C
    library's float64 ``expm1``, the device counter's from the backend's, which may differ by an ulp, and a refresh
    at step 11 carries that through one SVD)."""
    rng = np.random.default_rng(1)
    for shape in SHAPES:
        for dtype in (np.float32, np.float64):
            cfg = ar.make_config(name, update_freq=10, weight_decay=0.1)
            w_host = w_device = strict(rng.standard_normal(shape).astype(dtype))
            s_host = s_device = ar.init(w_host, cfg)
            for k in range(12):
                g = strict(rng.standard_normal(shape).astype(dtype))
                w_host, s_host = ar.step(s_host, g, cfg, w_host, count=k)
                w_device, s_device = ar.step(s_device, g, cfg, w_device)
            same = np.testing.assert_array_equal if dtype == np.float32 else _within_1e12
            same(host(w_host), host(w_device))
            assert int(s_host.count) == int(s_device.count) == 12
            for field in s_host._fields[1:]:
                a, b = getattr(s_host, field), getattr(s_device, field)
                assert (a is None) == (b is None)
                if a is not None:
                    same(host(a), host(b))


def _within_1e12(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * float(np.max(np.abs(b), initial=0.0)))


def test_host_counter_on_numpy_is_bit_identical_to_the_state_counter():
    rng = np.random.default_rng(2)
    for name in OPTIMIZERS:
        cfg = ar.make_config(name, update_freq=5, kernels="reference")
        w1 = w2 = rng.standard_normal((7, 5)).astype(np.float32)
        s1 = s2 = ar.init(w1, cfg)
        for k in range(7):
            g = rng.standard_normal((7, 5)).astype(np.float32)
            w1, s1 = ar.step(s1, g, cfg, w1, count=k)
            w2, s2 = ar.step(s2, g, cfg, w2)
        np.testing.assert_array_equal(w1, w2)


@pytest.mark.parametrize("bad", [-1, 1.0, True, "3", np.float32(2.0)])
def test_bad_host_counter_is_refused_before_any_work(bad):
    rng = np.random.default_rng(3)
    cfg, state, w = warmed("adadiag", (4, 6), np.float64, rng)
    g = strict(rng.standard_normal((4, 6)))
    with pytest.raises((TypeError, ValueError), match="count"):
        ar.step(state, g, cfg, w, count=bad)
    with pytest.raises((TypeError, ValueError), match="count"):
        ar.multi_step([state], [g], cfg, [w], count=bad)


def test_error_message_names_the_host_step():
    rng = np.random.default_rng(4)
    cfg, state, w = warmed("adamw", (3, 4), np.float64, rng)
    g = host(strict(rng.standard_normal((3, 4)))).copy()
    g[1, 2] = np.nan
    assert int(state.count) == 1  # the message's step is the host counter's (42), not the state's (2)
    with pytest.raises(ValueError, match=r"parameter 'fc' \(shape \(3, 4\)\) at step 42; the optimizer state"):
        ar.step(state, strict(g), cfg, w, count=41, name="fc")


def test_schedules_return_host_numbers_for_a_host_step():
    """With a NumPy step and device arrays, the coefficients are Python floats equal to the device values."""
    from adadiag_ref.optim.schedules import adafactor_beta2, beta_hat, host_step, one_minus_power, relative_step

    for dtype in (xs.float32, xs.float64):
        for count in (0, 1, 6, 999):
            t_host = host_step(count, dtype, xs)
            t_device = xs.asarray(count + 1, dtype=dtype)
            for fn, args in (
                (beta_hat, (0.9,)),
                (beta_hat, (0.0,)),
                (one_minus_power, (0.999,)),
                (adafactor_beta2, None),
                (relative_step, (1e-2,)),
            ):
                if args is None:
                    on_host, on_device = fn(t_host, 0.8, xs), fn(t_device, 0.8, xs)
                else:
                    on_host, on_device = fn(*args, t_host, xs), fn(*args, t_device, xs)
                assert type(on_host) is float
                if dtype == xs.float32:  # float64 on both sides, rounded once: the same float32
                    assert on_host == float(on_device), (fn.__name__, count)
                else:  # the C library's expm1 against the backend's: within an ulp of float64
                    assert abs(on_host - float(on_device)) <= 2.3e-16 * abs(on_host), (fn.__name__, count)


# ----------------------------------------------------------------------------- refresh


@pytest.mark.parametrize(("name", "method"), [("adadiag", "auto"), ("adadiag", "svd"), ("adadiag_pp", "auto")])
def test_refresh_device_traffic_is_bounded_and_flat(name, method):
    rng = np.random.default_rng(5)
    counts = {}
    for side in (256, 512):
        G_host = spectrum_matrix(side, rng)
        G = strict(G_host)
        cfg = ar.make_config(name, basis_method=method)
        state = ar.init(G, cfg)
        with count_traffic() as traffic:
            new = ar.refresh_basis(state, G, cfg)
        counts[side] = traffic
        # the same rules on the host copy: NumPy's bases exactly (array_api_strict computes with NumPy)
        ref = ar.refresh_basis(ar.init(G_host, cfg), G_host, cfg)
        np.testing.assert_array_equal(host(new.P), ref.P)
        if ref.Q is not None:
            np.testing.assert_array_equal(host(new.Q), ref.Q)
    big, small = counts[512], counts[256]
    assert big.host_conversions <= 32, dict(big.conversions)
    assert big.namespace_calls <= 1000, dict(big.calls)
    assert big.host_conversions < 1.5 * max(small.host_conversions, 1)
    assert big.namespace_calls < 1.5 * max(small.namespace_calls, 1)


def test_canonicalize_svd_of_device_factors_stays_on_the_device():
    """Public ``canonicalize_svd`` on device factors: only ``S`` comes to the host, a bounded number of calls,
    the NumPy result."""
    from adadiag_ref.linalg import canonicalize_svd

    rng = np.random.default_rng(6)
    G = spectrum_matrix(128, rng)
    U, S, Vh = np.linalg.svd(G, full_matrices=False)
    with count_traffic() as traffic:
        out = canonicalize_svd(strict(U), strict(S), strict(Vh), G.shape)
    ref = canonicalize_svd(U, S, Vh, G.shape)
    np.testing.assert_array_equal(host(out.P), ref.P)
    np.testing.assert_array_equal(host(out.Q), ref.Q)
    assert out.rank == ref.rank
    # the 128 singular values (no cluster at this size: the gaps 1/i^2 exceed 128 eps32) are the only read-back
    assert traffic.host_conversions == 1 and traffic.bytes_to_host == 128 * 4, traffic
    assert traffic.namespace_calls <= 40, dict(traffic.calls)


# ----------------------------------------------------------------------------- many parameters


MIXED = [(6, 9), (9, 6), (5,), (2, 3, 4), ()]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_multi_step_equals_step_per_parameter(name, dtype):
    rng = np.random.default_rng(7)
    cfg = ar.make_config(name, update_freq=3, weight_decay=0.1)
    ws = [strict(rng.standard_normal(s).astype(dtype)) for s in MIXED]
    states_multi = states_single = [ar.init(w, cfg) for w in ws]
    w_multi = w_single = ws
    for k in range(7):
        gs = [strict(rng.standard_normal(s).astype(dtype)) for s in MIXED]
        w_multi, states_multi = ar.multi_step(states_multi, gs, cfg, w_multi, count=k)
        pairs = [ar.step(s, g, cfg, w, count=k) for s, g, w in zip(states_single, gs, w_single, strict=True)]
        w_single, states_single = [p for p, _ in pairs], [s for _, s in pairs]
    for a, b, shape in zip(w_multi, w_single, MIXED, strict=True):
        assert tuple(a.shape) == shape and a.dtype == b.dtype
        np.testing.assert_array_equal(host(a), host(b))  # the same entry expressions and coefficients
    for a, b in zip(states_multi, states_single, strict=True):
        assert int(a.count) == int(b.count) == 7
        for field in a._fields[1:-1]:
            x, y = getattr(a, field), getattr(b, field)
            if x is not None:
                np.testing.assert_array_equal(host(x), host(y))


def test_multi_step_takes_mappings_and_numpy():
    rng = np.random.default_rng(8)
    cfg = ar.make_config("adadiag", update_freq=2)
    params = {"a": rng.standard_normal((4, 6)), "b": rng.standard_normal((6,))}
    states = {k: ar.init(v, cfg) for k, v in params.items()}
    grads = {k: rng.standard_normal(v.shape) for k, v in params.items()}
    new_params, new_states = ar.multi_step(states, grads, cfg, params)
    assert set(new_params) == set(new_states) == {"a", "b"}
    for k in params:
        w, s = ar.step(states[k], grads[k], cfg, params[k])
        np.testing.assert_array_equal(new_params[k], w)
        np.testing.assert_array_equal(new_states[k].M, s.M)
    grads["b"] = grads["b"].copy()
    grads["b"][2] = np.inf
    with pytest.raises(ValueError, match="parameter 'b'"):
        ar.multi_step(states, grads, cfg, params)


def test_multi_step_reads_the_verdict_once_and_refuses_before_any_change():
    rng = np.random.default_rng(9)
    cfg = ar.make_config("adadiag", update_freq=10)
    shapes = [(4, 6), (6, 4), (3,)]
    ws = [strict(rng.standard_normal(s)) for s in shapes]
    states = [ar.init(w, cfg) for w in ws]
    ws, states = ar.multi_step(states, [strict(rng.standard_normal(s)) for s in shapes], cfg, ws, count=0)
    gs = [strict(rng.standard_normal(s)) for s in shapes]
    with count_traffic() as traffic:
        ar.multi_step(states, gs, cfg, ws, count=1)
    assert traffic.host_conversions == 1, dict(traffic.conversions)
    with count_traffic() as traffic:
        ar.multi_step(states, gs, cfg, ws, count=1, check=False)
    assert traffic.host_conversions == 0, dict(traffic.conversions)
    bad = host(gs[1]).copy()
    bad[0, 0] = np.nan
    snapshot = [host(s.M).copy() for s in states]
    with pytest.raises(ValueError, match=r"parameter 'second' \(shape \(6, 4\)\) at step 2"):
        ar.multi_step(states, [gs[0], strict(bad), gs[2]], cfg, ws, count=1, names=["first", "second", "third"])
    for s, before in zip(states, snapshot, strict=True):
        np.testing.assert_array_equal(host(s.M), before)
    with pytest.raises(ValueError, match="gradient shape"):
        ar.multi_step(states, [gs[0], gs[0], gs[2]], cfg, ws, count=1)


def _arithmetic(traffic):
    return Counter({k: v for k, v in traffic.calls.items() if k not in VIEW_CALLS})


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_multi_step_launches_do_not_grow_with_the_parameter_count(name):
    """Apart from views, the calls are the same for 2 and 16 parameters of one shape (issue 31: through the
    engine, the check is one sum per group and the rotations batched GEMMs over the shape's stack; before, one
    sum per gradient and two or four GEMMs per rotated parameter)."""
    rng = np.random.default_rng(10)
    cfg = ar.make_config(name)

    def traffic(n):
        ws = [strict(rng.standard_normal((8, 12)).astype(np.float32)) for _ in range(n)]
        states = [ar.init(w, cfg) for w in ws]
        gs = [strict(rng.standard_normal((8, 12)).astype(np.float32)) for _ in range(n)]
        ws, states = ar.multi_step(states, gs, cfg, ws, count=0)
        with count_traffic() as counted:
            ar.multi_step(states, gs, cfg, ws, count=1)
        return _arithmetic(counted)

    few, many = traffic(2), traffic(16)
    assert many == few, (many - few, few - many)


# ----------------------------------------------------------------------------- the refreshes of a step, batched

ROTATED = [name for name, spec in ar.OPTIMIZERS.items() if spec.sides]
REFRESH_SHAPES = [(6, 9), (9, 6), (6, 9), (4, 4), (4, 4), (5,), (7, 3)]  # groups of 3 (work 6 x 9), 2 and 1


def _fields_equal(a, b):
    for field in ("P", "Q"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            np.testing.assert_array_equal(host(x), host(y))


def _gradients(rng, shapes, dtype):
    return [strict(rng.standard_normal(s).astype(dtype)) for s in shapes]


@pytest.mark.parametrize("name", ROTATED)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("method", ["svd", "gram", "auto"])
def test_refresh_bases_equals_refresh_basis(name, dtype, method):
    """Bit for bit on array_api_strict: NumPy's stacked ``svd``/``eigh`` decompose each matrix as the single
    call does, and the canonical rules run on the same host factors."""
    rng = np.random.default_rng(11)
    cfg = ar.make_config(name, basis_method=method)
    states = [ar.init(strict(np.zeros(s, dtype)), cfg) for s in REFRESH_SHAPES]
    grads = _gradients(rng, REFRESH_SHAPES, dtype)
    batched = ar.refresh_bases(states, grads, cfg)
    for state, grad, new in zip(states, grads, batched, strict=True):
        _fields_equal(new, ar.refresh_basis(state, grad, cfg))
        moments = state._fields[3:-1]
        assert all(getattr(new, f) is getattr(state, f) for f in moments) and new.count is state.count


@pytest.mark.parametrize("method", ["svd", "auto"])
def test_refresh_bases_reads_back_once_per_group(method):
    """Two host conversions per group (the finiteness verdict, and the singular values with the factors'
    finiteness: the canonical rules stay on the device), whatever its size; one refresh at a time converts per
    matrix."""
    rng = np.random.default_rng(12)
    cfg = ar.make_config("adadiag", basis_method=method)

    def conversions(n, batched):
        grads = _gradients(rng, [(8, 12)] * n, np.float32)
        states = [ar.init(g, cfg) for g in grads]
        with count_traffic() as traffic:
            if batched:
                ar.refresh_bases(states, grads, cfg)
            else:
                for s, g in zip(states, grads, strict=True):
                    ar.refresh_basis(s, g, cfg)
        return traffic.host_conversions

    assert conversions(2, True) == conversions(16, True) == 2
    assert conversions(16, False) >= 16 * 2


def test_multi_step_refresh_reads_back_per_group_not_per_parameter():
    rng = np.random.default_rng(13)
    cfg = ar.make_config("adadiag_pp", update_freq=5)

    def conversions(n):
        ws = _gradients(rng, [(6, 10)] * n, np.float32)
        states = [ar.init(w, cfg) for w in ws]
        with count_traffic() as traffic:
            ar.multi_step(states, _gradients(rng, [(6, 10)] * n, np.float32), cfg, ws, count=0, check=False)
        return traffic.host_conversions

    # the verdict, S of the one stacked SVD, and the rank's columns of every Q to complete (6 x 10: 4 columns)
    assert conversions(2) == conversions(12) == 3


def test_refresh_bases_keeps_the_failure_policy_of_refresh_basis():
    rng = np.random.default_rng(14)
    cfg = ar.make_config("adadiag")
    grads = _gradients(rng, [(4, 6)] * 3, np.float64)
    states = [ar.init(g, cfg) for g in grads]
    states = ar.refresh_bases(states, grads, cfg)
    bad = host(grads[1]).copy()
    bad[1, 2] = np.nan
    grads[1] = strict(bad)
    with pytest.warns(ar.optim.core.NonFiniteGradientWarning, match="parameter 'b'"):
        new = ar.refresh_bases(states, grads, cfg, names=["a", "b", "c"])
    assert new[1].P is states[1].P  # the previous basis, as the very same object
    for i in (0, 2):
        _fields_equal(new[i], ar.refresh_basis(states[i], grads[i], cfg))
    with pytest.raises(ValueError, match=r"parameter 'b'.*left unchanged"):
        ar.refresh_bases(states, grads, cfg, names=["a", "b", "c"], on_nonfinite="raise")


def test_refresh_bases_falls_back_per_matrix_when_the_stacked_decomposition_fails(monkeypatch):
    rng = np.random.default_rng(15)
    cfg = ar.make_config("adadiag_pp")
    grads = _gradients(rng, [(5, 7)] * 4, np.float64)
    states = [ar.init(g, cfg) for g in grads]
    expected = [ar.refresh_basis(s, g, cfg) for s, g in zip(states, grads, strict=True)]
    single_svd = xs.linalg.svd

    def no_stacks(x, /, **kwargs):
        if x.ndim > 2:
            raise np.linalg.LinAlgError("no stacks today")
        return single_svd(x, **kwargs)

    monkeypatch.setattr(xs.linalg, "svd", no_stacks)
    for new, ref in zip(ar.refresh_bases(states, grads, cfg), expected, strict=True):
        _fields_equal(new, ref)


def test_refresh_bases_refuses_bad_input_before_any_work():
    rng = np.random.default_rng(16)
    cfg = ar.make_config("adadiag")
    grads = _gradients(rng, [(4, 6), (4, 6)], np.float64)
    states = [ar.init(g, cfg) for g in grads]
    with pytest.raises(ValueError, match="one gradient per state"):
        ar.refresh_bases(states, grads[:1], cfg)
    with pytest.raises(ValueError, match="on_nonfinite"):
        ar.refresh_bases(states, grads, cfg, on_nonfinite="skip")
    with pytest.raises(ValueError, match="names has 1"):
        ar.refresh_bases(states, grads, cfg, names=["a"])
    with pytest.raises(ValueError, match="shape"):
        ar.refresh_bases(states, [grads[0], strict(np.ones((6, 5)))], cfg)
    with pytest.raises(ValueError, match="one shape and one dtype"):
        ar.linalg.canonical_svd_batch([grads[0], strict(np.ones((4, 5)))])
    with pytest.raises(ValueError, match="method"):
        ar.linalg.canonical_svd_batch(grads, method="qr")


def test_canonical_svd_batch_leaves_numpy_and_single_matrices_to_canonical_svd():
    rng = np.random.default_rng(17)
    mats = [rng.standard_normal((3, 5)) for _ in range(3)]
    assert ar.linalg.canonical_svd_batch(mats) == [None, None, None]
    assert ar.linalg.canonical_svd_batch([strict(mats[0])]) == [None]
    assert ar.linalg.canonical_svd_batch([]) == []


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_refresh_bases_on_every_backend(xp, name, dtype):
    """Every backend's stacked decomposition gives the single refresh's bases: to 1e-12 in float64 and 1e-5 in
    float32 (two calls of one LAPACK or cuSOLVER routine, batched or not, agree to a few ulps; the canonical
    rules then remove every choice), and the NumPy reference's."""
    rng = np.random.default_rng(18)
    cfg = ar.make_config(name, basis_method="auto")
    shapes = [(5, 8), (8, 5), (5, 8), (3,)]
    host_grads = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [xp.asarray(g) for g in host_grads]
    states = [ar.init(g, cfg) for g in grads]
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == np.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for i, new in enumerate(ar.refresh_bases(states, grads, cfg)):
        reference = ar.refresh_basis(ar.init(host_grads[i], cfg), host_grads[i], cfg)
        for field in ("P", "Q"):
            got, want = getattr(new, field), getattr(reference, field)
            assert (got is None) == (want is None)
            if got is not None:
                np.testing.assert_allclose(to_np(got), want, **tol)


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_multi_step_keeps_the_parameters_memory_order(name):
    """A tall parameter's state matrices are the transposed views of parameter-ordered buffers (``init``), so
    that ``G``, ``W`` and the moments are read in one order; ``multi_step``'s flat groups keep it (flattening in
    the parameter's orientation is a view, the work frame's a transposing copy), and the new parameter stays
    contiguous, so the next step reads it in order too."""
    torch = pytest.importorskip("torch")
    cfg = ar.make_config(name)
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(s, generator=gen) for s in [(12, 4), (4, 12), (6, 2, 3)]]
    states = [ar.init(w, cfg) for w in ws]
    for count in range(3):
        gs = [torch.randn(w.shape, generator=gen) for w in ws]
        ws, states = ar.multi_step(states, gs, cfg, ws, count=count)
        for w, s in zip(ws, states, strict=True):
            assert w.is_contiguous()
            tall = w.shape[0] > w[0].numel()
            for moment in (s.M, s.V):
                assert (moment.mT if tall else moment).is_contiguous(), (count, tuple(w.shape))
