"""The core's block form (``prepare_step``/``update_in_place`` with ``block=`` and ``whole_grad=``), which the torch
adapter's FSDP2 route runs on each rank's shard (``adapters/_sharded.py``).

A tall parameter's rows are whole columns of its work frame; where those columns are not rotated, the step of a
block of rows with the block's layout must equal the whole step restricted to the block.  Tolerance: the block's
``G~ = P^T G`` is a column block of the same product, equal to rounding (float64, rtol 1e-12); a refresh step's
noise floor must use the whole gradient (``whole_grad``), which the gradients here (:func:`_grads`) make decisive.
"""

from __future__ import annotations

import numpy as np
import pytest

import adadiag_ref as ar

SPLITS = [(0, 5), (5, 9), (9, 12)]  # torch.chunk-like, uneven blocks of the 12 rows


def _grads(rng: np.random.Generator, steps: int) -> list[np.ndarray]:
    """Rank-2 rows 0:9 and a last block (rows 9:12) 1e-15 times smaller: its entries of ``G~`` lie under the whole
    step's noise floor (``max(m, n) eps ||G||_F``) but far above a tolerance computed from that block alone."""
    span = rng.standard_normal((9, 2))
    return [np.vstack([span @ rng.standard_normal((2, 5)), 1e-15 * rng.standard_normal((3, 5))]) for _ in range(steps)]


def _block_layout(cfg, lo: int, hi: int) -> ar.Layout:
    whole = ar.layout_for((12, 5), cfg)
    return whole._replace(shape=(hi - lo, 5), cols=hi - lo)


