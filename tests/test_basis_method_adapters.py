"""``basis_method`` reaches the refresh through both framework adapters (they build configs from kwargs)."""

from __future__ import annotations

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

from adadiag_ref.linalg import canonical_svd


def _gradient() -> np.ndarray:
    rng = np.random.default_rng(31)
    U, _ = np.linalg.qr(rng.standard_normal((24, 24)))
    V, _ = np.linalg.qr(rng.standard_normal((50, 24)))
    return ((U / np.arange(1, 25)) @ V.T).astype(np.float32)


@pytest.mark.parametrize("method", ["svd", "gram", "auto"])
def test_torch_adapter_forwards_basis_method(method: str) -> None:
    torch = pytest.importorskip("torch")
    from adadiag_ref.adapters import pytorch

    g = _gradient()
    p = torch.nn.Parameter(torch.zeros(24, 50))
    opt = pytorch.AdaDiag([p], lr=1e-3, basis_method=method)
    assert opt.config(0).basis_method == method
    p.grad = torch.from_numpy(g)
    opt.step()
    expected = canonical_svd(torch.from_numpy(g), compute_q=False, method=method).P  # the same backend's route
    torch.testing.assert_close(opt.state[p]["P"], expected, rtol=0, atol=0)


def test_torch_adapter_rejects_unknown_basis_method() -> None:
    torch = pytest.importorskip("torch")
    from adadiag_ref.adapters import pytorch

    with pytest.raises(ValueError, match="basis_method must be one of"):
        pytorch.AdaDiag([torch.nn.Parameter(torch.zeros(3, 4))], lr=1e-3, basis_method="qr")


@pytest.mark.parametrize("method", ["svd", "gram"])
def test_optax_adapter_forwards_basis_method(method: str) -> None:
    jnp = pytest.importorskip("jax.numpy")
    pytest.importorskip("optax")
    from adadiag_ref.adapters import optax as ao

    g = _gradient()
    tx = ao.scale_by_core("adadiag", basis_method=method)
    params = jnp.zeros((24, 50), dtype=jnp.float32)
    _, state = tx.update(jnp.asarray(g), tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(state.states.P), canonical_svd(g, compute_q=False, method=method).P)
    with pytest.raises(ValueError, match="basis_method must be one of"):
        ao.scale_by_core("adadiag", basis_method="qr")
