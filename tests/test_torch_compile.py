"""``torch.compile(opt.step)``: the host phase outside the graph on purpose, the update in one graph.

A compiled step must give the bits of an eager one (float64 and float32, across refreshes: the compiled graph
holds the multi-tensor route of the Adam family, bit-identical to the per-parameter route, and calls the eager
square root and unrotation), compile nothing new after warm-up (one refresh step and one step without), not even
for an ``lr`` changed at every step, and break the graph only at the deliberate ``torch.compiler.disable`` of the
host phase.  These run with ``foreach=True``, which keeps the update in the graph on the CPU too; by default a
compiled step on the CPU is the eager step, outside the graph (faster there: benchmarks/bench_torch_compile.py),
which the last test checks.  Compiling takes seconds per optimizer: slow.
"""

from __future__ import annotations

import _adapter_import  # noqa: F401
import pytest

torch = pytest.importorskip("torch")

from adadiag_ref.adapters.pytorch import OPTIMIZER_CLASSES  # noqa: E402

SHAPES = [(5, 7), (7,), (9, 4), (3, 2, 2, 2)]  # wide, 1-D, tall, conv
FREQ, STEPS, WARMUP = 3, 8, 2  # refreshes at t = 1, 4, 7; warm-up: the refresh at t = 1 and t = 2


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in SHAPES]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp", "adafacdiag"])
def test_compiled_step_is_bit_identical_without_recompiles(name, dtype):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_params, compiled_params = _params(dtype), _params(dtype)
    options = {"lr": 0.05, "weight_decay": 0.1, "update_freq": FREQ, "foreach": True}  # the graph route
    eager = OPTIMIZER_CLASSES[name](eager_params, **options)
    compiled = OPTIMIZER_CLASSES[name](compiled_params, **options)
    step = torch.compile(compiled.step)
    graphs = 0
    for t in range(1, STEPS + 1):
        if t == WARMUP + 1:
            graphs = counters["stats"]["unique_graphs"]
        _set_grads(eager_params, t)
        _set_grads(compiled_params, t)
        for opt in (eager, compiled):
            opt.param_groups[0]["lr"] = 0.05 / t  # as a scheduler would: no recompile either
        eager.step()
        with torch.compiler.set_stance("fail_on_recompile" if t > WARMUP else "default"):  # a recompile raises
            step()
        for p, q in zip(eager_params, compiled_params, strict=True):
            assert torch.equal(p, q), (name, t)
            for key, value in eager.state[p].items():
                assert torch.equal(value, compiled.state[q][key]), (name, t, key)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after warm-up
    breaks = counters["graph_break"]
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), dict(breaks)


@pytest.mark.slow
def test_fullgraph_is_refused_with_the_reason():
    import torch._dynamo

    torch._dynamo.reset()
    params = _params(torch.float64)
    _set_grads(params, 1)
    opt = OPTIMIZER_CLASSES["adadiag"](params, lr=0.05)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"host phase .* fullgraph=True\) is refused"):
        torch.compile(opt.step, fullgraph=True)()
    assert not opt.state  # refused before the step ran


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "adadiag"])
def test_on_the_cpu_a_compiled_step_is_the_eager_step_outside_the_graph(name):
    """``foreach`` unset, every parameter on the CPU: nothing is compiled (the CPU's group kernels beat the graph of
    the multi-tensor route: ``CoreOptimizer._update_in_graph``), the bits are the eager ones, and the optimizer
    says so once (a ``UserWarning``), with the way to put the update in a graph anyway."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_params, compiled_params = _params(torch.float32), _params(torch.float32)
    eager = OPTIMIZER_CLASSES[name](eager_params, lr=0.05, update_freq=FREQ)
    compiled = OPTIMIZER_CLASSES[name](compiled_params, lr=0.05, update_freq=FREQ)
    step = torch.compile(compiled.step)
    with pytest.warns(UserWarning, match="runs the eager step, outside the graph.*foreach=True") as caught:
        for t in range(1, STEPS + 1):
            _set_grads(eager_params, t)
            _set_grads(compiled_params, t)
            eager.step()
            step()
            for p, q in zip(eager_params, compiled_params, strict=True):
                assert torch.equal(p, q), (name, t)
    assert sum("outside the graph" in str(w.message) for w in caught) == 1  # once per optimizer
    assert counters["stats"]["unique_graphs"] == 0
