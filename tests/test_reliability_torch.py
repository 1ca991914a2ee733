"""The torch adapter names the parameter in the core's refresh warnings (docs/reliability.md).

The adapter validates finiteness itself; what reaches the core's
``refresh_basis`` and can warn is a failing decomposition, whose
``DecompositionWarning`` must say which parameter (``name=``) it was.
"""

from __future__ import annotations

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from adadiag_ref.adapters import pytorch as at  # noqa: E402

from adadiag_ref import linalg  # noqa: E402


@pytest.fixture
def broken_ladder(monkeypatch):
    """Every rung of the decomposition ladder raises: ``refresh_basis`` keeps the basis with a warning."""

    def broken(*args, **kwargs):
        raise np.linalg.LinAlgError("injected: SVD did not converge")

    monkeypatch.setattr(linalg, "DECOMPOSITION_LADDER", [(rung, broken) for rung, _ in linalg.DECOMPOSITION_LADDER])


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
