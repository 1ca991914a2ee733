"""The PyTorch adapter (``adadiag_ref.adapters.pytorch``) against the core, for all eight optimizers.

Tolerances: the adapter calls the same core functions on the same torch tensors
as ``ar.replay`` / ``ar.step``, so trajectories are compared bit for bit
(``torch.equal``) where the op sequence is identical, and with rtol 1e-12
(float64) where a second implementation (``torch.optim.AdamW``) is involved.
"""

from __future__ import annotations

import copy
import io

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import pytest
import torch
from adadiag_ref.adapters import _sharded
from adadiag_ref.adapters import pytorch as at

import adadiag_ref as ar

NAMES = list(ar.OPTIMIZERS)
CLASSES = at.OPTIMIZER_CLASSES
SHAPES = [(5, 7), (7,), (6, 2, 2)]  # matrix, vector (1 x n rule), conv kernel (reshaped 6 x 4, transposed)
STEPS, FREQ = 12, 3  # refreshes at t = 1, 4, 7, 10
HYPER = {"lr": 0.01, "weight_decay": 0.1, "update_freq": FREQ}


def _stream(shape, steps=STEPS, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    grads = torch.randn((steps, *shape), generator=gen, dtype=torch.float64).to(dtype)
    return w0, grads


def _run(opt, params, grads_per_param):
    """Feed the given gradients; returns the trajectory of each parameter."""
    trajs = [[] for _ in params]
    for k in range(len(grads_per_param[0])):
        for p, gs in zip(params, grads_per_param):
            p.grad = gs[k].clone()
        opt.step()
        for traj, p in zip(trajs, params):
            traj.append(p.detach().clone())
    return [torch.stack(t) for t in trajs]


@pytest.mark.parametrize("name", NAMES)
def test_trajectory_equals_core_replay(name):
    streams = [_stream(s, seed=i) for i, s in enumerate(SHAPES)]
    params = [torch.nn.Parameter(w0.clone()) for w0, _ in streams]
    opt = CLASSES[name](params, **HYPER)
    trajs = _run(opt, params, [g for _, g in streams])
    for (w0, grads), traj in zip(streams, trajs):
        ref = ar.replay(name, w0, grads, **HYPER)
        torch.testing.assert_close(traj, ref, rtol=1e-12, atol=0)
        assert torch.equal(traj, ref)  # same core calls on the same tensors: bit-identical
    assert int(opt.state[params[0]]["step"]) == STEPS


@pytest.mark.parametrize("name", NAMES)
def test_state_layout(name):
    w0, grads = _stream((5, 7), steps=1)
    p = torch.nn.Parameter(w0.clone())
    opt = CLASSES[name]([p], **HYPER)
    _run(opt, [p], [grads])
    state = opt.state[p]
    cfg = opt.config()
    core = ar.init(w0, cfg)
    expected = {"step"} | {f for f in core._fields[1:] if getattr(core, f) is not None}
    assert set(state) == expected
    assert state["step"].dtype == torch.int32 and state["step"].ndim == 0
    assert all(v.dtype == torch.float64 for k, v in state.items() if k != "step")


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_continues_bit_identically(name):
    w0, grads = _stream((5, 7), steps=2 * STEPS)
    p1 = torch.nn.Parameter(w0.clone())
    opt1 = CLASSES[name]([p1], **HYPER)
    _run(opt1, [p1], [grads[:5]])
    buffer = io.BytesIO()
    torch.save({"param": p1.detach().clone(), "optim": opt1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    p2 = torch.nn.Parameter(saved["param"].clone())
    opt2 = CLASSES[name]([p2], lr=0.5, update_freq=FREQ, weight_decay=0.1)  # lr comes from the checkpoint
    opt2.load_state_dict(saved["optim"])
    assert opt2.param_groups[0]["lr"] == HYPER["lr"]
    t1 = _run(opt1, [p1], [grads[5:]])[0]
    t2 = _run(opt2, [p2], [grads[5:]])[0]
    assert torch.equal(t1, t2)


@pytest.mark.parametrize("name", NAMES)
def test_param_groups_use_their_own_hyperparameters(name):
    (w_a, g_a), (w_b, g_b) = _stream((5, 7), seed=1), _stream((4, 3), seed=2)
    a, b = torch.nn.Parameter(w_a.clone()), torch.nn.Parameter(w_b.clone())
    opt = CLASSES[name](
        [{"params": [a]}, {"params": [b], "lr": 0.05, "weight_decay": 0.0, "update_freq": 2}],
        lr=0.01,
        weight_decay=0.1,
        update_freq=FREQ,
    )
    ta, tb = _run(opt, [a, b], [g_a, g_b])
    assert torch.equal(ta, ar.replay(name, w_a, g_a, lr=0.01, weight_decay=0.1, update_freq=FREQ))
    assert torch.equal(tb, ar.replay(name, w_b, g_b, lr=0.05, weight_decay=0.0, update_freq=2))


@pytest.mark.parametrize("name", NAMES)
def test_no_grad_and_zero_grad_behave_like_torch_adamw(name):
    for cls in (CLASSES[name], torch.optim.AdamW):
        skipped = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.float64))
        zero = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.float64))
        opt = cls([skipped, zero], lr=0.01, weight_decay=0.1)
        zero.grad = torch.zeros_like(zero)
        for _ in range(3):
            opt.step()
        assert torch.equal(skipped, torch.ones(3, 4, dtype=torch.float64)), cls
        assert skipped not in opt.state or not opt.state[skipped], cls
        assert torch.isfinite(zero).all(), cls
        # zero gradient: only the decoupled decay acts, W_3 = (1 - lr wd)^3 W_0 (Adafactor/Hfac: clip keeps U = 0)
        torch.testing.assert_close(zero.detach(), torch.full((3, 4), (1 - 1e-3) ** 3, dtype=torch.float64))


