"""The library's warnings name the user's line (``adadiag_ref._xp.warn_at_caller``), however deep they were raised.

A fixed ``stacklevel`` named a frame of the library whenever the public call went through another of its functions:
``ar.step`` (through ``refresh_basis``), a refresh whose decomposition falls back (through ``canonical_svd``), the
torch adapter's ``step()`` (through torch's optimizer hooks and the engine), a jitted optax update (through JAX's
host callback).  Each test checks the warning's file is this one.
"""

from __future__ import annotations

import warnings

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref import linalg
from adadiag_ref.optim import core


def _only(caught: list[warnings.WarningMessage], category: type[Warning]) -> warnings.WarningMessage:
    found = [w for w in caught if issubclass(w.category, category)]
    assert found, [str(w.message) for w in caught]
    return found[0]


def test_a_non_finite_refresh_through_step_names_the_callers_line() -> None:
    cfg = ar.make_config("adadiag")
    w = np.ones((4, 6))
    g = np.ones((4, 6))
    g[1, 2] = np.nan
    with pytest.warns(core.NonFiniteGradientWarning) as caught:
        ar.step(ar.init(w, cfg), g, cfg, w, check=False)
    assert _only(caught, core.NonFiniteGradientWarning).filename == __file__


def test_a_decomposition_fallback_through_refresh_basis_names_the_callers_line(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise np.linalg.LinAlgError("injected: SVD did not converge")

    ladder = list(linalg.DECOMPOSITION_LADDER)
    monkeypatch.setattr(linalg, "DECOMPOSITION_LADDER", [(ladder[0][0], broken), *ladder[1:]])
    cfg = ar.make_config("adadiag")
    w = np.random.default_rng(0).standard_normal((4, 6))
    with pytest.warns(linalg.DecompositionWarning, match="retrying") as caught:
        ar.refresh_basis(ar.init(w, cfg), w, cfg)
    assert _only(caught, linalg.DecompositionWarning).filename == __file__


def test_a_slow_refresh_found_by_the_torch_adapters_step_names_the_step_line(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from adadiag_ref.adapters import pytorch as at

    monkeypatch.setattr(core, "SLOW_REFRESH_SIDE", 4)  # a 5-wide rotated side is "slow" here
    p = torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float64))
    opt = at.AdaDiagPP([p], update_freq=None)
    p.grad = torch.randn_like(p)
    with pytest.warns(core.SlowRefreshWarning) as caught:
        opt.step()
    assert _only(caught, core.SlowRefreshWarning).filename == __file__


def test_a_non_finite_refresh_in_a_jitted_optax_update_names_the_update_line() -> None:
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    from adadiag_ref.adapters import optax as ox

    params = {"w": jax.numpy.ones((4, 6))}
    opt = ox.adadiag(1e-2)
    state = opt.init(params)
    g = np.ones((4, 6))
    g[1, 2] = np.inf
    update = jax.jit(opt.update)
    with pytest.warns(core.NonFiniteGradientWarning) as caught:
        _, state = update({"w": jax.numpy.asarray(g)}, state, params)
        jax.block_until_ready(state)
    assert _only(caught, core.NonFiniteGradientWarning).filename == __file__
