"""update_in_place is the functional update, bit for bit, without new moment arrays."""

from __future__ import annotations

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref import _kernels

NAMES = list(ar.OPTIMIZERS)


def _run(name: str, w0, grads, functional: bool, **kw):
    cfg = ar.make_config(name, **kw)
    w = w0.copy() if hasattr(w0, "copy") else w0.clone()
    state = ar.init(w, cfg)
    for g in grads:
        refreshed = ar.refresh_due(int(state.count), cfg)
        if refreshed:
            state = ar.refresh_basis(state, g, cfg)
        if functional:
            delta, state = ar.update(state, g, cfg, w, refreshed=refreshed)
            w = w + delta
        else:
            before = [id(a) for a in state[1:]]
            state = ar.update_in_place(state, g, cfg, w, refreshed=refreshed)
            assert [id(a) for a in state[1:]] == before  # the buffers are reused, not replaced
    return w, state


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (7,), (2, 3, 2), (150, 120)])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_in_place_is_bit_identical(name: str, shape: tuple[int, ...], dtype: str) -> None:
    # CPU tensors of the Adam family take the numba kernels on NumPy views (with torch's own sqrt), the others
    # torch ops; (150, 120) spans two blocks of that route
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, dtype=torch.float64, generator=gen).to(getattr(torch, dtype))
    grads = torch.randn((8, *shape), dtype=torch.float64, generator=gen).to(getattr(torch, dtype))
    kw = dict(lr=1e-2, weight_decay=0.05, update_freq=3)
    w_f, s_f = _run(name, w0, grads, True, **kw)
    w_i, s_i = _run(name, w0, grads, False, **kw)
    assert torch.equal(w_f, w_i)
    for a, b in zip(s_f, s_i):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
@pytest.mark.parametrize("kernels", ["reference", "numba"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(4, 6), (6, 4), (7,)])
def test_numpy_in_place_equals_generic_path(name: str, kernels: str, dtype: type, shape: tuple[int, ...]) -> None:
    # Both in-place forms (backend ufuncs, and the fused numba kernel of the Adam direction) against the
    # functional reference path: the same IEEE operations on the same operands, so bit for bit.
    if kernels == "numba" and not _kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(shape).astype(dtype)
    grads = rng.standard_normal((7, *shape)).astype(dtype)
    kw = dict(lr=1e-2, weight_decay=0.1, update_freq=2)
    w_f, s_f = _run(name, w0, grads, True, kernels="reference", **kw)
    w_i, s_i = _run(name, w0, grads, False, kernels=kernels, **kw)
    np.testing.assert_array_equal(w_f, w_i)
    np.testing.assert_array_equal(s_f.M, s_i.M)
    np.testing.assert_array_equal(s_f.V, s_i.V)


def test_bfloat16_parameter_in_place() -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn((4, 6), generator=gen).bfloat16()
    grads = torch.randn((5, 4, 6), generator=gen).bfloat16()
    w_f, s_f = _run("adadiag", w0, grads, True, lr=1e-2)
    w_i, s_i = _run("adadiag", w0, grads, False, lr=1e-2)
    assert w_i.dtype == torch.bfloat16 and s_i.M.dtype == torch.float32
    assert torch.equal(w_f, w_i) and torch.equal(s_f.M, s_i.M) and torch.equal(s_f.V, s_i.V)


def test_jax_arrays_are_rejected() -> None:
    jnp = pytest.importorskip("jax.numpy")
    w = jnp.zeros((2, 3))
    cfg = ar.make_config("adamw")
    assert not ar.optim.supports_in_place(w)
    with pytest.raises(TypeError, match="mutable"):
        ar.update_in_place(ar.init(w, cfg), w, cfg, w)


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_update_in_place_is_all_or_nothing_on_torch(name: str, monkeypatch) -> None:
    """A failure in the last product (``P U~ Q^T``) leaves the parameter and the moments bit-identical: nothing is
    written before everything that can fail has run."""
    torch = pytest.importorskip("torch")
    from adadiag_ref.optim import rotation

    gen = torch.Generator().manual_seed(3)
    cfg = ar.make_config(name, lr=1e-2, weight_decay=0.1)
    w = torch.randn(6, 9, generator=gen)
    state = ar.init(w, cfg)
    for _ in range(2):
        g = torch.randn(6, 9, generator=gen)
        state = ar.update_in_place(ar.refresh_basis(state, g, cfg), g, cfg, w, refreshed=True)
    before = [x.clone() for x in (w, state.M, state.V)]

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(rotation, "unrotate", boom)
    with pytest.raises(RuntimeError, match="injected"):
        ar.update_in_place(state, torch.randn(6, 9, generator=gen), cfg, w)
    assert all(torch.equal(a, b) for a, b in zip(before, (w, state.M, state.V)))


def test_buffers_whose_flags_have_no_writeable_field_are_accepted() -> None:
    # CuPy's ndarray.flags has c_contiguous/f_contiguous/owndata but no writeable: the check raised AttributeError
    from types import SimpleNamespace

    from adadiag_ref.optim import inplace

    cupy_like = SimpleNamespace(flags=SimpleNamespace(c_contiguous=True, f_contiguous=False, owndata=True))
    inplace._check_writable({"parameter": cupy_like, "state field 'M'": None})
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="the parameter is read-only"):
        inplace._check_writable({"parameter": read_only})
