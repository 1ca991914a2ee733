"""torch.optim conventions, run on every adapter class and on ``torch.optim.AdamW`` as the control.

Each test states one convention that torch.optim's own optimizer tests check for
AdamW (state_dict round trips, schedulers, hooks, validation, ...).  The control
shows that the test asserts torch's behaviour, not ours; the adapter classes
must behave the same.  Trajectories of one optimizer against itself (resume vs
uninterrupted, deepcopy, tensor vs float lr) are compared bit for bit
(``torch.equal``): the same operations run on the same numbers.
"""

from __future__ import annotations

import copy
import io

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import pytest
import torch
from adadiag_ref.adapters import pytorch as at

CONTROL = "torch.optim.AdamW"
SUBJECTS = [*at.OPTIMIZER_CLASSES, CONTROL]
SHAPES = [(5, 7), (7,), (6, 2, 2)]  # matrix, vector, conv kernel (reshaped to a transposed 6 x 4 work frame)
HYPER = {"lr": 0.01, "weight_decay": 0.1}
FREQ = 3  # the adapters refresh their bases at t = 1, 4, 7, ...


def make(subject, params, **kwargs):
    """The optimizer under test: an adapter class (refreshing every FREQ steps) or the control."""
    kwargs = {**HYPER, **kwargs}
    if subject == CONTROL:
        return torch.optim.AdamW(params, **kwargs)
    return at.OPTIMIZER_CLASSES[subject](params, update_freq=FREQ, **kwargs)


def make_params(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)) for s in SHAPES]


def grads_for(params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params] for _ in range(steps)
    ]


def run(opt, params, grads):
    """Feed the gradients; returns the parameters after the last step (cloned)."""
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


pytestmark = pytest.mark.parametrize("subject", SUBJECTS)


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("step_as", ["tensor", "python int", "python float"])
def test_state_dict_round_trip_then_step_equals_uninterrupted(subject, step_as):
    params = make_params()
    grads = grads_for(params, 9)
    opt = make(subject, params)
    run(opt, params, grads[:5])
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    for state in saved["optim"]["state"].values():  # older checkpoints keep the counter as a Python number
        if step_as != "tensor":
            state["step"] = (int if step_as == "python int" else float)(state["step"].item())
    resumed = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = make(subject, resumed, lr=0.5)  # the checkpoint's lr wins
    opt2.load_state_dict(saved["optim"])
    assert opt2.param_groups[0]["lr"] == HYPER["lr"]
    assert_same(run(opt2, resumed, grads[5:]), run(opt, params, grads[5:]))


def test_state_dict_casts_floating_state_like_torch(subject):
    """A float64 checkpoint loaded for float32 parameters: floating state becomes float32, as in torch.optim."""
    params = make_params()
    opt = make(subject, params)
    run(opt, params, grads_for(params, 2))
    params32 = make_params(torch.float32)
    opt32 = make(subject, params32)
    opt32.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in params32:
        state = opt32.state[p]
        assert all(v.dtype == torch.float32 for k, v in state.items() if k != "step")
        assert all(v.device == p.device for v in state.values())
    run(opt32, params32, grads_for(params32, 2))
    assert all(torch.isfinite(p).all() for p in params32)


def test_state_dict_references_live_state(subject):
    """``state_dict()`` holds references, not copies, for every field ("step" included), as torch.optim does."""
    params = make_params()
    grads = grads_for(params, 4)
    opt = make(subject, params)
    run(opt, params, grads[:2])
    saved = opt.state_dict()
    run(opt, params, grads[2:])
    for index, p in enumerate(params):
        live = opt.state[p]
        assert set(saved["state"][index]) == set(live)
        for key, value in live.items():
            assert torch.equal(saved["state"][index][key], value), key


def test_deepcopy_continues_identically(subject):
    params = make_params()
    grads = grads_for(params, 7)
    opt = make(subject, params)
    run(opt, params, grads[:4])
    params2, opt2 = copy.deepcopy((params, opt))
    assert opt2.param_groups[0]["params"][0] is params2[0]
    assert_same(run(opt2, params2, grads[4:]), run(opt, params, grads[4:]))


# ----------------------------------------------------------------------------- groups and grads


def test_add_param_group_uses_its_own_hyperparameters(subject):
    params = make_params()
    grads = grads_for(params, 4)
    first, later = params[:1], params[1:]
    first2, later2 = clone_params(first), clone_params(later)
    opt = make(subject, first)
    opt.add_param_group({"params": later, "lr": 0.05})
    assert opt.param_groups[1]["betas"] == opt.defaults["betas"]  # missing entries come from the defaults
    got = run(opt, params, grads)
    expect_first = run(make(subject, first2), first2, [g[:1] for g in grads])
    expect_later = run(make(subject, later2, lr=0.05), later2, [g[1:] for g in grads])
    assert_same(got, expect_first + expect_later)


