"""The benchmarks' parameter sets, without numba or threadpoolctl (shared by the CPU bench and ``bench --gpu``).

A LLaMA parameter set comes from :func:`adadiag_ref.memory.llama_parameters`; this module says which of its
matrices AdaDiag rotates (:func:`is_rotated`), in which work frame (:func:`work_shape`), the tiny stand-in
model of ``--quick`` (:data:`QUICK`), the test gradients of the refresh rows
(:func:`gradient_with_spectrum`), the step's coefficients as the core computes them (:func:`coefficients`) and
the peer every AdaDiag timing is compared with, AdaDiag written directly in torch ops
(:func:`torch_direct_adadiag`, on the CPU for ``bench --steady`` and on CUDA for ``bench --gpu``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..memory import LlamaConfig, ParamSpec
from ..optim.schedules import beta_hat

__all__ = [
    "BETAS",
    "EPS",
    "LR",
    "QUICK",
    "adadiag_bytes",
    "adadiag_flops",
    "adamw_bytes",
    "coefficients",
    "gradient_with_spectrum",
    "is_rotated",
    "torch_direct_adadiag",
    "torch_params",
    "work_shape",
]

LR, EPS, BETAS = 1e-3, 1e-8, (0.9, 0.999)
"""The benchmarks' hyperparameters (the paper's Adam defaults, ``lr = 1e-3``)."""

QUICK = LlamaConfig(hidden=64, intermediate=172, layers=2, heads=2, vocab=1000)
"""The tiny LLaMA-shaped model of ``bench --quick`` (a few seconds; a smoke test, not a measurement)."""


def work_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The library's work frame ``(m, n)``, ``m <= n`` (see ``layout_for``)."""
    if len(shape) == 1:
        return 1, shape[0]
    a, b = shape[0], math.prod(shape[1:])
    return (b, a) if a > b else (a, b)


def is_rotated(spec: ParamSpec, rule: str) -> bool:
    """Whether AdaDiag rotates ``spec``: ``rule="paper"`` rotates only the transformer blocks' matrices
    (embedding and LM head take the unrotated baseline, as in the paper's memory table, see
    ``adadiag_ref.memory``); ``rule="all"`` rotates every matrix (the library's own layout)."""
    return work_shape(spec.shape)[0] != 1 and (rule == "all" or spec.role == "block")


def adamw_bytes(specs: list[ParamSpec]) -> int:
    """AdamW's traffic bound for one float32 step: read ``W, G, M, V``, write ``W, M, V`` (7 arrays)."""
    return 7 * 4 * sum(math.prod(s.shape) for s in specs)


def adadiag_flops(specs: list[ParamSpec], rule: str) -> int:
    """AdaDiag's GEMM work for one step: ``G~ = P^T G`` and ``D = P U~``, ``2 m^2 n`` flops each per rotated
    matrix (``rule``: :func:`is_rotated`)."""
    return sum(4 * m * m * n for m, n in (work_shape(s.shape) for s in specs if is_rotated(s, rule)))


def adadiag_bytes(specs: list[ParamSpec], rule: str) -> int:
    """AdaDiag's elementwise traffic bound for one float32 step: 9 arrays per rotated entry (moments: read
    ``G~, M, V``, write ``M, V, U~``; update: read ``W, D``, write ``W``), 7 per unrotated one (AdamW's)."""
    rotated = sum(math.prod(s.shape) for s in specs if is_rotated(s, rule))
    return 4 * (9 * rotated + 7 * (sum(math.prod(s.shape) for s in specs) - rotated))


