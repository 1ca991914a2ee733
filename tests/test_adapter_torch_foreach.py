"""The torch adapter's multi-tensor route (``foreach=True``, issue 24): the Adam family's step of a whole param
group as ``torch._foreach_*`` calls.

Checked on the CPU, where torch's ``_foreach_*`` ops run the same per-tensor kernels: the route is bit-identical
(``torch.equal``) to ``foreach=False`` (AdamW, AdaDiag, AdaDiag++; float32, float64, bfloat16 parameters; vectors,
tall, wide, 1-element and conv parameters; with and without weight decay; groups of different ``lr``; refresh
steps included); states are interchangeable between the two routes; the number of aten operations of a step
without refresh does not grow with the number of parameters (for the rotated forms only the GEMMs and views
do); the finiteness verdict stays the one read of a device value.  The CUDA comparison is marked ``gpu``.
"""

from __future__ import annotations

import copy
from collections import Counter

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import pytest
import torch
from adadiag_ref.adapters import pytorch as at
from torch.utils._python_dispatch import TorchDispatchMode

ADAM_NAMES = ["adamw", "adadiag", "adadiag_pp"]
SHAPES = [(5, 7), (7, 5), (7,), (1,), (6, 2, 2), (40, 30), (3, 1), ()]  # wide, tall, vector, 1-element, conv, 0-d
STEPS, FREQ = 6, 2  # refreshes at t = 1, 3, 5


def _streams(dtype, steps=STEPS, shapes=SHAPES, scale=1.0):
    gen = torch.Generator().manual_seed(0)
    w0 = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    grads = [[(scale * torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype) for s in shapes]
             for _ in range(steps)]  # fmt: skip
    return w0, grads


def _optimizer(name, params, foreach, weight_decay=0.1, **options):
    """Two groups of different ``lr`` (and the second with the group's own ``weight_decay``)."""
    half = len(params) // 2
    groups = [{"params": params[:half]}, {"params": params[half:], "lr": 0.03, "weight_decay": 2 * weight_decay}]
    return at.OPTIMIZER_CLASSES[name](
        groups, lr=0.01, weight_decay=weight_decay, update_freq=FREQ, foreach=foreach, **options
    )


def _run(name, foreach, dtype, weight_decay, steps=STEPS, **options):
    w0, grads = _streams(dtype, steps)
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = _optimizer(name, params, foreach, weight_decay, **options)
    trajectory = []
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
        trajectory.append([p.detach().clone() for p in params])
    return trajectory, [opt.state[p] for p in params], opt


def _assert_states_equal(a, b):
    for sa, sb in zip(a, b, strict=True):
        assert set(sa) == set(sb)
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ADAM_NAMES)
def test_foreach_is_bit_identical_to_the_per_parameter_route(name, dtype, weight_decay, monkeypatch):
    calls = []
    original = at._foreach_adam
    monkeypatch.setattr(at, "_foreach_adam", lambda batch, *a: calls.append(len(batch)) or original(batch, *a))
    per_param, states, _ = _run(name, False, dtype, weight_decay)
    assert not calls  # foreach=False never takes the multi-tensor route
    multi, multi_states, _ = _run(name, True, dtype, weight_decay)
    assert calls == [4, 4] * STEPS  # one batch per group and step
    for step, (a, b) in enumerate(zip(per_param, multi, strict=True), start=1):
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"parameter {k} ({tuple(x.shape)}) after step {step}"
    _assert_states_equal(states, multi_states)


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("name", ADAM_NAMES)
def test_foreach_equals_both_per_parameter_routes_on_large_gradients(name, kernels):
    """Gradients of 1e3: ``sqrt(V_t)`` of many magnitudes (a route taking another square root would differ)."""
    w0, grads = _streams(torch.float32, steps=3, scale=1e3)
    results = []
    for foreach in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = _optimizer(name, params, foreach, kernels=kernels)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append(([p.detach() for p in params], [opt.state[p] for p in params]))
    assert all(torch.equal(x, y) for x, y in zip(results[0][0], results[1][0], strict=True))
    _assert_states_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("name", ADAM_NAMES)
