"""Markdown tables of a comparison (docs/reproduction.md is written with them)."""

from __future__ import annotations

import math
import statistics
from typing import Any


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def results_table(result: dict[str, Any], baseline: str = "adamw") -> str:
    """Per optimizer at its selected lr: final validation loss per seed, speed-up (median; per seed), and the
    mean time per step, of the optimizer alone and of the whole step, with the step time relative to AdamW."""
    seeds, selected = result["seeds"], result["selected_lr"]
    chosen = {(r["optimizer"], r["seed"]): r for r in result["runs"] if r["lr"] == selected[r["optimizer"]]}

    def mean(name: str, key: str) -> float:
        return statistics.fmean(chosen[(name, s)][key] for s in seeds)

    head = ["optimizer", "lr", *(f"final val loss, seed {s}" for s in seeds), "speed-up x (per seed)",
            "optimizer ms/step", "step ms", "step time / AdamW's"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in selected:
        per_seed = ", ".join(_fmt(v, ".2f") for v in result["speedup_per_seed"][name])
        ratio = mean(name, "step_ms") / mean(baseline, "step_ms")
        cells = [name, f"{selected[name]:g}", *(_fmt(chosen[(name, s)]["final_val_loss"], ".4f") for s in seeds),
                 f"**{_fmt(result['speedup'][name], '.2f')}** ({per_seed})",
                 _fmt(mean(name, "optimizer_ms_per_step"), ".1f"), _fmt(mean(name, "step_ms"), ".1f"),
                 _fmt(ratio, ".2f")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(result: dict[str, Any]) -> str:
    """Final validation loss of every optimizer at every learning rate of the grid, on the first seed."""
    grid, first = result["lr_grid"], result["seeds"][0]
    final = {(r["optimizer"], r["lr"]): r["final_val_loss"] for r in result["runs"] if r["seed"] == first}
    lines = ["| optimizer | " + " | ".join(f"lr {lr:g}" for lr in grid) + " |", "|---|" + "---|" * len(grid)]
    for name, best in result["selected_lr"].items():
        cells = [_fmt(final.get((name, lr)), ".4f") for lr in grid]
        cells = [f"**{cell}**" if lr == best else cell for cell, lr in zip(cells, grid)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