def test_parameters_without_grad_are_untouched(subject):
    params = make_params()
    opt = make(subject, params)
    frozen = params[0].detach().clone()
    for step_grads in grads_for(params, 3):
        for p, g in zip(params[1:], step_grads[1:], strict=True):
            p.grad = g.clone()
        opt.step()
    assert torch.equal(params[0].detach(), frozen)
    assert not opt.state.get(params[0])


def test_step_with_closure_returns_its_loss(subject):
    p = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
    opt = make(subject, [p], lr=0.1, weight_decay=0.0)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) == 6.0 and len(calls) == 1
    assert float((p.detach() ** 2).sum()) < 6.0


def test_zero_grad_sets_grads_to_none(subject):
    params = make_params()
    opt = make(subject, params)
    run(opt, params, grads_for(params, 1))
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_maximize_equals_minimising_the_negated_gradient(subject):
    params, negated = make_params(), make_params()
    grads = grads_for(params, 5)
    up = run(make(subject, params, maximize=True), params, grads)
    down = run(make(subject, negated), negated, [[-g for g in gs] for gs in grads])
    assert_same(up, down)


def test_lr_as_a_0d_tensor_equals_the_float(subject):
    params, params2 = make_params(), make_params()
    grads = grads_for(params, 5)
    assert_same(
        run(make(subject, params, lr=torch.tensor(0.01, dtype=torch.float64)), params, grads),
        run(make(subject, params2), params2, grads),
    )


# ----------------------------------------------------------------------------- schedulers

SCHEDULERS = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.9**k),
    "MultiplicativeLR": lambda o: torch.optim.lr_scheduler.MultiplicativeLR(o, lambda k: 0.9),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 4], gamma=0.5),
    "ConstantLR": lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=3),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=4),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=6, power=2.0),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.001, 0.01, step_size_up=2, cycle_momentum=True),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01, total_steps=8, cycle_momentum=True),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
        ],
        milestones=[2],
    ),
    "ChainedScheduler": lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
        ]
    ),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_every_lr_scheduler_drives_the_step(subject, scheduler):
    """The scheduled run equals a run whose ``lr`` and ``betas`` are set by hand to the scheduler's values.

    CyclicLR and OneCycleLR with ``cycle_momentum`` drive ``betas[0]``.
    """
    params, params2 = make_params(), make_params()
    grads = grads_for(params, 8)
    opt = make(subject, params)
    sched = SCHEDULERS[scheduler](opt)
    seen = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
        opt.step()
        sched.step(1.0) if scheduler == "ReduceLROnPlateau" else sched.step()
    assert len({lr for lr, _ in seen}) > 1, "the scheduler did not change the learning rate"
    if scheduler in ("CyclicLR", "OneCycleLR"):
        assert len({betas for _, betas in seen}) > 1, "cycle_momentum did not change betas"
    by_hand = make(subject, params2)
    for (lr, betas), step_grads in zip(seen, grads, strict=True):
        by_hand.param_groups[0]["lr"], by_hand.param_groups[0]["betas"] = lr, betas
        run(by_hand, params2, [step_grads])
    assert_same([p.detach() for p in params], [p.detach() for p in params2])


# ----------------------------------------------------------------------------- hooks


def test_step_and_state_dict_hooks_run(subject):
    params = make_params()
    opt = make(subject, params)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("step_pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("step_post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": calls.append("sd_post") or 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    run(opt, params, grads_for(params, 1))
    saved = opt.state_dict()
    assert saved["extra"] == 1
    opt.load_state_dict(saved)
    assert calls == ["step_pre", "step_post", "sd_pre", "sd_post", "load_pre", "load_post"]


# ----------------------------------------------------------------------------- errors


def test_sparse_gradients_are_rejected_with_a_clear_error(subject):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = make(subject, emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"(?i)sparse"):
        opt.step()
    assert torch.equal(emb.weight.detach(), before)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Invalid learning rate: -1.0"),
        ({"lr": float("nan")}, "Invalid learning rate: nan"),
        ({"lr": torch.tensor([0.1, 0.2])}, "Tensor lr must be 1-element"),
        ({"eps": -1e-8}, "Invalid epsilon value: -1e-08"),
        ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
        ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1: -0.1"),
        ({"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
    ],
)
def test_invalid_hyperparameters_raise_torchs_message(subject, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        make(subject, make_params(), **kwargs)
