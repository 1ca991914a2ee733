"""The torch adapter's default CPU route (issues 31, 44): one :class:`adadiag_ref.Engine` per param group, its
group kernels, the engine kept between steps and built again when what it holds changes, and ``opt.routes()``.

Every trajectory is compared bit for bit with ``kernels="reference"`` (the engine without kernels, on torch ops,
which ``tests/test_adapter_torch.py`` ties to the core's ``ar.step``), so a stale engine (old hyperparameters,
addresses of freed memory, a parameter left out, state tensors it no longer holds) shows as a difference.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
import time

import _adapter_import  # noqa: F401
import pytest
import torch
from adadiag_ref.adapters import pytorch as at
from hypothesis import given
from hypothesis import strategies as st

SHAPES = [(5, 7), (7, 5), (7,), (6, 2, 2), (3, 1), ()]
NAMES = ["adamw", "adadiag", "adadiag_pp"]


def _params(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in SHAPES]


def _grads(params, k):
    gen = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def _pair(name, **hyper):
    """The same run twice: the default route and ``kernels="reference"``."""
    runs = []
    for kernels in ("auto", "reference"):
        params = _params()
        runs.append((params, at.OPTIMIZER_CLASSES[name](params, kernels=kernels, **hyper)))
    return runs


def _assert_same(runs):
    (pa, oa), (pb, ob) = runs
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(a, b)
        sa, sb = oa.state[a], ob.state[b]
        assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _steps(runs, ks, edit=None):
    for k in ks:
        for params, opt in runs:
            if edit is not None:
                edit(params, opt, k)
            _grads(params, k)
            opt.step()


def _assert_poisoned_step_changes_nothing(params, opt, index, entry, message, value=float("inf")):
    """A step whose gradient ``index`` holds ``value`` at ``entry`` raises ``ValueError`` matching ``message`` and
    leaves every parameter and state tensor as it was."""
    before = copy.deepcopy(([p.detach() for p in params], opt.state_dict()["state"]))
    _grads(params, 9)
    params[index].grad[entry] = value
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before[0], params, strict=True))
    assert all(torch.equal(v, opt.state_dict()["state"][i][k]) for i, s in before[1].items() for k, v in s.items())


@contextlib.contextmanager
def _large_lane(monkeypatch, kernel, threads):
    """The large lane's setting for a test: rows cut between threads from 1000 entries, ``torch`` on ``threads``
    threads; yields the list that grows by one per call of ``group_route.kernel``."""
    from adadiag_ref.optim.families.adam import group_route, torch_route

    monkeypatch.setattr(torch_route, "SPLIT_MIN_SIZE", 1000)  # cut the rows between the threads
    calls = []
    original = getattr(group_route, kernel)
    monkeypatch.setattr(group_route, kernel, lambda *a: calls.append(1) or original(*a))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield calls
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("name", NAMES)
def test_group_kernels_are_taken_and_bit_identical(name, monkeypatch):
    from adadiag_ref.optim.families.adam import group_route

    calls = []
    kernel = "engine_step" if name == "adamw" else "engine_moments"
    original = getattr(group_route, kernel)
    monkeypatch.setattr(group_route, kernel, lambda *a: calls.append(1) or original(*a))
    runs = _pair(name, lr=0.01, weight_decay=0.1, update_freq=4)
    _steps(runs, range(9))
    _assert_same(runs)
    assert len(calls) == 9  # every step, refreshes (t = 1, 5, 9) included: one call per step (one guided piece)
    routes = runs[0][1].routes()
    rotated = [label for label in routes if label != "param_groups[0].params[2]" or name == "adamw"]
    assert all(routes[k]["moments"].startswith("in place: adadiag_ref.optim.families.adam.group_route")
               for k in rotated), routes  # fmt: skip
    assert all(r["engine"].startswith("flat group") for r in routes.values())
    assert not any("group_route" in r["moments"] for r in runs[1][1].routes().values())


@pytest.mark.parametrize("name", NAMES)
def test_a_scheduler_moving_betas_and_weight_decay_keeps_the_group_kernels(name, monkeypatch):
    """OneCycleLR with ``cycle_momentum`` moves ``betas[0]`` at every step, and a hand schedule the weight decay:
    the kept engine steps every one of them by its group kernels (one call per step, the engine never built
    again), with the bits of ``kernels="reference"``."""
    from adadiag_ref.optim.families.adam import group_route

    calls = []
    kernel = "engine_step" if name == "adamw" else "engine_moments"
    original = getattr(group_route, kernel)
    monkeypatch.setattr(group_route, kernel, lambda *a: calls.append(1) or original(*a))
    runs = _pair(name, lr=0.01, weight_decay=0.1, update_freq=4)
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=9) for _, opt in runs]

    def decay(params, opt, k):
        opt.param_groups[0]["weight_decay"] = (0.1, 0.0, 0.05)[k % 3]

    seen, engines = set(), set()
    for k in range(8):
        _steps(runs, [k], decay)
        seen.add(runs[0][1].param_groups[0]["betas"])
        engines.add(id(runs[0][1]._engines[0].engine))
        for scheduler in schedulers:
            scheduler.step()
    _assert_same(runs)
    assert len(seen) == 8 and len(calls) == 8 and len(engines) == 1, (seen, calls, engines)


def _set_data(p, data):
    p.grad.data = data  # torch refuses a grad of another shape or dtype, but not such .data


BAD_GRADIENTS = {  # how to give parameter 0, of shape (5, 7), a gradient it refuses; the error
    "dtype": (lambda p: _set_data(p, torch.zeros(p.shape, dtype=torch.float32)), ValueError,
              "gradient of parameter 0 of param_groups[0] has dtype torch.float32, the parameter torch.float64"),
    "shape": (lambda p: _set_data(p, torch.zeros(5, 7, 1, dtype=p.dtype)), ValueError,
              "gradient of parameter 0 of param_groups[0] has shape (5, 7, 1), the parameter (5, 7)"),
    "sparse": (lambda p: setattr(p, "grad", torch.ones(p.shape, dtype=p.dtype).to_sparse()), RuntimeError,
               "sparse gradients (torch.sparse_coo) are not supported"),
}  # fmt: skip


@pytest.mark.parametrize("bad", BAD_GRADIENTS)
@pytest.mark.parametrize("name", NAMES)
def test_a_kept_engine_refuses_a_bad_gradient_as_the_first_step_does(name, bad):
    """In the steady state (the group's engine kept), a gradient of another dtype, shape or layout than its
    parameter's is refused with the message of a first step, naming the parameter, and nothing changes: the run
    then goes on as one that never saw it."""
    give, error, message = BAD_GRADIENTS[bad]
    runs = _pair(name, lr=0.01, weight_decay=0.1, update_freq=3)
    _steps(runs, range(2))
    params, opt = runs[0]
    engine = opt._engines[0]
    _grads(params, 2)
    give(params[0])
    before = [p.clone() for p in params], copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(error, match=re.escape(message)):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before[0], strict=True))
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], before[1][i][k]) for i in after for k in after[i])
    assert opt._engines[0] is engine
    _steps(runs, range(2, 6))
    _assert_same(runs)


@pytest.mark.parametrize("name", NAMES)
def test_the_state_dict_holds_the_engines_arrays_and_stays_current(name):
    """``state[p]``'s moments and bases are views of the group engine's arrays, written in place at every step:
    references taken once (as ``state_dict()`` returns them) keep showing the current state, refresh steps
    included, and a replaced state tensor makes the optimizer build its engine again around it."""
    params = _params()
    opt = at.OPTIMIZER_CLASSES[name](params, lr=0.01, weight_decay=0.1, update_freq=2)
    _steps([(params, opt)], range(2))
    held = {(i, k): v for i, s in opt.state_dict()["state"].items() for k, v in s.items() if k != "step"}
    reference = _params()
    ref = at.OPTIMIZER_CLASSES[name](reference, lr=0.01, weight_decay=0.1, update_freq=2, kernels="reference")
    _steps([(reference, ref)], range(2))
    _steps([(params, opt), (reference, ref)], range(2, 5))  # t = 3, 5 refresh
    for (i, k), tensor in held.items():
        assert torch.equal(tensor, ref.state[reference[i]][k]), (i, k)
        assert tensor is opt.state[params[i]][k]
    engine = opt._engines[0]
    opt.state[params[0]]["V"] = opt.state[params[0]]["V"].clone()
    _steps([(params, opt), (reference, ref)], range(5, 7))
    assert opt._engines[0] is not engine
    _assert_same([(params, opt), (reference, ref)])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "key, value", [("lr", 0.5), ("weight_decay", 0.0), ("betas", (0.5, 0.9)), ("eps", 1e-3), ("maximize", True)]
)
def test_a_hyperparameter_edited_between_steps_is_used(name, key, value):
    """The cached decision holds the group's config: an edit of ``param_groups`` must reach the next step."""

    def edit(params, opt, k):
        if k == 3:
            opt.param_groups[0][key] = value

    runs = _pair(name, lr=0.01, weight_decay=0.1, update_freq=None)
    _steps(runs, range(6), edit)
    _assert_same(runs)
    fresh = _params()
    opt = at.OPTIMIZER_CLASSES[name](fresh, lr=0.01, weight_decay=0.1, update_freq=None)
    _steps([(fresh, opt)], range(3))
    assert not torch.equal(fresh[0], runs[0][0][0]) or key == "lr"  # the edit changed the trajectory


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_then_step(name):
    runs = _pair(name, lr=0.01, weight_decay=0.1, update_freq=None)
    _steps(runs, range(3))
    saved = [copy.deepcopy(opt.state_dict()) for _, opt in runs]
    _steps(runs, range(3, 5))
    for (_, opt), state in zip(runs, saved, strict=True):
        opt.load_state_dict(state)  # new state tensors: the kernels must not write the old ones
    _steps(runs, range(5, 8))
    _assert_same(runs)


def test_replaced_parameter_storage_and_state_tensors():
    """``p.data = ...`` and a state tensor replaced by hand give the kernels new memory."""

    def edit(params, opt, k):
        if k == 3:
            params[0].data = params[0].data.clone()
            flat = opt.state[params[2]]
            flat["M"] = flat["M"].clone()

    runs = _pair("adadiag", lr=0.01, update_freq=None)
    _steps(runs, range(6), edit)
    _assert_same(runs)


def test_a_parameter_resized_in_place_gets_the_adapters_error_and_keeps_its_state():
    """``p.data = `` a tensor of another shape, on the steady path: the adapter's own error (the state was made for
    the old shape), not the engine's, and nothing changed."""
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    opt = at.AdamW([p], lr=1e-2)
    for _ in range(2):
        p.grad = torch.randn(4, 3, dtype=torch.float64)
        opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    p.data = torch.randn(5, 3, dtype=torch.float64)
    p.grad = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"state field 'M' has shape \(3, 4\), expected \(3, 5\)"):
        opt.step()
    for k, v in before.items():
        assert torch.equal(opt.state[p][k], v), k


