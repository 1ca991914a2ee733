"""Validation-loss curves of a comparison (the runs at each optimizer's selected learning rate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._cli import pyplot


def plot_comparison(result: dict[str, Any], path: str | Path) -> None:
    """One line per optimizer and seed (same colour per optimizer), validation loss against step."""
    plt = pyplot()
    selected = result["selected_lr"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours: dict[str, Any] = {}
    for run in result["runs"]:
        name = run["optimizer"]
        if run["lr"] != selected[name]:
            continue
        colour = colours.setdefault(name, f"C{len(colours)}")
        speedup = result["speedup"].get(name)
        label = f"{name} (lr {run['lr']:g}" + (f", speed-up {speedup:.2f}x)" if speedup is not None else ")")
        ax.plot(run["eval_steps"], run["val_loss"], color=colour, alpha=0.85,
                linestyle="-" if run["seed"] == result["seeds"][0] else "--",
                label=label if run["seed"] == result["seeds"][0] else None)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats)")
    finals = [r["final_val_loss"] for r in result["runs"] if r["final_val_loss"] == r["final_val_loss"]]
    if finals:  # zoom on the end of training, where the optimizers differ
        low = min(finals)
        ax.set_ylim(low - 0.05 * abs(low), low + 1.5 * (max(finals) - low) + 0.5)
    ax.set_title(f"{result['task']}: validation loss (solid: seed {result['seeds'][0]}, dashed: other seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
