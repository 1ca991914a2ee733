"""One training run through the torch adapter, and the tuned comparison of several optimizers.

Protocol (``compare``): every optimizer, AdamW included, is tuned over the same learning-rate grid on the first
seed (lowest final validation loss wins); the other seeds then run at the selected rate.  All runs of a seed
see the same initial weights and the same minibatches, so the curves of one seed differ only by the optimizer.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from adadiag_ref._cli import bar_disable
from adadiag_ref.adapters import pytorch as torch_adapter

from . import data
from .metrics import median_or_none, seed_speedup
from .model import CharLM, CharLMConfig, DigitsCNN
from .schedule import make_scheduler

OPTIMIZER_CLASSES = torch_adapter.OPTIMIZER_CLASSES
"""The torch adapter's class of every registered optimizer, by name (the adapter builds it from the registry)."""
DEFAULT_OPTIMIZERS = ("adamw", "adadiag", "adadiag_pp", "adafacdiag", "hfacdiag")
BASELINE = "adamw"


@dataclass(frozen=True)
class RunConfig:
    """Everything a run depends on besides the optimizer, learning rate and seed."""

    task: str
    steps: int
    batch: int
    eval_points: int = 25  # evaluations after step 0 (evenly spaced, the last at the final step)
    update_freq: int | None = None  # basis refresh period T; None: about 50 refreshes per run (the paper's 60M)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    model: CharLMConfig | None = None  # charlm only
    eval_windows: int = 64  # charlm: validation windows
    device: str = "cpu"  # where the model, batches and optimizer states live ("cpu" or "cuda")

    def refresh_period(self) -> int:
        """T: ``update_freq``, or ``max(1, steps // 50)``, the paper's 10K steps / T = 200 ratio."""
        return self.update_freq if self.update_freq is not None else max(1, self.steps // 50)

    def eval_steps(self) -> list[int]:
        """0 (the initial model), then ``eval_points`` evenly spaced steps ending at ``steps``."""
        points = min(self.eval_points, self.steps)
        return [0, *sorted({round(self.steps * (i + 1) / points) for i in range(points)})]


def deterministic(device: str) -> bool:
    """Whether runs on ``device`` use ``torch.use_deterministic_algorithms(True)``: on the CPU (bit-reproducible
    runs); not on CUDA, where cuBLAS and cross-entropy's kernels would raise without ``CUBLAS_WORKSPACE_CONFIG``
    (an environment variable the library does not set)."""
    return device == "cpu"


def _sync(device: str) -> None:
    """Wait for the device's queued work (CUDA), so that a host clock measures it; nothing on the CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


class Task(NamedTuple):
    """A model factory, a minibatch sampler and the validation loss, for one data set."""

    make_model: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    val_loss: Callable[[nn.Module], float]
    info: dict[str, Any]


def _charlm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy (nats)."""
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _digits_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean classification cross-entropy (nats)."""
    return F.cross_entropy(model(x), y)


def build_task(cfg: RunConfig) -> Task:
    """Load the data of ``cfg.task`` once; the returned closures are shared by all runs.

    The minibatches are drawn on the host (the same batches on every device) and moved to ``cfg.device``; the
    validation data lives there."""
    device = torch.device(cfg.device)
    if cfg.task == "charlm":
        model_cfg = cfg.model or CharLMConfig(vocab=len(data.VOCAB))
        corpus = data.load_corpus()
        val = data.fixed_windows(corpus.val, cfg.eval_windows, model_cfg.context).to(device)

        def charlm_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            w = data.random_windows(corpus.train, cfg.batch, model_cfg.context, gen).to(device)
            return w[:, :-1], w[:, 1:]

        info = {
            "model": {**model_cfg.__dict__},
            "corpus": {"files": list(corpus.files), "sha256": corpus.sha256, "train_chars": len(corpus.train),
                       "val_chars": len(corpus.val), "vocab": len(data.VOCAB)},
        }  # fmt: skip
        return Task(
            lambda: CharLM(model_cfg).to(device),
            charlm_batch,
            _charlm_loss,
            lambda model: _eval(model, _charlm_loss, val[:, :-1], val[:, 1:]),
            info,
        )
    if cfg.task == "digits":
        digits = data.load_digits_split()

        def digits_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            idx = torch.randint(0, len(digits.train_y), (cfg.batch,), generator=gen)
            return digits.train_x[idx].to(device), digits.train_y[idx].to(device)

        info = {"data": {"train": len(digits.train_y), "val": len(digits.val_y)}}
        val_x, val_y = digits.val_x.to(device), digits.val_y.to(device)
        return Task(
            lambda: DigitsCNN().to(device),
            digits_batch,
            _digits_loss,
            lambda model: _eval(model, _digits_loss, val_x, val_y),
            info,
        )
    raise ValueError(f"unknown task {cfg.task!r}; choose charlm or digits")


@torch.no_grad()
def _eval(model: nn.Module, loss: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    value = float(loss(model, x, y))
    model.train()
    return value


def make_optimizers(model: nn.Module, name: str, lr: float, cfg: RunConfig) -> list[torch.optim.Optimizer]:
    """``name`` for ``model.rotated_parameters()``; AdamW with the same hyperparameters for the rest.

    The rest (embedding, LM head, RMSNorm gains, biases) is what the paper trains with the unrotated baseline.
    """
    rotated = list(model.rotated_parameters())  # type: ignore[operator]
    ids = {id(p) for p in rotated}
    others = [p for p in model.parameters() if id(p) not in ids]
    common: dict[str, Any] = {"lr": lr, "betas": cfg.betas, "weight_decay": cfg.weight_decay}
    if name == BASELINE:
        return [OPTIMIZER_CLASSES[BASELINE]([*rotated, *others], **common)]
    return [
        OPTIMIZER_CLASSES[name](rotated, update_freq=cfg.refresh_period(), **common),
        OPTIMIZER_CLASSES[BASELINE](others, **common),
    ]


def train_run(
    task: Task, cfg: RunConfig, name: str, lr: float, seed: int, progress: bool | None = None
) -> dict[str, Any]:
    """Train a fresh model for ``cfg.steps`` steps under the paper's schedule (peak ``lr``) and return the run.

    The model's initial weights come from ``torch.manual_seed(seed)``, the minibatches from a generator seeded
    with ``seed``.  Times are means over all steps (refresh steps included).  ``progress``: a bar on stderr
    (``None``: only when stderr is a terminal)."""
    torch.manual_seed(seed)
    model = task.make_model()
    optimizers = make_optimizers(model, name, lr, cfg)
    schedulers = [make_scheduler(opt, cfg.steps) for opt in optimizers]
    gen = torch.Generator().manual_seed(seed)
    eval_at = set(cfg.eval_steps())
    eval_steps, val_loss = [0], [task.val_loss(model)]
    opt_seconds = step_seconds = 0.0
    done = 0
    bar = tqdm(range(1, cfg.steps + 1), desc=f"{name} lr={lr:g} seed={seed}", leave=False, file=sys.stderr,
               disable=bar_disable(progress))  # fmt: skip
    for step in bar:
        _sync(cfg.device)
        start = time.perf_counter()
        x, y = task.batch(gen)
        loss = task.loss(model, x, y)
        if not math.isfinite(loss.item()):
            break  # diverged: the curve ends here, the run has no final loss and cannot win the sweep
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        _sync(cfg.device)
        opt_start = time.perf_counter()
        for opt in optimizers:
            opt.step()
        _sync(cfg.device)
        opt_seconds += time.perf_counter() - opt_start
        for scheduler in schedulers:
            scheduler.step()
        _sync(cfg.device)
        step_seconds += time.perf_counter() - start
        done = step
        if step in eval_at:
            eval_steps.append(step)
            val_loss.append(task.val_loss(model))
            bar.set_postfix(val_loss=f"{val_loss[-1]:.4f}")
    final = val_loss[-1] if eval_steps[-1] == cfg.steps else float("nan")
    return {
        "optimizer": name,
        "lr": lr,
        "seed": seed,
        "steps": cfg.steps,
        "eval_steps": eval_steps,
        "val_loss": val_loss,
        "final_val_loss": final,
        "optimizer_ms_per_step": 1e3 * opt_seconds / max(1, done),
        "step_ms": 1e3 * step_seconds / max(1, done),
    }


def _score(run: dict[str, Any]) -> float:
    """Sweep criterion: the final validation loss; a diverged run (NaN) loses to every finite one."""
    loss = run["final_val_loss"]
    return loss if math.isfinite(loss) else math.inf


_WORKER: dict[str, Any] = {}


def _init_worker(cfg: RunConfig, threads: int) -> None:
    """A worker process: same thread and determinism settings as the parent, its own copy of the task."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic(cfg.device))
    _WORKER["cfg"], _WORKER["task"] = cfg, build_task(cfg)


def _worker_run(name: str, lr: float, seed: int) -> dict[str, Any]:
    return train_run(_WORKER["task"], _WORKER["cfg"], name, lr, seed, progress=False)


def _run_all(
    specs: Sequence[tuple[str, float, int]], cfg: RunConfig, task: Task, pool: ProcessPoolExecutor | None, bar: tqdm
) -> list[dict[str, Any]]:
    """The runs ``(optimizer, lr, seed)``, in order: here, or in ``pool``'s worker processes."""
    if pool is None:
        out = []
        for name, lr, seed in specs:
            out.append(train_run(task, cfg, name, lr, seed, progress=not bar.disable))
            bar.update()
        return out
    futures = [pool.submit(_worker_run, *spec) for spec in specs]
    for future in as_completed(futures):
        bar.update()
        bar.set_postfix_str(f"{future.result()['optimizer']} done")
    return [future.result() for future in futures]


def _pool(cfg: RunConfig, jobs: int) -> ProcessPoolExecutor | contextlib.nullcontext[None]:
    """``jobs`` spawned worker processes (fork would copy torch's thread pools), or nothing for ``jobs == 1``."""
    if jobs == 1:
        return contextlib.nullcontext()
    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(jobs, context, _init_worker, (cfg, torch.get_num_threads()))


def compare(
    cfg: RunConfig,
    optimizers: Sequence[str],
    seeds: Sequence[int],
    lr_grid: Sequence[float],
    progress: bool | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """Tune every optimizer's lr on ``seeds[0]``, run the other seeds at the selected lr, compute the speed-ups.

    Returns the JSON document: ``task``, ``runs`` (every run, the sweep included), ``selected_lr``,
    ``speedup`` (``metrics`` module: median over seeds, ``None`` when a seed never reaches AdamW's final
    loss), ``speedup_per_seed`` and the task's ``info``.  ``jobs`` processes run in parallel (each with this
    process's torch thread count); the numbers do not depend on ``jobs``, the times do.  ``progress``: bars on
    stderr (``None``: only when stderr is a terminal, so a redirected stderr receives none)."""
    unknown = [name for name in optimizers if name not in OPTIMIZER_CLASSES]
    if unknown or not optimizers:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {', '.join(OPTIMIZER_CLASSES)}")
    if not seeds or not lr_grid or min(lr_grid) <= 0 or jobs < 1:
        raise ValueError("need at least one seed, a grid of positive learning rates and jobs >= 1")
    names = list(dict.fromkeys([BASELINE, *optimizers]))  # the baseline is always run: it defines the speed-up
    task = build_task(cfg)  # also its info; workers build their own copy
    total = len(names) * (len(lr_grid) + len(seeds) - 1)
    bar = tqdm(total=total, desc=f"{cfg.task}: runs", file=sys.stderr, disable=bar_disable(progress))
    with bar, _pool(cfg, jobs) as pool:
        sweep = _run_all([(name, lr, seeds[0]) for name in names for lr in lr_grid], cfg, task, pool, bar)
        selected = {name: min((r for r in sweep if r["optimizer"] == name), key=_score)["lr"] for name in names}
        rest = _run_all([(name, selected[name], seed) for name in names for seed in seeds[1:]], cfg, task, pool, bar)
    runs = sorted(sweep + rest, key=lambda r: (names.index(r["optimizer"]), seeds.index(r["seed"]), -r["lr"]))
    chosen = {(r["optimizer"], r["seed"]): r for r in runs if r["lr"] == selected[r["optimizer"]]}

    def speedup(name: str, seed: int) -> float | None:  # None where the baseline itself diverged
        base, mine = chosen[(BASELINE, seed)], chosen[(name, seed)]
        if not math.isfinite(base["final_val_loss"]):
            return None
        return seed_speedup(base["eval_steps"], base["val_loss"], mine["eval_steps"], mine["val_loss"])

    per_seed = {name: [speedup(name, seed) for seed in seeds] for name in names}
    return {
        "task": cfg.task,
        "runs": runs,
        "speedup": {name: median_or_none(values) for name, values in per_seed.items()},
        "speedup_per_seed": per_seed,
        "selected_lr": selected,
        "lr_grid": list(lr_grid),
        "seeds": list(seeds),
        "steps": cfg.steps,
        "update_freq": cfg.refresh_period(),
        "batch": cfg.batch,
        "weight_decay": cfg.weight_decay,
        "betas": list(cfg.betas),
        "jobs": jobs,
        "device": cfg.device,
        **task.info,
    }