def gradient_with_spectrum(shape: tuple[int, ...], spectrum: str, rng: np.random.Generator) -> np.ndarray:
    """A float32 test gradient: ``"decaying"``: ``U diag(sigma) V^T`` with ``sigma_i = 1/i`` and random
    orthonormal ``U, V`` (the decaying spectrum of real gradients); ``"flat"``: Gaussian entries (the
    worst case for the Gram route's conditioning is not reached, but it is the slowest SVD)."""
    if spectrum == "flat":
        return rng.standard_normal(shape, dtype=np.float32)
    a, b = shape[0], math.prod(shape[1:])
    k = min(a, b)
    U, _ = np.linalg.qr(rng.standard_normal((a, k)))
    V, _ = np.linalg.qr(rng.standard_normal((b, k)))
    return ((U / np.arange(1, k + 1)) @ V.T).astype(np.float32).reshape(shape)


def coefficients(t: int, betas: tuple[float, float], dtype: Any) -> tuple[Any, Any, Any, Any]:
    """``(b1_hat, 1 - b1_hat, b2_hat, 1 - b2_hat)`` at step ``t`` in ``dtype``, as the core computes them."""
    tt = np.asarray(float(t), dtype=dtype)
    b1 = beta_hat(betas[0], tt, np)
    b2 = beta_hat(betas[1], tt, np)
    one = np.asarray(1.0, dtype=dtype)
    return b1[()], (one - b1)[()], b2[()], (one - b2)[()]


def torch_params(specs: list[ParamSpec], device: Any = "cpu") -> list[Any]:
    """A ``torch.nn.Parameter`` of every shape of ``specs`` on ``device``, with a ``.grad``: Gaussian entries from a
    generator seeded 3 (parameter, then gradient, spec by spec)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(3)
    params = []
    for s in specs:
        p = torch.nn.Parameter(torch.randn(s.shape, generator=gen, device=device))
        p.grad = torch.randn(s.shape, generator=gen, device=device)
        params.append(p)
    return params


def torch_direct_adadiag(specs: list[ParamSpec], rule: str = "paper", device: Any = "cuda") -> Callable[[], None]:
    """AdaDiag's non-refresh step written directly in torch ops on ``device``: the step function.

    Per rotated matrix, in its work frame ``m x n`` with a fixed orthogonal ``P``: ``G~ = P^T G``,
    ``M = b1 M + (1 - b1) G~``, ``V = b2 V + (1 - b2) G~^2`` (``b1, b2`` the bias-corrected beta-hats of the
    core), ``U~ = M / (sqrt(V) + eps)``, ``W -= lr P U~``; the unrotated parameters take AdamW's ops on ``G``.
    Persistent scratch, in place: the yardstick of the CuPy core and the torch adapter on the device."""
    import torch

    gen = torch.Generator(device=device).manual_seed(4)
    mats, vecs = [], []
    for spec in specs:
        m, n = work_shape(spec.shape)
        W, G = torch.randn(m, n, generator=gen, device=device), torch.randn(m, n, generator=gen, device=device)
        state = (W, G, torch.zeros(m, n, device=device), torch.zeros(m, n, device=device))
        if not is_rotated(spec, rule):
            vecs.append(state)
            continue
        P = torch.linalg.qr(torch.randn(m, m, generator=gen, device=device))[0].contiguous()
        mats.append((*state, P, torch.empty(m, n, device=device), torch.empty(m, n, device=device)))
    counter = [0]

    @torch.no_grad()
    def one() -> None:
        counter[0] += 1
        b1, c1, b2, c2 = (float(x) for x in coefficients(counter[0], BETAS, np.float32))
        for W, G, M, V, P, Gt, D in mats:
            torch.mm(P.T, G, out=Gt)
            M.mul_(b1).add_(Gt, alpha=c1)
            V.mul_(b2).addcmul_(Gt, Gt, value=c2)
            torch.sqrt(V, out=Gt).add_(EPS)
            torch.div(M, Gt, out=Gt)
            torch.mm(P, Gt, out=D)
            W.add_(D, alpha=-LR)
        for W, G, M, V in vecs:
            M.mul_(b1).add_(G, alpha=c1)
            V.mul_(b2).addcmul_(G, G, value=c2)
            W.addcdiv_(M, V.sqrt().add_(EPS), value=-LR)

    return one
