"""The output-buffer pool (``adadiag_ref.buffers``): a block is lent again only when no view of it is alive, the
limit holds, and results never depend on the pool (the functional update, the rotation products and replay give
the same bits with the pool on and off)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import adadiag_ref as ar
from adadiag_ref import buffers

BIG = (512, 256)  # 512 KiB in float32: above MIN_BYTES
assert BIG[0] * BIG[1] * 4 >= buffers.MIN_BYTES


@pytest.fixture(autouse=True)
def fresh_pool() -> Iterator[None]:
    """Each test starts with an empty pool and a generous limit, and leaves the process's limit as it was."""
    gc.collect()
    previous = buffers.set_limit(1 << 30)
    buffers.release()
    yield
    gc.collect()
    buffers.set_limit(previous)


def address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("order", ["C", "F"])
def test_empty_is_an_ordinary_array_of_the_asked_layout(dtype: type, order: str) -> None:
    a = buffers.empty(BIG, dtype, order=order)
    assert type(a) is np.ndarray and a.shape == BIG and a.dtype == dtype and a.flags.writeable
    assert a.flags.c_contiguous if order == "C" else a.flags.f_contiguous
    assert not a.flags.owndata  # a view of a pooled block
    like = buffers.empty_like(np.empty(BIG, dtype, order=order))
    assert like.strides == np.empty(BIG, dtype, order=order).strides


def test_small_arrays_and_a_zero_limit_bypass_the_pool() -> None:
    assert buffers.empty((4, 4), np.float32).flags.owndata
    before = buffers.stats()
    buffers.set_limit(0)
    a = buffers.empty(BIG, np.float32)
    assert a.flags.owndata and buffers.stats().allocated == before.allocated


def test_a_block_returns_only_when_its_last_view_is_gone() -> None:
    nbytes = BIG[0] * BIG[1] * 4
    a = buffers.empty(BIG, np.float32)
    where = address(a)
    views = [a[::2].T, a.reshape(-1)[10:], np.asarray(a), a.view(np.int32)]
    del a
    for k in range(len(views)):
        gc.collect()
        assert buffers.stats().idle_bytes == 0, f"block returned while {len(views) - k} views were alive"
        views.pop()
    gc.collect()
    assert buffers.stats().idle_bytes == nbytes
    reused = buffers.stats().reused
    b = buffers.empty((BIG[1], BIG[0]), np.float32)  # same size, another shape
    assert address(b) == where and buffers.stats().reused == reused + 1 and buffers.stats().idle_bytes == 0


def test_live_arrays_are_never_overwritten() -> None:
    """Allocate, write a signature, keep a view and drop the rest, allocate again: the kept views keep their
    values, and no two live arrays share memory."""
    kept: list[tuple[np.ndarray, float]] = []
    for k in range(12):
        a = buffers.empty(BIG, np.float32)
        a[...] = k
        if k % 3 == 0:
            kept.append((a[1:, ::3], float(k)))  # a strided view keeps the whole block
        del a
        for view, value in kept:
            assert np.all(view == value)
    for i, (x, _) in enumerate(kept):
        for y, _ in kept[i + 1 :]:
            assert not np.shares_memory(x, y)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "drop", "view"]), st.integers(0, 7)), max_size=40))