def test_foreach_with_bfloat16_parameters_and_float32_state(name):
    per_param, states, _ = _run(name, False, torch.bfloat16, 0.1, steps=3)
    multi, multi_states, _ = _run(name, True, torch.bfloat16, 0.1, steps=3)
    assert all(torch.equal(x, y) for a, b in zip(per_param, multi, strict=True) for x, y in zip(a, b, strict=True))
    _assert_states_equal(states, multi_states)
    assert multi_states[0]["M"].dtype == torch.float32


@pytest.mark.parametrize("name", ADAM_NAMES)
def test_state_dict_is_interchangeable_between_foreach_on_and_off(name):
    """Save after 3 steps under one route, load into an optimizer of the other, continue: the bits of a run that
    never switched; the loading optimizer keeps its own ``foreach``."""
    w0, grads = _streams(torch.float64, steps=6)
    reference, ref_states, _ = _run(name, False, torch.float64, 0.1, steps=6)
    for saved_foreach, loaded_foreach in ((True, False), (False, True)):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = _optimizer(name, params, saved_foreach)
        for gs in grads[:3]:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        saved = copy.deepcopy(opt.state_dict())
        assert all(group["foreach"] is saved_foreach for group in saved["param_groups"])
        resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt2 = _optimizer(name, resumed, loaded_foreach)
        opt2.load_state_dict(saved)
        assert all(group["foreach"] is loaded_foreach for group in opt2.param_groups)
        for gs in grads[3:]:
            for p, g in zip(resumed, gs, strict=True):
                p.grad = g.clone()
            opt2.step()
        assert all(torch.equal(x, y) for x, y in zip(reference[-1], resumed, strict=True))
        _assert_states_equal(ref_states, [opt2.state[p] for p in resumed])
        assert int(opt2.state[resumed[0]]["step"]) == 6


class _CountOps(TorchDispatchMode):
    """Counts the aten operations that reach the dispatcher (a ``_foreach_*`` call is one, whatever its list)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.views if func.is_view else self.ops)[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _ops_of_one_step(name, n, foreach=True, dtype=torch.float32, **options):
    """Aten ops (and views) of the second step (no refresh: ``update_freq=None``) over ``n`` parameters."""
    shapes = [SHAPES[k % len(SHAPES)] for k in range(n)]
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
    opt = at.OPTIMIZER_CLASSES[name](params, lr=0.01, weight_decay=0.1, update_freq=None, foreach=foreach, **options)
    for _ in range(2):  # the first step refreshes and creates the state; the third is the one counted
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    with _CountOps() as counter:
        opt.step()
    return counter


def test_adamw_op_count_does_not_grow_with_the_number_of_parameters():
    small, large = _ops_of_one_step("adamw", 4), _ops_of_one_step("adamw", 32)
    assert small.ops == large.ops, (small.ops, large.ops)
    assert small.views == large.views
    assert sum(small.ops.values()) < 60, small.ops  # a fixed chain of foreach calls and scalar coefficients
    assert small.ops["aten._local_scalar_dense.default"] <= 1  # the finiteness verdict, nothing else
    per_param = _ops_of_one_step("adamw", 32, foreach=False, kernels="reference")
    assert sum(per_param.ops.values()) > 4 * sum(large.ops.values())  # what the route saves


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_default_cpu_route_op_count_grows_only_by_the_rotations(name):
    """The default CPU route (``foreach=False``: the group's engine and its kernels, routes resolved once): the
    entrywise part is a fixed number of calls per group (the gradients gathered, one ``_foreach_add_`` for the
    counters), whatever the number of parameters; only the rotations' GEMMs are per parameter (none for AdamW).
    Before the group kernels AdamW made ~20 aten calls per parameter."""
    small, large = _ops_of_one_step(name, 4, foreach=False), _ops_of_one_step(name, 32, foreach=False)
    # GEMMs, stack's allocation; the copies of a matrix off a fresh tensor's 64-byte alignment (these tiny shapes;
    # engine._fresh_alignment: MKL rounds otherwise there), none for the blocks of real models
    gemm = {"aten.mm.default", "aten.mm.out", "aten.empty.memory_format", "aten.clone.default", "aten.copy_.default"}
    fixed = lambda c: {k: v for k, v in c.ops.items() if k not in gemm}  # noqa: E731
    assert fixed(small) == fixed(large), (small.ops, large.ops)
    assert sum(fixed(large).values()) < 40, large.ops
    assert large.ops["aten._local_scalar_dense.default"] == 0  # counters and coefficients read from host memory
    if name == "adamw":
        assert sum(large.ops.values()) <= sum(small.ops.values()) + 1 and small.views == large.views


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_rotated_op_count_grows_only_by_the_rotations(name):
    """``P^T G Q`` and ``P U~ Q^T`` stay per parameter (GEMMs and the views around them); every other op is
    shared by the group."""
    small, large = _ops_of_one_step(name, 4), _ops_of_one_step(name, 32)
    gemms = {"aten.mm.default"}
    assert {k: v for k, v in small.ops.items() if k not in gemms} == {
        k: v for k, v in large.ops.items() if k not in gemms
    }
    assert large.ops["aten.mm.default"] > small.ops["aten.mm.default"]


@pytest.mark.parametrize("name", ADAM_NAMES)
def test_foreach_step_reads_one_device_value(name):
    """A step without refresh reads one value on the host: the finiteness verdict.  The coefficients and the
    host counters are read from host memory (``numpy()`` of CPU tensors), never with ``item()``."""
    counter = _ops_of_one_step(name, 8)
    assert counter.ops["aten._local_scalar_dense.default"] == 1


class _LogOps(TorchDispatchMode):
    """The aten operations of a step, in the order they reach the dispatcher (views left out)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ADAM_NAMES)
