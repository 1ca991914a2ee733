"""The torch adapter names the parameter in the core's refresh warnings (docs/reliability.md).

The adapter validates finiteness itself; what reaches the core's
``refresh_basis`` and can warn is a failing decomposition, whose
``DecompositionWarning`` must say which parameter (``name=``) it was.
"""

from __future__ import annotations

import contextlib

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from adadiag_ref.adapters import pytorch as at  # noqa: E402

import adadiag_ref as ar  # noqa: E402
from adadiag_ref import linalg  # noqa: E402


def _break_the_ladder(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise np.linalg.LinAlgError("injected: SVD did not converge")

    monkeypatch.setattr(linalg, "DECOMPOSITION_LADDER", [(rung, broken) for rung, _ in linalg.DECOMPOSITION_LADDER])


@pytest.fixture
def broken_ladder(monkeypatch):
    """Every rung of the decomposition ladder raises: ``refresh_basis`` keeps the basis with a warning."""
    _break_the_ladder(monkeypatch)


def test_refresh_warning_names_a_named_parameter(broken_ladder) -> None:
    model = torch.nn.Linear(3, 2, dtype=torch.float64)
    opt = at.AdaDiagPP(model.named_parameters())
    model.weight.grad = torch.randn_like(model.weight)
    model.bias.grad = torch.randn_like(model.bias)
    with pytest.warns(linalg.DecompositionWarning, match=r"parameter 'weight' \(shape \(2, 3\)\) at step 1.*kept"):
        opt.step()


def test_refresh_warning_names_an_unnamed_parameter_by_group_and_index(broken_ladder) -> None:
    a = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    opt = at.AdaDiag([{"params": [a]}, {"params": [a.new_zeros(2, 2).requires_grad_(), b]}])
    b.grad = torch.randn_like(b)
    pattern = r"parameter 'param_groups\[1\]\.params\[1\]' \(shape \(5, 3\)\) at step 1.*kept"
    with pytest.warns(linalg.DecompositionWarning, match=pattern):
        opt.step()


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp", "adafacdiag", "adafacdiag_pp", "hfacdiag"])
def test_a_kept_basis_gives_the_bits_of_ar_step(name, monkeypatch) -> None:
    """A refresh whose decomposition fails keeps the previous basis and is no refresh for the update
    (``refreshed=False``: no refresh-step structure), as in ``ar.step``.  Step 3's gradient lies in the span of the
    kept ``P``'s first two columns, so ``P^T G`` has rows of pure rounding noise that the floor would zero: the
    adapter's parameter and state must equal ``ar.step``'s on the same tensors bit for bit at every step."""
    shape, freq = (5, 7), 2  # refreshes due at t = 1, 3
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64))
    opt = at.OPTIMIZER_CLASSES[name]([w], lr=1e-2, update_freq=freq)
    cfg = ar.make_config(name, update_freq=freq)
    core_w, core_state = w.detach().clone(), ar.init(w.detach(), cfg)
    for t in range(1, 5):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        if t == 3:
            g = core_state.P[:, :2] @ torch.randn(2, shape[1], generator=gen, dtype=torch.float64)
            _break_the_ladder(monkeypatch)
        w.grad = g.clone()
        with pytest.warns(linalg.DecompositionWarning) if t == 3 else contextlib.nullcontext():
            opt.step()
        with pytest.warns(linalg.DecompositionWarning) if t == 3 else contextlib.nullcontext():
            core_w, core_state = ar.step(core_state, g, cfg, core_w, lr=1e-2)
        monkeypatch.undo()
        assert torch.equal(w.detach(), core_w), f"W after step {t}"
        expected = at.from_core_state(core_state)
        assert set(opt.state[w]) == set(expected)
        for key, value in expected.items():
            assert torch.equal(opt.state[w][key].to(value.dtype), value), f"{key} after step {t}"