def test_adamw_matches_torch_adamw():
    w0, grads = _stream((5, 7))
    p, q = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    mine = at.AdamW([p], lr=0.01, weight_decay=0.1)
    ref = torch.optim.AdamW([q], lr=0.01, weight_decay=0.1)
    t1, t2 = _run(mine, [p], [grads])[0], _run(ref, [q], [grads])[0]
    torch.testing.assert_close(t1, t2, rtol=1e-12, atol=1e-14)  # two implementations: equal to rounding


@pytest.mark.parametrize("name", NAMES)
def test_deepcopy_continues_identically(name):
    w0, grads = _stream((5, 7))
    model = torch.nn.Linear(7, 5, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(w0)
    opt = CLASSES[name](model.parameters(), **HYPER)
    _run(opt, [model.weight], [grads[:4]])
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2.param_groups[0]["params"][0] is model2.weight
    t1 = _run(opt, [model.weight], [grads[4:]])[0]
    t2 = _run(opt2, [model2.weight], [grads[4:]])[0]
    assert torch.equal(t1, t2)


@pytest.mark.parametrize("name", NAMES)
def test_lr_scheduler_drives_the_core_learning_rate(name):
    w0, grads = _stream((5, 7))
    p = torch.nn.Parameter(w0.clone())
    opt = CLASSES[name]([p], **HYPER)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    traj = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        sched.step()
        traj.append(p.detach().clone())
    cfg = ar.make_config(name, **HYPER)
    state, w, ref = ar.init(w0, cfg), w0, []
    for k, g in enumerate(grads):
        w, state = ar.step(state, g, cfg, w, lr=0.01 * 0.5 ** (k // 4))
        ref.append(w)
    assert torch.equal(torch.stack(traj), torch.stack(ref))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_params_keep_float32_state(name, dtype):
    w0, grads = _stream((5, 7), dtype=dtype)
    p = torch.nn.Parameter(w0.clone())
    opt = CLASSES[name]([p], **HYPER)
    traj = _run(opt, [p], [grads])[0]
    assert traj.dtype == dtype
    assert all(v.dtype == torch.float32 for k, v in opt.state[p].items() if k != "step")
    assert torch.equal(traj, ar.replay(name, w0, grads, **HYPER))
    # a checkpoint keeps the float32 state (torch's default loader would cast it to the parameter's dtype)
    opt2 = CLASSES[name]([torch.nn.Parameter(w0.clone())], **HYPER)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    state2 = next(iter(opt2.state.values()))
    assert all(v.dtype == torch.float32 for k, v in state2.items() if k != "step")
    assert all(torch.equal(state2[k], v) for k, v in opt.state[p].items())


@pytest.mark.parametrize("name", ["adamw", "adadiag_pp", "hfacdiag"])
def test_maximize_equals_negated_gradients(name):
    w0, grads = _stream((5, 7))
    p, q = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    t1 = _run(CLASSES[name]([p], maximize=True, **HYPER), [p], [grads])[0]
    t2 = _run(CLASSES[name]([q], **HYPER), [q], [-grads])[0]
    assert torch.equal(t1, t2)


def test_invalid_gradients_leave_every_state_untouched():
    (w_a, g_a), (w_b, g_b) = _stream((5, 7), seed=1), _stream((4, 3), seed=2)
    a, b = torch.nn.Parameter(w_a.clone()), torch.nn.Parameter(w_b.clone())
    opt = at.AdaDiag([a, b], **HYPER)
    _run(opt, [a, b], [g_a[:2], g_b[:2]])
    before = copy.deepcopy((a.detach(), b.detach(), opt.state_dict()["state"]))
    a.grad = g_a[2].clone()
    b.grad = torch.full_like(b, float("nan"))  # the second parameter is bad: the first must not move either
    with pytest.raises(ValueError, match="NaN or Inf"):
        opt.step()
    after = (a.detach(), b.detach(), opt.state_dict()["state"])
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    for i in (0, 1):
        assert all(torch.equal(before[2][i][k], after[2][i][k]) for k in before[2][i])


def test_sparse_and_complex_gradients_are_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = at.AdaDiag(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    c = torch.nn.Parameter(torch.ones(3, 3, dtype=torch.complex128))
    c.grad = torch.ones_like(c)
    with pytest.raises(RuntimeError, match="complex"):
        at.AdaDiag([c]).step()


def test_invalid_hyperparameters_raise_at_construction():
    p = torch.nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):  # torch.optim's message
        at.AdaDiag([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="unknown option"):
        at.AdaDiag([p], clip_threshold=1.0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        at.CoreOptimizer([p], name="sgd")
    opt = at.Adafactor([p], momentum=False, clip_threshold=None)
    assert opt.config().momentum is False


def test_step_returns_closure_loss():
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = at.HfacDiag([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) == 6.0
    assert float((p.detach() ** 2).sum()) < 6.0


def _train(name, model, x, y, loss_fn, steps, lr):
    opt = CLASSES[name](model.parameters(), lr=lr, update_freq=5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_training_reduces_the_loss(name):
    torch.manual_seed(0)
    lr = 1e-2
    # two-layer MLP regression
    x = torch.randn(64, 8)
    y = torch.sin(x @ torch.randn(8, 1))
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    mlp_losses = _train(name, mlp, x, y, torch.nn.functional.mse_loss, 40, lr)
    # small CNN classification: conv kernels (out, in, kh, kw) go through the reshape rule
    images = torch.randn(32, 1, 8, 8)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 2)
    )
    cnn_losses = _train(name, cnn, images, labels, torch.nn.functional.cross_entropy, 30, lr)
    assert mlp_losses[-1] < 0.5 * mlp_losses[0], mlp_losses
    assert cnn_losses[-1] < 0.7 * cnn_losses[0], cnn_losses


# ----------------------------------------------------------------------------- issue 16: stricter than torch.optim


@pytest.mark.parametrize("lr", [float("inf"), float("nan"), -1.0, None, "0.1"])
def test_invalid_lr_is_refused_everywhere_and_changes_nothing(lr):
    """torch.optim accepts lr=inf; here lr must be a finite number >= 0 at construction, in add_param_group and
    when a group is edited before step() (then nothing moves)."""
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        at.AdaDiag([p], lr=lr)
    opt = at.AdaDiag([p], lr=0.01)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": lr})
    assert len(opt.param_groups) == 1
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    before = copy.deepcopy((p.detach(), opt.state_dict()))
    opt.param_groups[0]["lr"] = lr
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()
    assert torch.equal(p.detach(), before[0])
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(v, after[k]) for k, v in before[1]["state"][0].items())


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_gradient_names_the_parameter_and_changes_nothing(name):
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in SHAPES]
    opt = CLASSES[name]([{"params": params[:1]}, {"params": params[1:]}], **HYPER)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    before = copy.deepcopy(([p.detach() for p in params], opt.state_dict()["state"]))
    for p in params:
        p.grad = torch.randn_like(p)
    params[2].grad[0, 1, 1] = float("inf")  # the last parameter is bad: no other may move either
    with pytest.raises(ValueError, match=r"parameter 1 of param_groups\[1\] contains NaN or Inf at step 3"):
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before[0], params, strict=True))
    after = opt.state_dict()["state"]
    for i, state in before[1].items():
        assert set(state) == set(after[i]) and all(torch.equal(v, after[i][k]) for k, v in state.items())


def test_named_parameters_are_named_in_errors():
    model = torch.nn.Linear(3, 2, dtype=torch.float64)
    opt = at.AdaDiag(model.named_parameters())
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    with pytest.raises(ValueError, match="parameter 'weight' contains NaN or Inf at step 1"):
        opt.step()
    assert not opt.state


@pytest.mark.parametrize("name", NAMES)
def test_state_of_a_transposed_parameter_is_refused(name):
    """(7, 9) and (9, 7) share the 7 x 9 work frame, so the state's shapes agree: the saved shapes tell them apart."""
    a = torch.nn.Parameter(torch.randn(7, 9, dtype=torch.float64))
    opt = CLASSES[name]([a], **HYPER)
    a.grad = torch.randn_like(a)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    b = torch.nn.Parameter(torch.randn(9, 7, dtype=torch.float64))
    opt_b = CLASSES[name]([b], **HYPER)
    with pytest.raises(ValueError, match=r"shape \(7, 9\)"):
        opt_b.load_state_dict(saved)
    assert not opt_b.state and opt_b.param_groups[0]["params"][0] is b
    wrong = torch.nn.Parameter(torch.randn(5, 9, dtype=torch.float64))  # a shape mismatch without param_shapes
    del saved["param_groups"][0]["param_shapes"]
    with pytest.raises(ValueError, match="has shape"):
        CLASSES[name]([wrong], **HYPER).load_state_dict(saved)


@pytest.mark.parametrize("step", [float("nan"), float("inf"), -float("inf"), torch.tensor(float("inf")), 2.5, -1])
def test_a_saved_step_that_is_not_a_whole_number_is_refused_with_nothing_changed(step):
    """A checkpoint's ``"step"`` must be a whole number >= 0; NaN and Inf included, one ``ValueError`` names it
    (``int(inf)`` alone raised ``OverflowError``, ``int(nan)`` Python's own message), and the optimizer keeps its
    state."""
    p = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.float64))
    opt = at.AdaDiag([p], **HYPER)
    p.grad = torch.randn_like(p)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    saved = copy.deepcopy(before)
    saved["state"][0]["step"] = step
    with pytest.raises(ValueError, match=r"'step' of parameter 0 must be a whole number >= 0"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert all(torch.equal(v, after["state"][0][k]) for k, v in before["state"][0].items())


def test_load_state_dict_keeps_split_refresh_and_the_process_group():
    """torch's ``load_state_dict`` ends in ``__setstate__``: the optimizer's own ``split_refresh`` and
    ``process_group`` (not in the state dict) stay as constructed, where they fell back to ``False`` and the
    default group.  Unpickling, which has no process group to restore, keeps ``split_refresh`` only."""
    p = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.float64))
    group = object()  # a stand-in: no collective runs without an initialised process group
    opt = at.AdaDiag([p], **HYPER, split_refresh=True, process_group=group)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt.split_refresh is True and opt.process_group is group
    buffer = io.BytesIO()
    torch.save(at.AdaDiag([p], **HYPER, split_refresh=True), buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert restored.split_refresh is True and restored.process_group is None


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("name", NAMES)
def test_one_host_synchronisation_per_step(name, kernels, monkeypatch):
    """A step without a refresh reads one device value on the host (the fused finiteness test).

    Reads of the per-parameter ``"step"`` counters are not counted: they live on the host, as in torch.optim.
    Neither is ``numpy()`` of a CPU tensor, a view of the same host memory (the CPU kernel route views its
    tensors and stacked counters that way); on any other device it would raise, not synchronise.
    """
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in SHAPES]
    opt = CLASSES[name](params, **{**HYPER, "update_freq": 100}, kernels=kernels)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # t = 1 refreshes
    counters = {id(opt.state[p]["step"]) for p in params}
    reads = []
    for method in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy"):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            host_view = _method == "numpy" and self.device.type == "cpu"
            if id(self) not in counters and not host_view:
                reads.append(tuple(self.shape))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    opt.step()
    assert len(reads) <= 1, reads


