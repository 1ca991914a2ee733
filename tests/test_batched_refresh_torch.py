"""The torch adapter's refresh step batches the refreshes due (``ar.refresh_bases``), with the bases of one
refresh at a time.

A refresh step decomposes all parameters of one work shape and config with one stacked ``torch.linalg`` call
(on CUDA one cuSOLVER batch instead of one launch sequence per parameter).  On CPU torch's stacked LAPACK
calls decompose each matrix as the single call does, so the trajectory is the core's bit for bit.
"""

from __future__ import annotations

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import pytest
import torch
from adadiag_ref.adapters import pytorch as at

import adadiag_ref as ar

SHAPES = [(6, 9), (9, 6), (6, 9), (6, 9), (4,)]  # four of work shape 6 x 9 (one transposed), a vector


def _counting(monkeypatch, name):
    """Count the core's calls of ``torch.linalg.<name>`` (through the array-API namespace it calls them by)."""
    from array_api_compat.torch import linalg

    calls = []
    original = getattr(linalg, name)

    def counted(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(linalg, name, counted)
    return calls


@pytest.mark.parametrize(("dtype", "method", "routine"), [(torch.float64, "svd", "svd"),
                                                          (torch.float32, "auto", "eigh")])  # fmt: skip
@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_refresh_step_decomposes_each_work_shape_once(monkeypatch, name, dtype, method, routine):
    if name == "adadiag_pp":
        routine = "svd"  # two-sided: the Gram route does not apply
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)) for s in SHAPES]
    opt = at.OPTIMIZER_CLASSES[name](params, lr=0.01, update_freq=2, basis_method=method)
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES] for _ in range(3)]
    calls = _counting(monkeypatch, routine)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    # the refreshes at t = 1 and t = 3: one stacked call each for the four 6 x 9 work matrices (their SVD, or eigh
    # of their 6 x 6 Gram matrices), where one refresh at a time made four; the vector's stays a call of its own
    stacked = [c for c in calls if len(c) == 3]
    assert len(stacked) == 2 and all(c[:2] == (4, 6) for c in stacked), calls
    assert all(c[0] == 1 for c in calls if len(c) == 2), calls  # only the 1 x 4 vector one by one
    monkeypatch.undo()
    cfg = opt.config()
    for i, p in enumerate(params):
        state = opt.state[p]
        # the bases of one refresh at a time of the last refresh's gradient, to rounding: LAPACK sees the stack's
        # contiguous copy instead of the transposed parameter's view (float32: a few ulps; rtol 1e-12 / 1e-5)
        core = ar.refresh_basis(ar.init(p.detach(), cfg), grads[2][i], cfg)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for field in ("P", "Q"):
            if field in state:
                torch.testing.assert_close(state[field], getattr(core, field), rtol=tol, atol=tol)
