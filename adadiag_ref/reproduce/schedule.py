"""The paper's learning-rate schedule: linear warmup over the first 10% of the steps, then cosine to 10%."""

from __future__ import annotations

import math

import torch

WARMUP_FRACTION = 0.1
FINAL_FRACTION = 0.1


def warmup_steps(total: int) -> int:
    """``ceil(0.1 * total)`` warmup steps (at least one)."""
    return max(1, math.ceil(WARMUP_FRACTION * total))


def lr_factor(step: int, total: int) -> float:
    """Multiplier of the peak learning rate for the update with 0-based index ``step`` out of ``total``.

    Warmup ``(step + 1) / W`` for ``step < W``; then ``f + (1 - f) (1 + cos(pi p)) / 2`` with
    ``p = (step - W) / (total - 1 - W)`` and ``f = 0.1``, so the first update after warmup uses the peak and the
    last one exactly 10% of it."""
    warm = warmup_steps(total)
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - 1 - warm))
    return FINAL_FRACTION + (1 - FINAL_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` applying :func:`lr_factor`; call ``scheduler.step()`` after each ``optimizer.step()``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total))