# ----------------------------------------------------------------------------- issue 12: the CPU kernel route


def _count_calls(monkeypatch, module, names):
    """Wrap ``module.<name>`` for each name so that calls are counted; returns the counter dict."""
    calls = dict.fromkeys(names, 0)
    for attr in names:
        original = getattr(module, attr)

        def counted(*args, _attr=attr, _original=original, **kwargs):
            calls[_attr] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, attr, counted)
    return calls


# (130, 300) has 39000 entries: three blocks of the route, the last one partial
ROUTE_SHAPES = [(130, 300), (300, 130), (5, 7), (7, 5), (6, 2, 2), (7,)]


ROUTE_KERNELS = ["engine_step", "engine_moments", "engine_tail"]
"""The engine's group kernels in host memory (``optim/families/adam/group_route.py``), by module attribute."""


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_cpu_kernel_route_is_taken_and_bit_identical_to_the_reference_route(name, dtype, weight_decay, monkeypatch):
    """CPU float tensors go through the engine's group kernels (numba, over the tensors' memory); every trajectory
    and state equals the ``kernels="reference"`` engine (torch ops) bit for bit, refresh steps included.  The
    gradients are large enough that a route taking another square root than the library's correctly rounded one (eager
    ``torch.sqrt``, MKL VML's on x86 builds) would differ."""
    from adadiag_ref.optim.families.adam import group_route

    calls = _count_calls(monkeypatch, group_route, ROUTE_KERNELS)
    streams = [_stream(s, steps=5, dtype=dtype, seed=i) for i, s in enumerate(ROUTE_SHAPES)]
    hyper = {"lr": 0.01, "weight_decay": weight_decay, "update_freq": 2}
    results = {}
    for kernels in ("reference", "auto"):
        params = [torch.nn.Parameter(w0.clone()) for w0, _ in streams]
        opt = CLASSES[name](params, kernels=kernels, **hyper)
        before = dict(calls)
        trajs = _run(opt, params, [g for _, g in streams])
        routed = sum(calls.values()) - sum(before.values())
        assert (routed > 0) == (kernels == "auto"), (kernels, calls)
        results[kernels] = (trajs, [opt.state[p] for p in params])
    for ref, fast in zip(results["reference"][0], results["auto"][0], strict=True):
        assert torch.equal(ref, fast)
    for ref, fast in zip(results["reference"][1], results["auto"][1], strict=True):
        assert set(ref) == set(fast) and all(torch.equal(ref[k], fast[k]) for k in ref)