def test_pool_property_live_memory_is_exclusive(ops: list[tuple[str, int]]) -> None:
    """Under any sequence of allocations (two sizes, both orders), views and drops, every live array keeps the
    value written into it and the counters balance: lent bytes = the bytes of live blocks."""
    live: list[tuple[np.ndarray, float]] = []
    shapes = [BIG, (256, 1024)]
    counter = 0.0
    for op, k in ops:
        # no loop variable may hold an array: `live` is the only reference the test keeps
        if op == "alloc":
            counter += 1
            live.append((buffers.empty(shapes[k % 2], np.float32, order="CF"[k // 4 % 2]), counter))
            live[-1][0][...] = counter
        elif op == "drop" and live:
            live.pop(k % len(live))
        elif op == "view" and live:
            i = k % len(live)
            live[i] = (live[i][0].T[::2], live[i][1])
        # no gc.collect() here: the arrays hold no cycles, so a dropped one returns its block at once (refcount);
        # a full collection per operation took 100 s of the fast tier in a worker whose heap held every suite
        assert all(np.all(array == value) for array, value in live)
    live.clear()
    gc.collect()
    assert buffers.stats().lent_bytes == 0


def test_limit_is_kept_and_validated() -> None:
    nbytes = BIG[0] * BIG[1] * 4
    buffers.set_limit(nbytes)  # room for one idle block
    a, b = buffers.empty(BIG, np.float32), buffers.empty(BIG, np.float32)
    freed = buffers.stats().freed
    del a, b
    gc.collect()
    assert buffers.stats().idle_bytes == nbytes and buffers.stats().freed == freed + 1
    assert buffers.set_limit(0) == nbytes and buffers.stats().idle_bytes == 0 and buffers.limit() == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="non-negative int"):
            buffers.set_limit(bad)  # type: ignore[arg-type]
    assert buffers.limit() == 0


def test_release_frees_idle_blocks_and_keeps_the_limit() -> None:
    a = buffers.empty(BIG, np.float32)
    del a
    gc.collect()
    assert buffers.stats().idle_bytes > 0
    buffers.release()
    assert buffers.stats().idle_bytes == 0 and buffers.limit() == 1 << 30


def test_threads_allocating_and_dropping_concurrently() -> None:
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for k in range(200):
                a = buffers.empty(BIG if (seed + k) % 2 else (256, 1024), np.float32)
                a[0, 0] = seed
                assert a[0, 0] == seed
                del a
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not errors
    assert buffers.stats().lent_bytes == 0 and buffers.stats().reused > 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("form", ["plain", "left transposed", "right transposed", "fortran"])
def test_matmul_gives_the_bits_of_the_operator(dtype: type, form: str) -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((300, 400)).astype(dtype)
    b = rng.standard_normal((400, 500)).astype(dtype)
    if form == "left transposed":
        a = np.ascontiguousarray(a.T).T
    elif form == "right transposed":
        b = np.ascontiguousarray(b.T).T
    elif form == "fortran":
        a, b = np.asfortranarray(a), np.asfortranarray(b)
    for _ in range(2):  # the second product lands in a reused block
        out = buffers.matmul(a, b)
        assert np.array_equal(out, a @ b) and out.dtype == dtype
        del out
        gc.collect()
    assert buffers.stats().reused >= 1


def _functional_run(name: str, shape: tuple[int, int], steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    w = rng.standard_normal(shape).astype(np.float32)
    cfg = ar.make_config(name, weight_decay=0.01, update_freq=2)
    state = ar.init(w, cfg)
    seen: list[np.ndarray] = []
    for k in range(steps):
        g = rng.standard_normal(shape).astype(np.float32)
        delta, state = ar.update(state, g, cfg, w)
        w = w + delta
        outputs = [delta, state.M, state.V]  # type: ignore[union-attr]
        # every third step's outputs stay alive (their blocks must not be lent again), the others are copied
        seen += outputs if k % 3 == 0 else [x.copy() for x in outputs]
    return seen


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
@pytest.mark.parametrize("shape", [(256, 512), (1024, 128)])
def test_functional_update_reuses_blocks_and_keeps_its_bits(name: str, shape: tuple[int, int]) -> None:
    """A loop of ``ar.update`` serves its rotation products from blocks of the steps before (the reference's
    other outputs are the backend's own arrays), with the same results as with the pool off."""
    reused = buffers.stats().reused
    pooled = _functional_run(name, shape, 6)
    assert buffers.stats().reused >= reused + 6  # at least one output per step from a reused block
    buffers.set_limit(0)
    plain = _functional_run(name, shape, 6)
    assert all(np.array_equal(x, y) for x, y in zip(pooled, plain, strict=True))
