"""DCP on a fresh optimizer: torch.distributed.checkpoint's state initialisation counts no step.

``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` initialise an optimizer without state by a step with
zero gradients and ``lr = 0`` (``_init_optim_state``).  Counted, it would leave ``step = 1`` with the identity
basis and postpone the first refresh to ``t = 1 + T``.  The DCP functions run without a process group.
Float64 and the same operations in the same order: every comparison is bit for bit (``torch.equal``).
"""

from __future__ import annotations

import _adapter_import  # noqa: F401
import pytest

torch = pytest.importorskip("torch")
state_dict_api = pytest.importorskip("torch.distributed.checkpoint.state_dict")

from adadiag_ref.adapters.pytorch import OPTIMIZER_CLASSES  # noqa: E402

FREQ = 3  # refreshes at t = 1, 4, 7


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5, dtype=torch.float64), torch.nn.Tanh(), torch.nn.Linear(5, 3, dtype=torch.float64)
    )


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = (torch.randn(8, n, generator=gen, dtype=torch.float64) for n in (6, 3))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _run(name: str, steps: int, *, dcp_first: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = OPTIMIZER_CLASSES[name](model.parameters(), lr=0.01, weight_decay=0.1, update_freq=FREQ)
    if dcp_first:
        state_dict_api.get_optimizer_state_dict(model, opt)
    _train(model, opt, range(steps))
    return model, opt


def _assert_same(a: tuple[torch.nn.Module, torch.optim.Optimizer], b: tuple[torch.nn.Module, torch.optim.Optimizer]):
    for p, q in zip(a[0].parameters(), b[0].parameters(), strict=True):
        assert torch.equal(p, q)
        assert a[1].state[p].keys() == b[1].state[q].keys()
        for key, value in a[1].state[p].items():
            assert torch.equal(value, b[1].state[q][key]), key


@pytest.mark.parametrize("name", list(OPTIMIZER_CLASSES))
def test_dcp_initialisation_counts_no_step_and_the_first_real_step_refreshes(name):
    model = _model()
    opt = OPTIMIZER_CLASSES[name](model.parameters(), lr=0.01, weight_decay=0.1, update_freq=FREQ)
    before = [p.detach().clone() for p in model.parameters()]
    saved = state_dict_api.get_optimizer_state_dict(model, opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(int(state["step"]) == 0 for state in saved["state"].values())
    assert saved["param_groups"][0]["lr"] == 0.01  # restored by DCP after its step
    _assert_same(_run(name, 4, dcp_first=True), _run(name, 4, dcp_first=False))  # t = 1 and t = 4 refresh


@pytest.mark.parametrize("name", ["adadiag", "adafacdiag_pp"])
@pytest.mark.parametrize("at", [0, 2])
def test_resume_from_a_dcp_checkpoint_equals_the_uninterrupted_run(name, at, tmp_path):
    """Saved with ``dcp.save`` at step ``at`` (0: right after DCP initialised the state), loaded by a new optimizer
    with ``set_optimizer_state_dict`` (which initialises it first), continued across the refresh at t = 4."""
    import torch.distributed.checkpoint as dcp

    model, opt = _run(name, at, dcp_first=True)
    dcp.save({"model": model.state_dict(), "opt": state_dict_api.get_optimizer_state_dict(model, opt)},
             checkpoint_id=tmp_path)  # fmt: skip
    resumed = _model()
    resumed_opt = OPTIMIZER_CLASSES[name](resumed.parameters(), lr=0.5, update_freq=FREQ)  # lr from the checkpoint
    loaded = {"model": resumed.state_dict(), "opt": state_dict_api.get_optimizer_state_dict(resumed, resumed_opt)}
    dcp.load(loaded, checkpoint_id=tmp_path)
    resumed.load_state_dict(loaded["model"])
    state_dict_api.set_optimizer_state_dict(resumed, resumed_opt, loaded["opt"])
    _train(resumed, resumed_opt, range(at, 5))
    _assert_same((resumed, resumed_opt), _run(name, 5, dcp_first=False))


def test_a_step_with_a_nonzero_gradient_or_lr_counts():
    """Only the all-zero, lr = 0 first step is an initialisation: a zero-lr warm-up step with a real gradient counts."""
    for lr, scale in ((0.0, 1.0), (0.01, 0.0)):
        p = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.float64))
        opt = OPTIMIZER_CLASSES["adadiag"]([p], lr=lr)
        p.grad = scale * torch.ones_like(p)
        opt.step()
        assert int(opt.state[p]["step"]) == 1, (lr, scale)
