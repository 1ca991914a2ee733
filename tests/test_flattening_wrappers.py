"""Parameters whose matrix the optimizer cannot see (FSDP1, DeepSpeed ZeRO) are refused, never run as AdamW.

A wrapper that flattens parameters hands the optimizer 1-D tensors, on which every AdaDiag optimizer would
silently degrade to its unrotated form.  The adapter refuses them with an error naming the wrapper and the
supported alternatives, before anything changes.  DeepSpeed cannot be installed here: its ZeRO-3 parameters are
imitated by tensors carrying ``ds_shape``/``ds_id`` (the attributes the adapter relies on), and ZeRO 1/2 by
replacing a group's parameters with one flat partition, as its optimizer wrapper does.
"""

from __future__ import annotations

import _adapter_import  # noqa: F401
import pytest

torch = pytest.importorskip("torch")

from adadiag_ref.adapters.pytorch import AdaDiag, AdamW  # noqa: E402


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64)) for shape in ((4, 6), (4,))]


def _with_grads(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    return params


def _snapshot(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for group in opt.param_groups for p in group["params"]]


@pytest.mark.parametrize("cls", [AdaDiag, AdamW])
def test_fsdp1_flattened_parameter_refused_at_construction(cls):
    params = _params()
    params[0]._fsdp_flattened = True  # what FSDP1's FlatParamHandle sets on every parameter it manages
    with pytest.raises(RuntimeError, match=r"parameter 'w' is managed by FSDP1 .*fully_shard.*DistributedDataParallel"):
        cls([("w", params[0]), ("b", params[1])], lr=0.1)


def test_fsdp1_mark_after_construction_refused_at_first_step_with_nothing_changed():
    params = _with_grads(_params())
    opt = AdaDiag(params, lr=0.1, update_freq=2)
    params[1]._fsdp_flattened = True  # the optimizer was built before the model was wrapped
    before = _snapshot(opt)
    with pytest.raises(RuntimeError, match=r"parameter 1 of param_groups\[0\] is managed by FSDP1"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(_snapshot(opt), before, strict=True))
    assert not opt.state


def test_deepspeed_zero3_partitioned_parameter_refused():
    params = _params()
    partitioned = torch.nn.Parameter(torch.empty(0, dtype=torch.float64))
    partitioned.ds_shape, partitioned.ds_id = (4, 6), 0  # a ZeRO-3 parameter between gathers
    with pytest.raises(RuntimeError, match=r"partitioned by DeepSpeed ZeRO-3: its matrix has shape \(4, 6\)"):
        AdaDiag([*params, partitioned], lr=0.1)


def test_deepspeed_zero3_gathered_parameter_steps_as_a_plain_one():
    """Gathered (its tensor has the true shape), a ZeRO-3 parameter is an ordinary matrix: the exact result."""
    plain, gathered = _with_grads(_params()), _with_grads(_params())
    gathered[0].ds_shape, gathered[0].ds_id = (4, 6), 0
    for params in (plain, gathered):
        AdaDiag(params, lr=0.1, update_freq=2).step()
    assert all(torch.equal(a, b) for a, b in zip(plain, gathered, strict=True))


def test_group_replaced_by_a_flat_partition_refused_at_first_step_with_nothing_changed():
    """DeepSpeed ZeRO 1/2 replace ``param_group['params']`` by one flat partition (a plain tensor, no mark)."""
    params = _params()
    opt = AdaDiag(params, lr=0.1, update_freq=2)
    flat = torch.nn.Parameter(torch.cat([p.detach().flatten() for p in params])[:14].clone())
    flat.grad = torch.ones_like(flat)
    opt.param_groups[0]["params"] = [flat]
    before = flat.detach().clone()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\] held 2 parameters .* holds 1 now: .*DeepSpeed"):
        opt.step()
    assert torch.equal(flat, before) and not opt.state


def test_reshaped_parameter_refused_at_first_step():
    params = _with_grads(_params())
    opt = AdaDiag(params, lr=0.1)
    params[0].data = params[0].data.flatten()  # FSDP1's sharded views look like this
    params[0].grad = params[0].grad.flatten()
    with pytest.raises(RuntimeError, match=r"has a parameter of shape \(24,\) that was \(4, 6\)"):
        opt.step()
    assert not opt.state


def test_checked_again_after_deepcopy_and_added_groups():
    params = _with_grads(_params())
    opt = AdaDiag(params[:1], lr=0.1)
    opt.step()  # checked once, then not at every step
    extra = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    extra._fsdp_flattened = True
    with pytest.raises(RuntimeError, match="FSDP1"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1
    import copy

    clone = copy.deepcopy(opt)
    clone.param_groups[0]["params"][0]._fsdp_flattened = True
    with pytest.raises(RuntimeError, match="FSDP1"):
        clone.step()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_fsdp1_two_ranks_refused_with_the_wrapper_named(tmp_path):
    import _fsdp1_worker
    from _ranks import free_port, spawn_ranks

    spawn_ranks(_fsdp1_worker.worker, (free_port(), str(tmp_path)), _fsdp1_worker.WORLD, 300.0)
    for rank in range(_fsdp1_worker.WORLD):
        report = torch.load(tmp_path / f"fsdp1_rank{rank}.pt")
        assert any(len(shape) == 1 for shape in report["shapes"])  # the flat shards this rank holds
        for key in ("constructor", "step", "dcp"):
            message = report[key]
            assert "is managed by FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel)" in message, (key, message)
            assert "fully_shard" in message and "DistributedDataParallel" in message, (key, message)
        assert report["unchanged"] and report["state_empty"]