def test_add_param_group_and_a_gradient_that_appears():
    def edit(params, opt, k):
        if k == 2:
            opt.add_param_group({"params": [params[-1]], "lr": 0.3})
        if k == 4:
            params[0].grad = None  # _grads gives every parameter a gradient again: params[0] resumes

    runs = []
    for kernels in ("auto", "reference"):
        params = _params()
        opt = at.AdaDiag([{"params": params[:-1]}], kernels=kernels, lr=0.01, update_freq=None)
        runs.append((params, opt))
    for k in range(6):
        for params, opt in runs:
            edit(params, opt, k)
            _grads(params, k)
            if k == 1:
                params[1].grad = None  # a step without one parameter: it is skipped
            if k < 2:
                params[-1].grad = None
            opt.step()
    _assert_same(runs)


def test_non_finite_gradient_on_the_group_route_changes_nothing():
    params = _params()
    opt = at.AdaDiag(params, lr=0.01, update_freq=None)
    _steps([(params, opt)], range(3))
    assert "group_route" in opt.routes()["param_groups[0].params[0]"]["moments"]
    message = r"parameter 3 of param_groups\[0\] contains NaN or Inf at step 4"
    _assert_poisoned_step_changes_nothing(params, opt, 3, (2, 1, 0), message, float("nan"))


