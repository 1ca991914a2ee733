"""Steps-to-target and the speed-up over AdamW.

Speed-up of optimizer X on seed s (the paper's "reaches Adam's loss in k times fewer steps"):

    L* = AdamW's final validation loss,   speedup_s = steps_AdamW(L*) / steps_X(L*),

where ``steps(L*)`` is the first time the validation curve reaches ``L*``: the curve is linear between
evaluations, so it is the step where the first segment ``(s_{i-1}, l_{i-1}) -> (s_i, l_i)`` with ``l_i <= L*``
crosses ``L*``.  ``steps_AdamW(L*)`` is at most AdamW's last step (earlier when its curve dips below its final
loss before the end).  A curve that never reaches ``L*`` has no crossing: its speed-up is ``None``, and the
median over seeds is ``None`` unless every seed has a value (the optimizer did not match AdamW within the
budget; ``steps_AdamW(L*) / last step`` is then an upper bound of that seed's speed-up).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def steps_to_reach(steps: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """First step at which the piecewise-linear curve ``(steps, losses)`` is ``<= target``, or ``None``."""
    if len(steps) != len(losses) or not steps:
        raise ValueError(f"need matching, non-empty steps and losses (got {len(steps)} and {len(losses)})")
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return float(steps[0])
            prev = losses[i - 1]
            return steps[i - 1] + (prev - target) / (prev - loss) * (steps[i] - steps[i - 1])
    return None


def seed_speedup(
    base_steps: Sequence[float], base_losses: Sequence[float], steps: Sequence[float], losses: Sequence[float]
) -> float | None:
    """``steps_base(L*) / steps_X(L*)`` with ``L*`` the baseline's final loss; ``None`` if X never reaches it."""
    target = base_losses[-1]
    base = steps_to_reach(base_steps, base_losses, target)
    mine = steps_to_reach(steps, losses, target)
    assert base is not None  # the baseline's own last point reaches its final loss
    if mine is None:
        return None
    return base / mine if mine > 0 else float("inf")


def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median of the values, or ``None`` when there are none or any is ``None``."""
    if not values or any(v is None for v in values):
        return None
    return float(statistics.median(v for v in values if v is not None))
