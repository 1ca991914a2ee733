"""``torch.compile(opt.step)``: the eager step, outside the graph on purpose.

A compiled step is the eager step (its host phase and its engines' group kernels, which no graph can hold), so it
gives the eager step's bits (float64 and float32, across refreshes, an ``lr`` changed at every step, ``foreach``
unset or ``True``), compiles no graph, breaks only at the deliberate ``torch.compiler.disable`` and says so once;
``fullgraph=True`` is refused with the reason.  Compiling takes seconds per optimizer: slow.
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
@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp", "adafacdiag"])
def test_a_compiled_step_is_the_eager_step_outside_the_graph(name, dtype, foreach):
    """The bits of the eager step at every step, refresh steps and a changing ``lr`` included; no operation compiled
    (before, ``foreach=True`` put the Adam family's update in a graph), only the deliberate break, one warning."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_params, compiled_params = _params(dtype), _params(dtype)
    options = {"lr": 0.05, "weight_decay": 0.1, "update_freq": FREQ, "foreach": foreach}
    eager = OPTIMIZER_CLASSES[name](eager_params, **options)
    compiled = OPTIMIZER_CLASSES[name](compiled_params, **options)
    operations: list[str] = []

    def recording(graph, example_inputs):  # a backend that keeps what Dynamo hands it and runs it eagerly
        operations.extend(str(node.target) for node in graph.graph.nodes if node.op.startswith("call"))
        return graph.forward

    step = torch.compile(compiled.step, backend=recording)
    with pytest.warns(UserWarning, match="runs the eager step, outside the graph") as caught:
        for t in range(1, STEPS + 1):
            _set_grads(eager_params, t)
            _set_grads(compiled_params, t)
            for opt in (eager, compiled):
                opt.param_groups[0]["lr"] = 0.05 / t  # as a scheduler would
            eager.step()
            step()
            for p, q in zip(eager_params, compiled_params, strict=True):
                assert torch.equal(p, q), (name, t)
                for key, value in eager.state[p].items():
                    assert torch.equal(value, compiled.state[q][key]), (name, t, key)
    said = [w for w in caught if "outside the graph" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [(w.filename, w.lineno) for w in said]  # once, here
    assert not operations, operations  # no tensor operation in a graph (a frame's guards may make empty ones)
    breaks = counters["graph_break"]
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), dict(breaks)