@pytest.mark.parametrize("name", ["adamw", "adadiag"])
def test_cpu_kernel_route_steps_large_parameters_in_one_pass_without_torch_sqrt(name, monkeypatch):
    """Issue 31: the large parameters' root is taken inside the numba kernels, in their one pass, with no
    ``torch.sqrt`` call and no Python round trip per parameter: AdamW's parameters all in one kernel call per
    guided piece (``group_route.engine_step``, whatever their number), a rotated group's moments likewise
    (``group_route.engine_moments``); the result is the reference route's bit for bit (test above)."""
    from adadiag_ref.optim.families.adam import group_route, numba_route

    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float32)) for s in [(130, 300), (20000,)]]
    opt = CLASSES[name](params, lr=1e-3, update_freq=None)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # t = 1 refreshes
    calls = _count_calls(monkeypatch, numba_route, ["adam_moments_over_flat", "adam_delta_flat"])
    group_calls = _count_calls(monkeypatch, group_route, ["engine_step", "engine_moments"])
    roots = []
    real_sqrt = torch.sqrt

    def counted_sqrt(*args, **kwargs):
        roots.append(1)
        return real_sqrt(*args, **kwargs)

    monkeypatch.setattr(torch, "sqrt", counted_sqrt)
    opt.step()
    # both are rotated by AdaDiag (the default rule rotates a vector as a 1 x n matrix): one group either way
    used, unused = ("engine_step", "engine_moments") if name == "adamw" else ("engine_moments", "engine_step")
    assert 1 <= group_calls[used] <= torch.get_num_threads(), group_calls
    assert group_calls[unused] == 0, group_calls
    assert calls["adam_moments_over_flat"] == calls["adam_delta_flat"] == 0, calls  # not per parameter
    assert roots == []