def _run(name: str, *, blocks: bool, use_whole: bool = True, eps: float = 1e-8) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    # AdaDiag++ with max_basis_dim=8: the 12 columns are not rotated (no Q), as on the block route
    cfg = ar.make_config(name, update_freq=2, weight_decay=0.1, max_basis_dim=8, eps=eps)
    w = rng.standard_normal((12, 5))
    state = ar.init(w, cfg)
    grads = _grads(rng, 5)
    moments = [state.M, state.V]
    for count, g in enumerate(grads):
        refreshed = False
        if ar.refresh_due(count, cfg):
            new = ar.refresh_basis(state, g, cfg)
            refreshed, state = new.P is not state.P, new
        if not blocks:
            state = ar.update_in_place(state, g, cfg, w, lr=0.01, refreshed=refreshed)
            continue
        for lo, hi in SPLITS:  # work frame 5 x 12: rows lo:hi of W are columns lo:hi of the moments
            block = state._replace(param_shape=None, M=state.M[:, lo:hi], V=state.V[:, lo:hi])
            ar.update_in_place(block, g[lo:hi], cfg, w[lo:hi], lr=0.01, refreshed=refreshed,
                               block=_block_layout(cfg, lo, hi), whole_grad=g if use_whole else None)  # fmt: skip
        state = state._replace(count=state.count + 1)
    return w, [state.M, state.V] if blocks else moments


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_block_steps_equal_the_whole_step(name):
    w_whole, moments_whole = _run(name, blocks=False)
    w_blocks, moments_blocks = _run(name, blocks=True)
    np.testing.assert_allclose(w_blocks, w_whole, rtol=1e-12, atol=1e-14)
    for got, want in zip(moments_blocks, moments_whole, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_the_noise_floor_needs_the_whole_gradient():
    # without whole_grad each block's tolerance comes from its own rows, so rounding noise of G~ that the whole
    # step zeroes survives; with a tiny eps (1e-30, as the Adafactor family's) Adam's U~ = M / sqrt(V) blows it
    # up to O(1).  With whole_grad the blocks match the whole step.
    w_whole, _ = _run("adadiag", blocks=False, eps=1e-30)
    w_blocks, _ = _run("adadiag", blocks=True, eps=1e-30)
    w_local_floor, _ = _run("adadiag", blocks=True, use_whole=False, eps=1e-30)
    np.testing.assert_allclose(w_blocks, w_whole, rtol=1e-12, atol=1e-14)
    assert np.max(np.abs(w_local_floor - w_whole)) > 1e-4


# ------------------------------------------------------------------------------ uneven shards (FSDP2's torch.chunk)

VOCAB, WIDTH, STEPS, PERIOD = 50, 16, 12, 4  # an embedding (50, 16): tall, its rows are work-frame columns


def _embedding_stream(seed: int, gap: float) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian gradients, and at each refresh a rank-deficient one (six token rows, as a small batch gives) whose
    two largest singular values are ``gap`` apart (relative; 0: as drawn): ``kappa`` of that refresh ~ eps / gap."""
    rng = np.random.default_rng(seed)
    w0, grads = rng.standard_normal((VOCAB, WIDTH)), rng.standard_normal((STEPS, VOCAB, WIDTH))
    for k in range(0, STEPS, PERIOD):
        g = np.zeros((VOCAB, WIDTH))
        for token in rng.integers(0, VOCAB, size=6):
            g[token] += rng.standard_normal(WIDTH)
        if gap:
            u, s, vt = np.linalg.svd(g, full_matrices=False)
            s[1] = s[0] * (1 - gap)
            g = (u * s) @ vt
        grads[k] = g
    return w0, grads


def _torch_run(name: str, w0: np.ndarray, grads: np.ndarray, world: int | None) -> np.ndarray:
    """``W`` after every step: the whole step (``world=None``) or, as ``adapters/_sharded.py``'s block route runs
    it, each of ``world`` row shards (torch.chunk's sizes) on its own contiguous moment blocks, with the bases
    of the whole gradient (one owner decomposes the gathered gradient; the same bits on every rank)."""
    torch = pytest.importorskip("torch")
    cfg = ar.make_config(name, update_freq=PERIOD, weight_decay=0.1)
    w = torch.tensor(w0)
    state = ar.init(w, cfg)
    whole = ar.layout_for(tuple(w.shape), cfg)
    ends = [] if world is None else np.cumsum([len(c) for c in torch.arange(VOCAB).chunk(world)]).tolist()
    bounds = list(zip(([0, *ends])[:-1], ends, strict=True))
    blocks = {lo: (state.M[:, lo:hi].contiguous(), state.V[:, lo:hi].contiguous()) for lo, hi in bounds}
    out = []
    for count, g in enumerate(torch.tensor(grads)):
        refreshed = False
        if ar.refresh_due(count, cfg):
            new = ar.refresh_basis(state, g, cfg)
            refreshed, state = new.P is not state.P, new
        if world is None:
            state = ar.update_in_place(state, g, cfg, w, lr=1e-2, refreshed=refreshed)
        else:
            for lo, hi in bounds:
                shard = state._replace(param_shape=None, M=blocks[lo][0], V=blocks[lo][1])
                layout = whole._replace(shape=(hi - lo, WIDTH), cols=hi - lo)
                ar.update_in_place(shard, g[lo:hi], cfg, w[lo:hi], lr=1e-2, refreshed=refreshed, block=layout,
                                   whole_grad=g)  # fmt: skip
            state = state._replace(count=state.count + 1)
        out.append(w.numpy().copy())
    return np.asarray(out)


@pytest.mark.parametrize("world", [2, 3, 4])  # shards of 25, 17/17/16 and 13/13/13/11 rows
@pytest.mark.parametrize("gap", [0.0, 1e-8])
def test_uneven_shards_equal_the_whole_run_within_the_conditioning_tolerance(world, gap):
    """docs/adapters.md, "Exactness": for the same gradients, a sharded run differs from the single-process run
    only by the rounding of the block GEMM ``P^T G_block`` (a column block of the whole product, summed in
    another order), carried by the step like any rounding: within the golden tolerance widened by the basis
    conditioning (docs/golden.md, ``rtol_t = max(1e-12, kappa_t)``, ``atol_t`` the same times the trajectory's
    scale).  AdamW's block step is entrywise (no GEMM): bit for bit."""
    from adadiag_ref.golden.format import conditioning_rtol
    from adadiag_ref.replay import trajectory_conditioning

    w0, grads = _embedding_stream(world, gap)
    for name in ("adamw", "adadiag"):
        whole, sharded = _torch_run(name, w0, grads, None), _torch_run(name, w0, grads, world)
        if name == "adamw":
            assert np.array_equal(whole, sharded)
            continue
        kappa = trajectory_conditioning(ar.make_config(name, update_freq=PERIOD), grads)
        rtol = np.maximum(1e-12, conditioning_rtol(kappa))  # per step; kappa ~ 2e-8 with gap 1e-8
        scale = max(np.abs(w0).max(), np.abs(whole).max())
        bound = (rtol * scale)[:, None, None] + rtol[:, None, None] * np.abs(whole)
        assert np.all(np.abs(sharded - whole) <= bound), float(np.max(np.abs(sharded - whole)))
