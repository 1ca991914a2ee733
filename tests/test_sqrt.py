"""The library's square root: IEEE 754's correctly rounded one on every backend (docs/spec.md, "The square root").

Eager ``torch.sqrt`` of a CPU tensor is MKL VML's root on x86 builds, which differs from the correctly rounded one in
the last bit of some entries; :func:`adadiag_ref._xp.sqrt` takes NumPy's root there, so a trajectory on torch's CPU
has the bits of the same trajectory on NumPy.  The check of "correctly rounded" is exact (rational arithmetic), not
a comparison with another library's root.
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest
from array_api_compat import array_namespace

import adadiag_ref as ar
from adadiag_ref._xp import sqrt

torch = pytest.importorskip("torch")


def _probe(dtype: type) -> np.ndarray:
    """Zeros, subnormals, the extremes, ``inf``, and random mantissas over the whole exponent range."""
    info = np.finfo(dtype)
    rng = np.random.default_rng(31)
    exponents = rng.uniform(np.log2(float(info.smallest_subnormal)), np.log2(float(info.max)) - 1, 1500)
    random = np.exp2(exponents) * rng.uniform(1.0, 2.0, exponents.size)
    special = [0.0, float(info.smallest_subnormal), float(info.smallest_normal), float(info.max), 1.0, 2.0, 3.0]
    return np.concatenate([np.asarray(special), random, rng.uniform(0.0, 4.0, 500)]).astype(dtype)


def _correctly_rounded(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per entry: whether ``y`` is the float nearest ``sqrt(x)``: the exact root lies strictly between the midpoints
    of ``y`` and its neighbours (it is never a midpoint itself: the square of a midpoint has more bits than ``x``)."""
    below = np.nextafter(y, np.zeros_like(y))
    above = np.nextafter(y, np.full_like(y, np.inf))
    ok = []
    for xi, yi, lo, hi in zip(x.tolist(), y.tolist(), below.tolist(), above.tolist(), strict=True):
        if xi == 0.0 or np.isinf(xi):
            ok.append(yi == xi)
            continue
        r, f = Fraction(xi), Fraction(yi)
        low = (Fraction(lo) + f) / 2 if yi > 0 else Fraction(0)
        high = (f + Fraction(hi)) / 2 if np.isfinite(hi) else f * 2
        ok.append(low * low < r < high * high)
    return np.asarray(ok)


def _as(backend: str, x: np.ndarray):  # type: ignore[no-untyped-def]
    if backend == "torch":
        return torch.from_numpy(x.copy())
    if backend == "array_api_strict":
        return pytest.importorskip("array_api_strict").asarray(x.copy())
    if backend == "jax":
        return pytest.importorskip("jax.numpy").asarray(x)
    return x.copy()


def _host(y) -> np.ndarray:  # type: ignore[no-untyped-def]
    return y.numpy() if isinstance(y, torch.Tensor) else np.asarray(y)


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [(b, d) for b in ("numpy", "torch", "array_api_strict") for d in (np.float32, np.float64)] + [("jax", np.float32)],
)
def test_the_library_root_is_correctly_rounded(backend: str, dtype: type) -> None:
    """On every backend (JAX in its default float32), ``sqrt`` is the float nearest the exact root, checked in
    rational arithmetic over the probe.  XLA on the CPU flushes subnormal numbers to zero in all its arithmetic, so
    JAX is checked on the others (docs/spec.md)."""
    x = _probe(dtype)
    if backend == "jax":
        x = x[(x == 0) | (x >= np.finfo(dtype).smallest_normal)]
    arr = _as(backend, x)
    y = _host(sqrt(arr, array_namespace(arr)))
    assert y.dtype == x.dtype
    good = _correctly_rounded(x, y)
    assert good.all(), (x[~good][:5], y[~good][:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_torch_cpu_root_keeps_layouts_writes_out_and_gives_nan_quietly(dtype) -> None:  # type: ignore[no-untyped-def]
    """A strided view (the result in the layout ``torch.sqrt`` gives it), a 0-d tensor, ``out=``, and a negative
    entry (NaN, as ``torch.sqrt``, without NumPy's warning); every result equal to NumPy's root of the same
    values."""
    xp = array_namespace(torch.zeros(()))
    base = torch.rand(6, 8, dtype=dtype) * 100
    view = base.t()[::2]  # non-contiguous
    y = sqrt(view, xp)
    assert y.shape == view.shape and y.stride() == torch.sqrt(view).stride()  # torch's own choice of layout
    assert np.array_equal(y.numpy(), np.sqrt(view.numpy()))
    scalar = sqrt(torch.tensor(2.0, dtype=dtype), xp)
    assert scalar.shape == () and scalar.item() == float(np.sqrt(np.asarray(2.0, dtype=view.numpy().dtype)))
    out = torch.full_like(base, -1.0)
    assert sqrt(base, xp, out=out) is out
    assert np.array_equal(out.numpy(), np.sqrt(base.numpy()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        negative = sqrt(torch.tensor([-1.0, 4.0], dtype=dtype), xp)
    assert torch.isnan(negative[0]) and negative[1].item() == 2.0


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_cpu_adamw_has_the_numpy_trajectorys_bits(dtype: type, kernels: str) -> None:
    """The torch adapter's ``AdamW`` on CPU tensors (the default route's kernels and the reference route's torch
    ops) against ``ar.step`` on NumPy arrays: the same bits at every step.  Unrotated, so no GEMM (whose rounding
    differs between BLAS libraries) enters; the gradients are many, so a root one ulp off anywhere would show."""
    from adadiag_ref.adapters import pytorch as at

    rng = np.random.default_rng(5)
    shapes = [(64, 48), (300,), (130, 300)]  # the group kernels, and the large lane (more than 16384 entries)
    start = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(3)]
    hyper = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8}

    cfg = ar.make_config("adamw", **hyper)
    weights = [w.copy() for w in start]
    states = [ar.init(w, cfg) for w in weights]
    params = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in start]
    opt = at.AdamW(params, kernels=kernels, **hyper)
    for t, step in enumerate(grads):
        for k, g in enumerate(step):
            weights[k], states[k] = ar.step(states[k], g, cfg, weights[k])
            params[k].grad = torch.from_numpy(g.copy())
        opt.step()
        for k, p in enumerate(params):
            assert np.array_equal(p.detach().numpy(), weights[k]), (t, k)
            assert np.array_equal(opt.state[p]["V"].numpy(), np.asarray(states[k].V)), (t, k)