def test_cpu_kernel_route_helper_threads_are_made_anew_after_a_fork(monkeypatch):
    """A forked child inherits the helper pool's object but none of its threads; the route makes a new pool there
    instead of queueing work nobody runs (a hang)."""
    from adadiag_ref.optim import blas_threads
    from adadiag_ref.optim.families.adam import torch_route

    assert isinstance(torch_route._WORKERS, blas_threads.Workers)  # the route's pool (shared with the GEMM phases)
    workers = blas_threads.Workers()
    pool = workers.get(1)
    assert workers.get(1) is pool
    monkeypatch.setattr(blas_threads.os, "getpid", lambda: -1)  # as seen from a child process
    child_pool = workers.get(1)
    assert child_pool is not pool and child_pool.submit(lambda: 7).result(timeout=10) == 7
    pool.shutdown()
    child_pool.shutdown()


def test_cpu_kernel_route_keeps_the_state_tensor_objects():
    p = torch.nn.Parameter(torch.randn(9, 4))
    q = torch.nn.Parameter(torch.randn(50))
    opt = at.AdaDiag([p, q], update_freq=None)
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    opt.step()
    ids = {k: id(v) for s in (opt.state[p], opt.state[q]) for k, v in s.items()}
    saved = opt.state_dict()["state"]
    opt.step()
    assert {k: id(v) for s in (opt.state[p], opt.state[q]) for k, v in s.items()} == ids
    assert torch.equal(saved[0]["M"], opt.state[p]["M"])  # state_dict() references stay live, as in torch.optim