def test_routes_report_each_part_per_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = at.AdaDiag(model.named_parameters(), update_freq=None)
    assert set(opt.routes()) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert opt.routes()["0.weight"]["moments"].startswith("none")  # no gradient yet
    model(torch.randn(2, 4)).sum().backward()
    first = opt.routes()  # no state yet: the engine the first step would build
    opt.step()
    routes = opt.routes()
    assert routes == first
    assert set(routes["0.weight"]) == {"refresh", "rotate", "moments", "engine"}
    assert routes["0.weight"]["rotate"].startswith("batched GEMM: G~ = P^T G over 1 3 x 4 matrices (torch.mm")
    assert routes["0.weight"]["refresh"].startswith("refresh_basis per parameter")
    assert routes["0.weight"]["engine"] == routes["1.bias"]["engine"]  # one group: every member rotated
    bf16 = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.bfloat16))
    opt16 = at.AdamW([bf16])
    bf16.grad = torch.randn_like(bf16)
    opt16.step()
    entry = opt16.routes()["param_groups[0].params[0]"]
    assert entry["rotate"].startswith("none") and entry["refresh"].startswith("none")
    assert "parameters bfloat16" in entry["engine"] and "group_route" not in entry["moments"]  # no kernels
    fe = at.AdamW(_params(), foreach=True)
    for p in fe.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    fe.step()
    assert all("engine" in r and "group_route" in r["moments"] for r in fe.routes().values())  # foreach: no effect


