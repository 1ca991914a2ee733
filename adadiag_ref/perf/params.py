"""The benchmarks' parameter sets, without numba or threadpoolctl (shared by the CPU bench and ``bench --gpu``).

A LLaMA parameter set comes from :func:`adadiag_ref.memory.llama_parameters`; this module says which of its
matrices AdaDiag rotates (:func:`is_rotated`), in which work frame (:func:`work_shape`), the tiny stand-in
model of ``--quick`` (:data:`QUICK`), and the test gradients of the refresh rows
(:func:`gradient_with_spectrum`).
"""

from __future__ import annotations

import math

import numpy as np

from ..memory import LlamaConfig, ParamSpec

__all__ = ["QUICK", "gradient_with_spectrum", "is_rotated", "work_shape"]

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
    if work_shape(spec.shape)[0] == 1:
        return False
    return rule == "all" or spec.role == "block"


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