class _Tagged(torch.nn.Parameter):
    """A parameter subclass: not plain, so no engine steps it (the per-parameter ``update_in_place`` route)."""


@pytest.mark.parametrize("plain", [True, False])
def test_finiteness_needs_no_gradient_sized_temporary(monkeypatch, plain):
    """The finiteness test makes no gradient-sized temporary: the engine's kernels count NaN and Inf by address
    (a plain parameter on the CPU); off the engine each gradient is reduced once (a sum) and ``torch.isfinite``
    only sees the 0-d sums."""
    kind = torch.nn.Parameter if plain else _Tagged
    params = [kind(torch.randn(s)) for s in ((64, 32), (100,))]
    opt = at.AdamW(params)
    shapes = []
    original = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda x: shapes.append(tuple(x.shape)) or original(x))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(len(shape) <= 1 and (not shape or shape[0] == len(params)) for shape in shapes), shapes
    assert bool(shapes) != plain, shapes
    assert all(route["moments"].startswith("per parameter") != plain for route in opt.routes().values())


@pytest.mark.parametrize(("name", "rotated"), [("adamw", False), ("adafactor", False), ("adadiag", True)])
def test_routes_of_a_stack_off_the_engine_say_whether_it_has_a_basis(name, rotated):
    """``routes()`` of a parameter no engine steps (a subclass), in a ``batch_dims`` group, reads its layout as the
    step does: no basis and no GEMM for a baseline's stack (it said "batched stack" and "GEMM" for every stack)."""
    p = _Tagged(torch.randn(3, 4, 5))
    p.grad = torch.randn_like(p)
    opt = at.OPTIMIZER_CLASSES[name]([p], batch_dims=1)
    route = opt.routes()["param_groups[0].params[0]"]
    assert route["moments"].startswith("per parameter")
    assert (route["refresh"] != "none (no basis)") == rotated, route
    assert (route["rotate"] != "none") == rotated, route
    opt.step()  # the route it names is the one a step takes: a basis exactly where the layout has one
    assert ("P" in opt.state[p]) == rotated


def test_the_ranks_finiteness_takes_one_sum_per_cpu_gradient(monkeypatch):
    """The agreement's exact finiteness (``_sharded.exactly_finite``, every step under ``torch.distributed``) sums
    each CPU gradient (``torch.sum``) instead of ``torch._foreach_norm``, 4.4x slower on the CPU; the verdicts are
    exact: NaN and Inf found, finite entries whose sum overflows cleared."""
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: pytest.fail("_foreach_norm on CPU gradients"))
    big = torch.finfo(torch.float32).max
    grads = [torch.randn(4, 3), torch.full((5,), big), torch.tensor([1.0, float("nan")]), torch.tensor([-float("inf")])]
    assert _sharded.exactly_finite(grads) == [True, True, False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_sum_that_overflows_on_finite_gradients_is_no_error(dtype):
    """Finite entries whose sum overflows to inf: the exact test clears the suspicion and the step runs."""
    big = torch.finfo(dtype).max
    p = torch.nn.Parameter(torch.zeros(4, 3, dtype=dtype))
    q = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
    opt = at.AdamW([p, q], lr=0.1)
    p.grad = torch.full_like(p, big)
    q.grad = torch.ones_like(q)
    if dtype == torch.float16:  # summed in float32: no overflow there; the sum stays a proof
        p.grad[0, 0] = -big
    opt.step()
    assert int(opt.state[p]["step"]) == 1 and int(opt.state[q]["step"]) == 1  # (G^2 overflows: V = inf, U = 0)
    q.grad = torch.tensor([1.0, float("nan")], dtype=dtype)
    p.grad = torch.full_like(p, big)
    with pytest.raises(ValueError, match=r"parameter 1 of param_groups\[0\] contains NaN or Inf at step 2"):
        opt.step()