@pytest.fixture
def entrywise_heavyball():
    """The heavy-ball family of ``tests/test_extending.py`` registered as entrywise (restored afterwards)."""
    import dataclasses

    import test_extending as ext

    import adadiag_ref as ar
    from adadiag_ref.optim.families import FAMILIES, register_family

    register_family(dataclasses.replace(ext.SPEC, entrywise=True), ext.OPTIMIZERS)
    yield
    del FAMILIES["heavyball"]
    for name in ext.OPTIMIZERS:
        del ar.OPTIMIZERS[name]


@pytest.mark.parametrize("name", ["heavyball", "heavyballdiag"])
@pytest.mark.usefixtures("entrywise_heavyball")
def test_a_registered_entrywise_family_is_stepped_by_its_engine_whatever_foreach_says(name):
    """A registered entrywise family's parameters are stepped by their group's engine whatever ``foreach`` says (its
    direction once over the flat group), bit for bit, refresh steps included."""
    runs = []
    for foreach in (False, True):
        params = _params()
        opt = at.CoreOptimizer(params, name=name, lr=0.01, weight_decay=0.1, update_freq=3, foreach=foreach)
        runs.append((params, opt))
    _steps(runs, range(7))
    _assert_same(runs)
    assert all("engine" in r for r in runs[1][1].routes().values())