def test_foreach_step_reads_its_verdict_after_the_work_is_queued(name):
    """A step without refresh queues the whole update (moments, direction, tail into new tensors) before it reads
    the finiteness verdict, and writes ``W`` and the moments only after: on a GPU the device computes while the
    host waits for the one read (issue 31, item 3).  Before, the verdict was read before any work was queued."""
    shapes = SHAPES * 2
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float32)) for s in shapes]
    opt = at.OPTIMIZER_CLASSES[name](params, lr=0.01, weight_decay=0.1, update_freq=None, foreach=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    with _LogOps() as log:
        opt.step()
    ops = log.ops
    sync = ops.index("aten._local_scalar_dense.default")
    assert ops.count("aten._local_scalar_dense.default") == 1
    assert ops.index("aten._foreach_div.List") < sync  # U~ = M_t / (sqrt(V_t) + eps): queued before the read
    assert min(i for i, op in enumerate(ops) if op.startswith("aten._foreach_copy_")) > sync  # moments written after


@pytest.mark.parametrize("name", ADAM_NAMES)
def test_foreach_with_maximize_and_a_tensor_lr(name):
    w0, grads = _streams(torch.float64, steps=3)
    results = []
    for foreach in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = at.OPTIMIZER_CLASSES[name](
            params, lr=torch.tensor(0.02), maximize=True, weight_decay=0.1, update_freq=2, foreach=foreach
        )
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    assert all(torch.equal(x, y) for x, y in zip(*results, strict=True))


def test_non_finite_gradient_raises_and_leaves_everything_untouched():
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in SHAPES]
    opt = at.AdaDiag(params, update_freq=None, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params], copy.deepcopy([opt.state[p] for p in params])
    for p in params:
        p.grad = torch.randn_like(p)
    params[5].grad[3, 4] = float("inf")
    with pytest.raises(ValueError, match=r"parameter 5 of param_groups\[0\] contains NaN or Inf at step 2"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before[0], strict=True))
    _assert_states_equal(before[1], [opt.state[p] for p in params])


