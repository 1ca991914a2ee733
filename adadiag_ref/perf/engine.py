"""In-place NumPy engine: the fast embedding path used by ``adadiag-ref bench``.

The public API (:func:`adadiag_ref.update`) is functional and stays the
reference.  A training loop embedding the library on NumPy can instead keep the
state in preallocated buffers and mutate them; this module does that for AdamW
and AdaDiag (non-refresh steps), with exactly the reference math:

AdaDiag, per matrix in its work frame (``m <= n``)::

    Gt  = P^T G                         (BLAS, into a preallocated buffer)
    M, V, Gt <- fused: M = b1 M + (1-b1) Gt, V = b2 V + (1-b2) Gt^2, Gt = M / (sqrt(V) + eps)
    D   = P Gt                          (BLAS, into a preallocated buffer)
    W  <- W - lr (D + wd W)             (fused, in place)

AdamW keeps all parameters in one flat buffer and updates them in a single
fused, parallel pass (no BLAS runs in the step, so the numba pool does not
compete with OpenBLAS).  ``b1, b2`` are the paper's bias-corrected beta-hats.

Thread policy: the GEMMs of a phase run on ``gemm_threads`` Python threads
(every core by default), each calling BLAS single-threaded on its share of the
matrices (balanced by flops); the AdaDiag elementwise kernels and AdamW's flat
pass use a numba pool (threading layer ``workqueue``, which does not spin)
between the GEMM phases.  OpenBLAS's own worker threads spin for about 0.1 s
(2^28 cycles) after every multi-threaded call, and on a machine with few cores
they take a core from the numba pass that follows (a 16.4M-entry AdamW pass:
27 ms after a pause, 38 ms right after a GEMM); with BLAS single-threaded in
the step they are never woken.  ``gemm_threads=1`` is the plain sequence of
multi-threaded BLAS calls.  (``parallel_elementwise=False``: serial
elementwise kernels, measured slower on the 2-core VM, docs/performance.md.)
scipy's separate OpenBLAS is never called in a step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from .. import _kernels
from ..memory import ParamSpec
from ..optim.blas_threads import balanced
from ..optim.families.adam import numba_route as adam_kernels
from .params import coefficients, is_rotated, work_shape

__all__ = ["AdaDiagEngine", "AdamWEngine", "balanced_groups", "coefficients", "is_rotated", "work_shape"]


class AdamWEngine:
    """AdamW over all parameters in one flat float32 buffer (W, G, M, V)."""

    def __init__(self, specs: list[ParamSpec], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, wd: float = 0.0, parallel: bool = True, seed: int = 0) -> None:  # fmt: skip
        size = sum(math.prod(s.shape) for s in specs)
        rng = np.random.default_rng(seed)
        self.W = rng.standard_normal(size, dtype=np.float32)
        self.G = rng.standard_normal(size, dtype=np.float32)
        self.M = np.zeros(size, dtype=np.float32)
        self.V = np.zeros(size, dtype=np.float32)
        self.lr, self.betas, self.eps, self.wd, self.t = lr, betas, eps, wd, 0
        self.kernel = adam_kernels.adamw_inplace_parallel if parallel else adam_kernels.adamw_inplace
        self.size = size

    def step(self) -> None:
        self.t += 1
        b1, c1, b2, c2 = coefficients(self.t, self.betas, np.float32)
        f = np.float32
        self.kernel(self.W, self.G, self.M, self.V, b1, c1, b2, c2, f(self.eps), f(self.lr), f(self.wd))

    def bytes_moved(self) -> int:
        """Lower bound of the traffic of one step: read W, G, M, V and write W, M, V (float32)."""
        return 7 * 4 * self.size


def balanced_groups(items: list[dict[str, np.ndarray]], k: int) -> list[list[dict[str, np.ndarray]]]:
    """The matrices in ``k`` groups of near-equal GEMM work (``m^2 n`` each): largest first, to the lightest group
    (:func:`adadiag_ref.optim.blas_threads.balanced`, which the core engine's GEMM phases use too)."""
    return balanced(items, lambda it: float(it["P"].shape[0] ** 2 * it["G"].shape[1]), k)


class AdaDiagEngine:
    """AdaDiag (one-sided) with preallocated buffers; unrotated parameters take the AdamW kernel.

    Each kind of array (``M, V, G~, W, D`` of the rotated matrices; ``W, G, M, V`` of the unrotated
    parameters) lives in one flat buffer, and every matrix is a view into it.  A step runs in phases: every
    ``G~ = P^T G`` GEMM, one elementwise moments pass over all matrices, every ``D = P U~`` GEMM, one update
    pass.  Two kernel launches instead of two per matrix: on LLaMA-60M's 56 matrices the per-launch cost of
    numba's pool was measurable (the update pass at 2x its bandwidth bound when launched per matrix).
    """

    def __init__(self, specs: list[ParamSpec], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, wd: float = 0.0, seed: int = 0, rule: str = "paper",
                 parallel_unrotated: bool = True, parallel_elementwise: bool = True,
                 gemm_threads: int | None = None) -> None:  # fmt: skip
        rng = np.random.default_rng(seed)
        self.unrotated_kernel = (
            adam_kernels.adamw_inplace_parallel if parallel_unrotated else adam_kernels.adamw_inplace
        )
        self.set_parallel_elementwise(parallel_elementwise)
        shapes = [(spec, work_shape(spec.shape)) for spec in specs]
        rotated = [(m, n) for spec, (m, n) in shapes if is_rotated(spec, rule)]
        unrotated = [m * n for spec, (m, n) in shapes if not is_rotated(spec, rule)]
        total = sum(m * n for m, n in rotated)
        self.flat = {k: np.empty(total, np.float32) for k in ("W", "G", "M", "V", "Gt", "D")}
        self.flat["M"][:] = 0.0
        self.flat["V"][:] = 0.0
        self.items: list[dict[str, np.ndarray]] = []
        offset = 0
        for spec, (m, n) in shapes:
            if not is_rotated(spec, rule):
                continue
            P, _ = np.linalg.qr(rng.standard_normal((m, m)).astype(np.float32))
            item = {k: buf[offset : offset + m * n].reshape(m, n) for k, buf in self.flat.items()}
            item["W"][:] = rng.standard_normal((m, n), dtype=np.float32)
            item["G"][:] = rng.standard_normal((m, n), dtype=np.float32)
            item["P"] = np.ascontiguousarray(P)
            self.items.append(item)
            offset += m * n
        size = sum(unrotated)
        self.vectors: list[tuple[np.ndarray, ...]] = []
        if size:
            # W, G random and M, V zero, one buffer each: the unrotated update is one pass over all of them
            w, g = (rng.standard_normal(size, dtype=np.float32) for _ in range(2))
            self.vectors.append((w, g, np.zeros(size, np.float32), np.zeros(size, np.float32)))
        self.lr, self.betas, self.eps, self.wd, self.t = lr, betas, eps, wd, 0
        threads = max(1, min((os.cpu_count() or 1) if gemm_threads is None else gemm_threads, len(self.items)))
        self.gemm_groups = balanced_groups(self.items, threads)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="engine-gemm") if threads > 1 else None
        self._blas = ThreadpoolController().select(user_api="blas") if threads > 1 else None

    def _gemm_phase(self, gemm: Callable[[dict[str, np.ndarray]], Any]) -> None:
        """``gemm`` on every matrix: each group on its own thread (BLAS single-threaded there), or in sequence."""

        def run(group: list[dict[str, np.ndarray]]) -> None:
            for it in group:
                gemm(it)

        if self._executor is None:
            run(self.items)
        else:
            for _ in self._executor.map(run, self.gemm_groups):  # re-raises a thread's exception here
                pass

    def set_parallel_elementwise(self, parallel: bool) -> None:
        """Run the moments and update passes between GEMMs on numba's pool (True) or on one thread."""
        self.moments_kernel = (
            adam_kernels.adam_moments_own_flat_parallel if parallel else adam_kernels.adam_moments_own_flat
        )
        self.update_kernel = _kernels.apply_update_inplace_parallel if parallel else _kernels.apply_update_inplace

    def step(self, *, elementwise: bool = True, gemm: bool = True) -> None:
        if gemm and self._blas is not None:
            with self._blas.limit(limits=1):  # one BLAS thread per GEMM thread; restored after the step
                self._step(elementwise, gemm)
        else:
            self._step(elementwise, gemm)

    def _step(self, elementwise: bool, gemm: bool) -> None:
        self.t += 1
        b1, c1, b2, c2 = coefficients(self.t, self.betas, np.float32)
        f = np.float32
        eps, lr, wd = f(self.eps), f(self.lr), f(self.wd)
        flat = self.flat
        if elementwise:
            for W, G, M, V in self.vectors:
                self.unrotated_kernel(W, G, M, V, b1, c1, b2, c2, eps, lr, wd)
        if gemm:
            self._gemm_phase(lambda it: np.matmul(it["P"].T, it["G"], out=it["Gt"]))
        if elementwise and self.items:  # flat buffers, one argument per array: the loops vectorise (see _kernels)
            self.moments_kernel(flat["M"], flat["V"], flat["Gt"], b1, c1, b2, c2, eps)
        if gemm:
            self._gemm_phase(lambda it: np.matmul(it["P"], it["Gt"], out=it["D"]))
        if elementwise and self.items:
            self.update_kernel(flat["W"], flat["D"], lr, wd)

    def flops(self) -> int:
        """Two ``m x m`` by ``m x n`` GEMMs per matrix."""
        return sum(4 * it["P"].shape[0] ** 2 * it["G"].shape[1] for it in self.items)

    def bytes_moved(self) -> int:
        """Elementwise lower bound: moments (read G~, M, V; write M, V, U) + update (read W, D; write W)."""
        mats = self.flat["G"].size
        vecs = sum(v[0].size for v in self.vectors)
        return 4 * (9 * mats + 7 * vecs)

    def close(self) -> None:
        """Drop every buffer (the memory of a large model) and stop the GEMM threads."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        self.gemm_groups = []
        self.items.clear()
        self.vectors.clear()
        self.flat.clear()