@pytest.mark.parametrize("name", NAMES)
def test_large_and_small_parameters_share_the_group_step(name):
    """A parameter of more than the kernels' chunk (65536 entries) beside small ones: one engine group, bit for
    bit the reference, and a NaN in the large one's gradient still changes nothing."""
    runs = []
    for kernels in ("auto", "reference"):
        big = torch.randn(300, 300, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        params = [*_params(), torch.nn.Parameter(big)]
        runs.append((params, at.OPTIMIZER_CLASSES[name](params, kernels=kernels, lr=0.01, weight_decay=0.1)))
    _steps(runs, range(4))
    _assert_same(runs)
    params, opt = runs[0]
    message = r"parameter 6 of param_groups\[0\] contains NaN or Inf at step 5"
    _assert_poisoned_step_changes_nothing(params, opt, 6, (3, 4), message)


@pytest.mark.parametrize("name", ["adamw", "adadiag"])
def test_a_counter_edited_in_place_is_followed(name):
    """``opt.state[p]["step"]`` edited in place (the value, not the tensor object): the next step counts from it,
    bias correction and refresh schedule included, as ``ar.step`` from a state whose count was set so."""
    import adadiag_ref as ar

    params = _params()
    opt = at.OPTIMIZER_CLASSES[name](params, lr=0.01, weight_decay=0.1, update_freq=4)
    cfg = opt.config()
    weights = [p.detach().clone() for p in params]
    states = [ar.init(w, cfg) for w in weights]
    for k in range(7):
        if k == 3:
            for p in params:
                opt.state[p]["step"].fill_(6)  # the next step is t = 7, no refresh; t = 9 refreshes
            states = [st._replace(count=torch.tensor(6, dtype=torch.int32)) for st in states]
        _grads(params, k)
        opt.step()
        for i, p in enumerate(params):
            weights[i], states[i] = ar.step(states[i], p.grad, cfg, weights[i], lr=0.01)
    assert all(torch.equal(p.detach(), w) for p, w in zip(params, weights, strict=True))
    assert all(int(opt.state[p]["step"]) == 10 for p in params)


def test_a_frozen_parameter_keeps_the_steady_path(monkeypatch):
    """A parameter that never has a gradient (frozen) leaves the others on the engine's steady path (no
    per-parameter record and no new engine after the first step), bit for bit ``kernels="reference"``, and the
    frozen one without state."""
    runs = _pair("adadiag", lr=0.01, weight_decay=0.1, update_freq=3)
    general, built = [], []
    records, engine = at.CoreOptimizer._work_of, at._GroupEngine.__init__
    monkeypatch.setattr(at.CoreOptimizer, "_work_of", lambda self, *a, **k: general.append(1) or records(
        self, *a, **k))  # fmt: skip
    monkeypatch.setattr(at._GroupEngine, "__init__", lambda self, *a: built.append(1) or engine(self, *a))
    for k in range(6):
        for params, opt in runs:
            _grads(params, k)
            params[1].grad = None
            opt.step()
    assert all(params[1] not in opt.state for params, opt in runs)
    assert len(general) == len(built) == 2  # each run's first step builds its engine; every later step is steady
    _assert_same(runs)


def test_a_steady_group_stays_steady_beside_a_changing_one(monkeypatch):
    """Two param groups, the second's parameter frozen and thawed in turn (its engine built again each time): the
    first group is stepped by its kept engine throughout, without a per-parameter record, whatever the second does;
    bit for bit ``ar.step`` per parameter, also in the second group."""
    import adadiag_ref as ar

    params = _params()
    first, second = params[:3], params[3:]
    opt = at.AdaDiag([{"params": first}, {"params": second, "weight_decay": 0.1}], lr=0.01, update_freq=3)
    recorded = []  # the group of each per-parameter record a step makes (each names its parameter once)
    label = at._label
    monkeypatch.setattr(at, "_label", lambda names, i, group: recorded.append(group) or label(names, i, group))
    weights = [p.detach().clone() for p in params]
    cfgs = [opt.config(0)] * len(first) + [opt.config(1)] * len(second)
    states = [ar.init(w, cfg) for w, cfg in zip(weights, cfgs, strict=True)]
    for k in range(7):
        _grads(params, k)
        if k % 2:
            second[0].grad = None  # frozen on odd steps
        opt.step()
        for i, p in enumerate(params):
            if p.grad is not None:
                weights[i], states[i] = ar.step(states[i], p.grad, cfgs[i], weights[i], lr=0.01)
        assert all(torch.equal(p.detach(), w) for p, w in zip(params, weights, strict=True)), k
    assert recorded.count(0) == len(first)  # the first step only: its engine is kept from then on
    assert recorded.count(1) == 4 * len(second) + 3 * (len(second) - 1)  # its gradients change: records each step


def test_moment_storage_moved_by_hand_is_followed():
    """``Tensor.set_`` on a moment (the same tensor object, new memory): the kernels write the new memory."""

    def edit(params, opt, k):
        if k == 3:
            M = opt.state[params[0]]["M"]
            M.set_(M.clone())

    runs = _pair("adamw", lr=0.01, update_freq=None)
    _steps(runs, range(6), edit)
    _assert_same(runs)


LARGE_SHAPES = [(130, 300), (20000,), (170, 100), (5, 7), (7,)]  # large and small: one group


def _large_adamw_pair(dtype=torch.float32, **hyper):
    """``AdamW`` over :data:`LARGE_SHAPES` twice, from the same start: the default route and ``kernels="reference"``."""
    runs = []
    for kernels in ("auto", "reference"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in LARGE_SHAPES]
        runs.append((params, at.AdamW(params, lr=0.01, kernels=kernels, **hyper)))
    return runs


def _pieces(sizes, threads):
    """The pieces ``torch_route.split_rows`` cuts a lane's rows into for ``sizes`` on ``threads`` threads (one
    call each), under ``_large_lane``'s ``SPLIT_MIN_SIZE``."""
    from adadiag_ref.optim.families.adam import group_route, torch_route

    rows = group_route.chunk_table(sizes)
    entries = rows[:, 2] - rows[:, 1]
    if min(threads, int(entries.sum()) // torch_route.SPLIT_MIN_SIZE, len(rows)) <= 1:
        return 1
    return len(torch_route.guided_cuts(entries, threads, 4 * torch_route.SPLIT_MIN_SIZE)) - 1


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_unrotated_parameters_share_kernel_calls_whatever_their_number(dtype, weight_decay, threads, monkeypatch):
    """AdamW's parameters (embeddings, heads, MLP matrices, small ones) are stepped together: one read pass counts
    their gradients' NaN/Inf, then one kernel call per guided piece writes all of them in place in one pass
    (``group_route.engine_step``), whatever their number; no ``torch.sqrt`` (the root is the library's, inside the
    kernels); bit for bit ``kernels="reference"``, also with the rows cut between threads; a NaN in one of them
    changes nothing and names it."""
    with _large_lane(monkeypatch, "engine_step", threads) as calls:
        runs = _large_adamw_pair(dtype, weight_decay=weight_decay)
        roots = []
        sqrt = torch.sqrt
        monkeypatch.setattr(torch, "sqrt", lambda *a, **k: roots.append(1) or sqrt(*a, **k))
        _steps(runs[:1], range(5))
        monkeypatch.setattr(torch, "sqrt", sqrt)
        _steps(runs[1:], range(5))
        _assert_same(runs)
        assert roots == []
        sizes = [p.numel() for p in runs[0][0]]
        assert 5 <= len(calls) <= 5 * _pieces(sizes, threads)  # steps 1 to 5, one call per guided piece
        assert len({r["engine"] for r in runs[0][1].routes().values()}) == 1  # one group
        params, opt = runs[0]
        message = r"parameter 2 of param_groups\[0\] contains NaN or Inf at step 6"
        _assert_poisoned_step_changes_nothing(params, opt, 2, (3, 4), message, float("nan"))


@given(
    sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=12),
    parts=st.integers(2, 8),
    least=st.integers(1, 200_000),
)
def test_guided_cuts_cover_every_row_once_in_shrinking_pieces(sizes, parts, least):
    """The pieces cover the rows once, in order; each but the last holds at least ``least`` entries or one row; the
    first is about ``1 / (2 parts)`` of all, and a piece is never larger than the one before by more than a row."""
    from adadiag_ref.optim.families.adam import group_route, torch_route

    rows = group_route.chunk_table(sizes)
    entries = rows[:, 2] - rows[:, 1]
    cuts = torch_route.guided_cuts(entries, parts, least)
    assert cuts[0] == 0 and cuts[-1] == len(rows) and all(a < b for a, b in itertools.pairwise(cuts))
    pieces = [int(entries[a:b].sum()) for a, b in itertools.pairwise(cuts)]
    chunk = group_route.CHUNK
    assert all(p >= least or b - a == 1 for p, a, b in zip(pieces[:-1], cuts, cuts[1:]))
    if pieces:
        assert pieces[0] <= max(int(entries.sum()) // (2 * parts), least) + chunk
    assert all(later <= earlier + max(least, chunk) for earlier, later in itertools.pairwise(pieces))


def test_split_rows_lets_the_other_threads_take_a_slow_threads_share(monkeypatch):
    """The threads take the next piece as they finish: while a helper thread is held up (a core shared with torch's
    spinning OpenMP workers), the calling thread steps the rest, and the results come back in the pieces' order."""
    import threading

    import numpy as np

    from adadiag_ref.optim.families.adam import group_route, torch_route

    monkeypatch.setattr(torch_route, "SPLIT_MIN_SIZE", 1000)
    rows = group_route.chunk_table([5000] * 40)
    caller, taken, held, armed = threading.get_ident(), [], threading.Event(), []

    def kernel(piece):
        if not armed:
            pass
        elif threading.get_ident() != caller and not held.is_set():
            held.set()
            time.sleep(0.5)  # the helper's first piece: far longer than all the others together
        elif threading.get_ident() == caller:
            assert held.wait(10)  # the caller starts once the helper holds a piece
        taken.append((threading.get_ident(), int(piece[0, 0])))
        return int(piece[0, 0]), int(piece[-1, 0])

    torch_route.split_rows(kernel, (), rows, (), np.float64, threads=2)  # the first call runs on one thread
    taken.clear()
    armed.append(True)
    results = torch_route.split_rows(kernel, (), rows, (), np.float64, threads=2)
    cuts = torch_route.guided_cuts(rows[:, 2] - rows[:, 1], 2, 4000)
    assert results == [(a, b - 1) for a, b in itertools.pairwise(cuts)]  # every row once, in order
    by_caller = sum(ident == caller for ident, _ in taken)
    assert held.is_set() and by_caller == len(cuts) - 2, (by_caller, len(cuts))  # all but the held one


def test_split_rows_raises_the_kernels_error_once_every_helper_has_stopped(monkeypatch):
    """A kernel that raises on the calling thread: ``split_rows`` raises that very error, and only after the helper
    has finished its pieces (no thread may still be writing when the caller sees the error)."""
    import threading

    import numpy as np

    from adadiag_ref.optim.families.adam import group_route, torch_route

    monkeypatch.setattr(torch_route, "SPLIT_MIN_SIZE", 1000)
    rows = group_route.chunk_table([5000] * 40)
    caller, helper_done, armed = threading.get_ident(), threading.Event(), []

    def kernel(piece):
        if armed and threading.get_ident() == caller:
            raise ValueError("the caller's piece failed")
        if armed:
            time.sleep(0.2)  # the helper is still writing when the caller fails
            helper_done.set()

    torch_route.split_rows(kernel, (), rows, (), np.float64, threads=2)  # the first call runs on one thread
    armed.append(True)
    with pytest.raises(ValueError, match="the caller's piece failed"):
        torch_route.split_rows(kernel, (), rows, (), np.float64, threads=2)
    assert helper_done.is_set()


# rotated: wide, tall (a transposed work frame), conv-like (reshaped), a vector (1 x n); small ones
LARGE_ROTATED_SHAPES = [(130, 300), (300, 130), (20, 10, 9, 11), (20000,), (5, 7), (7,)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_large_rotated_parameters_step_their_moments_in_place(name, dtype, weight_decay, threads, monkeypatch):
    """A rotated group's moments: ``M`` and ``V`` written in place (their storage never moves, no new moment
    tensors), ``U~`` over ``G~`` in the engine's scratch, one ``engine_moments`` call per guided piece of the
    whole group.  Bit for bit ``kernels="reference"`` at every step, refresh steps included, with the rows on one
    thread or cut between two; a NaN in one of them changes nothing and names it."""
    with _large_lane(monkeypatch, "engine_moments", threads) as calls:
        runs = []
        for kernels in ("auto", "reference"):
            gen = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in LARGE_ROTATED_SHAPES]
            # maximize with decay: the engine steps the negated gradients
            opt = at.OPTIMIZER_CLASSES[name](params, lr=0.01, weight_decay=weight_decay, update_freq=3,
                                             maximize=weight_decay > 0, kernels=kernels)  # fmt: skip
            runs.append((params, opt))
        params, opt = runs[0]
        _steps(runs, range(2))  # t = 1 refreshes
        storage = [opt.state[p][k].data_ptr() for p in params for k in ("M", "V")]
        calls.clear()
        _steps(runs, range(2, 3))  # t = 3: no refresh
        _assert_same(runs)
        assert 1 <= len(calls) <= _pieces([p.numel() for p in params], threads), calls
        assert [opt.state[p][k].data_ptr() for p in params for k in ("M", "V")] == storage  # in place
        _steps(runs, range(3, 8))  # t = 4 refreshes
        _assert_same(runs)
        assert [opt.state[p][k].data_ptr() for p in params for k in ("M", "V")] == storage
        message = r"parameter 3 of param_groups\[0\] contains NaN or Inf at step 9"
        _assert_poisoned_step_changes_nothing(params, opt, 3, (17,), message)