def test_default_is_off_on_the_cpu_and_other_families_ignore_it(monkeypatch):
    calls = []
    original = at._foreach_adam
    monkeypatch.setattr(at, "_foreach_adam", lambda batch, *a: calls.append(len(batch)) or original(batch, *a))
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = at.AdamW([p])
    assert opt.param_groups[0]["foreach"] is None
    p.grad = torch.randn_like(p)
    opt.step()
    assert not calls
    results = []
    for foreach in (False, True):  # the Adafactor family: the per-parameter route either way, the same bits
        q = torch.nn.Parameter(torch.ones(4, 3))
        opt = at.AdafacDiag([q], foreach=foreach)
        q.grad = torch.full_like(q, 0.5)
        opt.step()
        results.append(q.detach())
    assert not calls and torch.equal(*results)
    with pytest.raises(ValueError, match="Invalid foreach value"):
        at.AdamW([p], foreach="yes")


def test_unset_foreach_is_the_engine_also_on_a_device_with_foreach_kernels(monkeypatch):
    """``foreach`` unset means the group's engine on every device, not only where torch has no multi-tensor
    kernels (before, CUDA parameters took the chain): here the CPU is declared such a device, and the engine
    still steps every parameter, bit for bit with ``foreach=False``; only ``foreach=True`` takes the chain.  A
    plain parameter on any device is the engine's (a ``meta`` tensor stands in for CUDA's)."""
    monkeypatch.setattr(at, "_foreach_devices", lambda: ("cpu", "cuda"))
    w0, grads = _streams(torch.float32, steps=3)
    runs = []
    for foreach in (None, False, True):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = _optimizer("adadiag", params, foreach)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        runs.append((params, opt))
    (unset, unset_opt), (off, _), (_, chain_opt) = runs
    assert all("engine" in route for route in unset_opt.routes().values())
    assert all(route["moments"].startswith("foreach multi-tensor") for route in chain_opt.routes().values())
    assert all(torch.equal(p, q) for p, q in zip(unset, off, strict=True))
    assert at._plain_parameter(torch.nn.Parameter(torch.empty(2, device="meta")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no-decay", "decay"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ADAM_NAMES)
def test_on_cuda_the_engine_steps_by_default_and_agrees_with_the_multi_tensor_chain(name, dtype, weight_decay):
    """On CUDA, ``foreach`` unset: the group's engine steps the parameters (``opt.routes()`` says so; with CuPy
    installed its CUDA group kernels).  Against ``foreach=True`` (the ``torch._foreach_*`` chain): AdamW bit for bit
    (the same IEEE operations, torch's CUDA root and division correctly rounded as the kernels', built with
    ``--fmad=false``), the rotated optimizers to the tolerance of batched against single GEMMs; a NaN then changes
    nothing and names the parameter."""
    w0, grads = _streams(dtype)
    results = []
    for foreach in (True, None):
        params = [torch.nn.Parameter(w.clone().cuda()) for w in w0]
        opt = _optimizer(name, params, foreach, weight_decay)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.cuda()
            opt.step()
        results.append((params, opt))
    (chain_params, chain), (params, opt) = results
    routes = opt.routes().values()
    assert all("engine" in entry for entry in routes), routes
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        assert all("cupy_group" in entry["engine"] + entry["moments"] for entry in routes), routes
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    for p, q in zip(chain_params, params, strict=True):
        if name == "adamw":
            assert torch.equal(p, q)
        torch.testing.assert_close(q, p, **tol)
        for key in ("M", "V"):
            torch.testing.assert_close(opt.state[q][key], chain.state[p][key], **tol)
    before = [p.detach().clone() for p in params] + [opt.state[p][k].clone() for p in params for k in ("M", "V")]
    bad = grads[0][1].clone().cuda()
    bad.view(-1)[0] = float("nan")
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g.cuda()
    params[1].grad = bad
    with pytest.raises(ValueError, match="contains NaN or Inf"):
        opt.step()
    after = [p.detach() for p in params] + [opt.state[p][k] for p in params for k in ("M", "V")]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
