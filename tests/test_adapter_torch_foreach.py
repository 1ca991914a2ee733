"""``foreach``: accepted as ``torch.optim`` accepts it, and no route of its own.

Every plain parameter is stepped by its param group's engine, whose group kernels already step the group as a whole;
``foreach`` changes nothing (AdamW, AdaDiag, AdaDiag++ and a factored optimizer; float32, float64 and bfloat16
parameters; vectors, tall, wide, 1-element, conv and 0-d parameters; groups of different ``lr``; refresh steps
included): the same bits, the same routes, a checkpoint's ``foreach`` loaded as torch.optim loads it.  The number of
aten operations of a step without refresh does not grow with the number of parameters (for the rotated forms only
the GEMMs do).  The CUDA comparison is marked ``gpu``.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", [*ADAM_NAMES, "adafacdiag"])
def test_foreach_changes_nothing(name, dtype):
    """``foreach`` ``None``, ``False`` and ``True``: the same bits at every step (refreshes at t = 1, 3, 5), the
    same states, and every parameter stepped by its group's engine (before, ``foreach=True`` took a
    ``torch._foreach_*`` chain of its own).  A plain parameter on any device is the engine's (a ``meta`` tensor
    stands in for CUDA's)."""
    runs = [_run(name, foreach, dtype, 0.1) for foreach in (None, False, True)]
    (unset, unset_states, _), *others = runs
    for trajectory, states, opt in others:
        for step, (a, b) in enumerate(zip(unset, trajectory, strict=True), start=1):
            for k, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"parameter {k} ({tuple(x.shape)}) after step {step}"
        _assert_states_equal(unset_states, states)
        assert all("engine" in route for route in opt.routes().values())
    assert at._plain_parameter(torch.nn.Parameter(torch.empty(2, device="meta")))


def test_a_checkpoints_foreach_is_loaded_as_torch_optim_loads_it():
    """``load_state_dict`` takes ``foreach`` from the checkpoint's groups, as ``torch.optim.AdamW`` does (it has no
    effect on the step); an invalid value is refused at construction."""
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    saved_by = at.AdamW(params, foreach=True)
    params[0].grad = torch.randn_like(params[0])
    saved_by.step()
    loader = at.AdamW([torch.nn.Parameter(params[0].detach().clone())], foreach=False)
    loader.load_state_dict(saved_by.state_dict())
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 3))], foreach=False)
    reference.load_state_dict(torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 3))], foreach=True).state_dict())
    assert loader.param_groups[0]["foreach"] is reference.param_groups[0]["foreach"] is True
    with pytest.raises(ValueError, match="Invalid foreach value"):
        at.AdamW(params, foreach="yes")


class _CountOps(TorchDispatchMode):
    """Counts the aten operations that reach the dispatcher (a ``_foreach_*`` call is one, whatever its list)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.views if func.is_view else self.ops)[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _ops_of_one_step(name, n, foreach=None, dtype=torch.float32, **options):
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


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_default_cpu_route_op_count_grows_only_by_the_rotations(name):
    """The default CPU route (``foreach=False``: the group's engine and its kernels, routes resolved once): the
    entrywise part is a fixed number of calls per group (the gradients gathered, one ``_foreach_add_`` for the
    counters), whatever the number of parameters; only the rotations' GEMMs are per parameter (none for AdamW).
    Before the group kernels AdamW made ~20 aten calls per parameter."""
    small, large = _ops_of_one_step(name, 4, foreach=False), _ops_of_one_step(name, 32, foreach=False)
    # GEMMs, stack's allocation; the copies of a matrix off a fresh tensor's 64-byte alignment (these tiny shapes;
    # engine._aligned_copy: MKL rounds otherwise there), none for the blocks of real models
    gemm = {"aten.mm.default", "aten.mm.out", "aten.empty.memory_format", "aten.clone.default", "aten.copy_.default"}
    fixed = lambda c: {k: v for k, v in c.ops.items() if k not in gemm}  # noqa: E731
    assert fixed(small) == fixed(large), (small.ops, large.ops)
    assert sum(fixed(large).values()) < 40, large.ops
    assert large.ops["aten._local_scalar_dense.default"] == 0  # counters and coefficients read from host memory
    if name == "adamw":
        assert sum(large.ops.values()) <= sum(small.ops.values()) + 1 and small.views == large.views


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no-decay", "decay"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ADAM_NAMES)
def test_on_cuda_the_engine_steps_every_group_and_agrees_with_the_cpu(name, dtype, weight_decay):
    """On CUDA, ``foreach`` unset or ``True``: the group's engine steps the parameters (``opt.routes()`` says so; with
    CuPy installed its CUDA group kernels), the same bits either way.  Against the same optimizer on the CPU: to
    rounding (float64 1e-12, float32 1e-5: the same IEEE operations, the kernels built with ``--fmad=false``, but
    cuBLAS and MKL sum a GEMM in other orders); a NaN then changes nothing and names the parameter."""
    w0, grads = _streams(dtype)
    results = []
    for device, foreach in (("cpu", None), ("cuda", None), ("cuda", True)):
        params = [torch.nn.Parameter(w.clone().to(device)) for w in w0]
        opt = _optimizer(name, params, foreach, weight_decay)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.to(device)
            opt.step()
        results.append((params, opt))
    (cpu_params, cpu), (params, opt), (multi, _) = results
    assert all(torch.equal(p, q) for p, q in zip(params, multi, strict=True))
    routes = opt.routes().values()
    assert all("engine" in entry for entry in routes), routes
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        assert all("cupy_group" in entry["engine"] + entry["moments"] for entry in routes), routes
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    for p, q in zip(cpu_params, params, strict=True):
        torch.testing.assert_close(q.cpu(), p, **tol)
        for key in ("M", "V"):
            torch.testing.assert_close(opt.state[q][key].cpu(), cpu.state[p][key], **tol)
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
