"""Measure how far correct implementations drift apart on ill-conditioned refreshes, against the tolerance
of the basis conditioning (docs/golden.md, "Tolerances": ``max(rtol, CONDITIONING_FACTOR * kappa_t)``).

Every optimizer runs the same gradient stream on NumPy (the core), torch (the core on torch tensors, float64)
and JAX (the optax alias under ``jax.jit``, float64).  The refresh gradients (t = 1, 5, 9 of 12, T = 4) have a
chosen spectrum: ``random`` (Gaussian), ``clustered`` (``2, 2, 1, 1/2, ...``) or ``gap=g`` (``1, 1 - g, 1/2,
1/4, ...``), with random orthogonal singular vectors.  For each step ``t`` it records the largest difference
from NumPy on the trajectory's scale (``max |W_b - W_np| / max |W|``), and the same for the bases ``P``, ``Q``
(entries are O(1)) and the moments (on each field's own scale), and divides it by ``kappa_t``
(:func:`adadiag_ref.replay.trajectory_conditioning`).

    python benchmarks/conditioning_tolerance.py [--seeds 5] [--shape 6 10] [--dtype float32] [--lr 0.1]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import adadiag_ref as ar
from adadiag_ref.golden.format import CONDITIONING_FACTOR, api_options, config_to_dict
from adadiag_ref.golden.generator import TOLERANCES
from adadiag_ref.replay import trajectory_conditioning

STEPS, PERIOD = 12, 4
KINDS = ("random", "clustered", "gap=1e-4", "gap=1e-6", "gap=1e-8", "gap=1e-10", "gap=1e-12")


def _orthogonal(rng: np.random.Generator, size: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((size, size)))
    return q * np.sign(np.diag(r))[None, :]


def spectrum_gradient(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A gradient whose singular values follow ``kind`` (random orthogonal singular vectors)."""
    m, n = shape
    k = min(m, n)
    if kind == "random":
        return rng.standard_normal(shape)
    tail = [2.0 ** (-i) for i in range(1, k)]
    if kind == "clustered":
        s = np.array([2.0, 2.0, *[2 * v for v in tail]])[:k]
    else:
        gap = float(kind.split("=")[1])
        s = np.array([1.0, 1.0 - gap, *tail])[:k]
    U, V = _orthogonal(rng, m)[:, :k], _orthogonal(rng, n)[:, :k]
    return (U * s[None, :]) @ V.T  # type: ignore[no-any-return]


def stream(kind: str, shape: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(shape)
    grads = rng.standard_normal((STEPS, *shape))
    for t in range(1, STEPS + 1, PERIOD):
        grads[t - 1] = spectrum_gradient(kind, shape, rng)
    return w0, grads


FIELDS = ("P", "Q", "M", "V", "r", "s", "u", "v")


def run_core(cfg: Any, w0: Any, grads: Any, to_host: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    state, w = ar.init(w0, cfg), w0
    params, states = [], {}
    for k in range(grads.shape[0]):
        w, state = ar.step(state, grads[k], cfg, w)
        params.append(to_host(w))
        for name in FIELDS:
            value = getattr(state, name, None)
            if value is not None:
                states.setdefault(name, []).append(to_host(value))
    return np.stack(params), {k: np.stack(v) for k, v in states.items()}


class JaxRunner:
    """One jitted optax alias per optimizer, reused across streams (one compile)."""

    def __init__(self, name: str, cfg: Any) -> None:
        import jax

        jax.config.update("jax_enable_x64", True)
        from adadiag_ref.adapters import optax as ax

        self.ax = ax
        self.tx = getattr(ax, name)(**api_options(config_to_dict(cfg), "optax"))
        self.update = jax.jit(self.tx.update)

    def __call__(self, w0: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        import jax.numpy as jnp
        import optax

        params = jnp.asarray(w0)
        state = self.tx.init(params)
        out, states = [], {}
        for k in range(grads.shape[0]):
            updates, state = self.update(jnp.asarray(grads[k]), state, params)
            params = optax.apply_updates(params, updates)
            out.append(np.asarray(params))
            inner = next(s for s in state if isinstance(s, self.ax.CoreTransformState))
            core = self.ax.core_states(inner, params)
            for name in FIELDS:
                value = getattr(core, name, None)
                if value is not None and np.size(value):
                    states.setdefault(name, []).append(np.asarray(value))
        return np.stack(out), {k: np.stack(v) for k, v in states.items()}


def differences(ref: tuple[np.ndarray, dict], other: tuple[np.ndarray, dict], w0: np.ndarray) -> dict[str, np.ndarray]:
    """Per step: the parameter's difference on the trajectory's scale, each state field's on its own scale."""
    params, states = ref
    scale = max(float(np.max(np.abs(w0))), float(np.max(np.abs(params))))
    out = {"W": np.max(np.abs(other[0] - params).reshape(STEPS, -1), axis=1) / scale}
    for name, want in states.items():
        got = other[1].get(name)
        if got is None or got.shape != want.shape:
            continue
        size = np.maximum(np.max(np.abs(want).reshape(STEPS, -1), axis=1), 1e-300)
        out[name] = np.max(np.abs(got - want).reshape(STEPS, -1), axis=1) / size
    return out


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--shape", type=int, nargs=2, default=(6, 10))
    parser.add_argument("--optimizers", default=",".join(ar.OPTIMIZERS))
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args()
    shape = tuple(args.shape)
    golden = TOLERANCES[args.dtype]
    started = time.perf_counter()
    print(f"shape {shape}, {args.seeds} seeds, K = {STEPS}, T = {PERIOD}, lr = {args.lr:g}; {args.dtype}; "
          f"tolerance max({golden.rtol:g}, {CONDITIONING_FACTOR:g} kappa)")  # fmt: skip
    print(f"{'optimizer':14s} {'spectrum':10s} {'kappa max':>10s} {'W diff max':>11s} {'W diff/kappa':>12s} "
          f"{'state diff/kappa':>16s} {'W diff/tol':>10s} {'golden x':>9s}")  # fmt: skip
    worst = {"W": 0.0, "state": 0.0, "tol": 0.0}
    for name in args.optimizers.split(","):
        cfg = ar.make_config(name, lr=args.lr, weight_decay=0.1, update_freq=PERIOD, kernels="reference")
        jax_run = JaxRunner(name, cfg)
        for kind in args.kinds.split(","):
            row = {"kappa": 0.0, "W": 0.0, "W/k": 0.0, "S/k": 0.0, "tol": 0.0, "golden": 0.0}
            for seed in range(args.seeds):
                w0, grads = (a.astype(args.dtype) for a in stream(kind, shape, 7000 + seed))
                kappa = trajectory_conditioning(cfg, grads)
                ref = run_core(cfg, w0, grads, np.asarray)
                runs = [
                    run_core(cfg, torch.from_numpy(w0), torch.from_numpy(grads), lambda x: x.numpy().copy()),
                    jax_run(w0, grads),
                ]
                tol = np.maximum(golden.rtol, CONDITIONING_FACTOR * kappa)
                for other in runs:
                    diff = differences(ref, other, w0)
                    positive = np.maximum(kappa, 1e-300)
                    row["kappa"] = max(row["kappa"], float(np.max(kappa)))
                    row["W"] = max(row["W"], float(np.max(diff["W"])))
                    row["W/k"] = max(row["W/k"], float(np.max(diff["W"] / positive)) if np.any(kappa) else 0.0)
                    states = [v for k, v in diff.items() if k != "W"]
                    if states and np.any(kappa):
                        row["S/k"] = max(row["S/k"], max(float(np.max(v / positive)) for v in states))
                    # the parameter check of compare: |x - y| <= atol + rtol |y|, atol = rtol * scale
                    row["tol"] = max(row["tol"], float(np.max(diff["W"] / tol)))
                    row["golden"] = max(row["golden"], float(np.max(diff["W"] / golden.rtol)))
            worst["W"] = max(worst["W"], row["W/k"])
            worst["state"] = max(worst["state"], row["S/k"])
            worst["tol"] = max(worst["tol"], row["tol"])
            print(f"{name:14s} {kind:10s} {row['kappa']:10.2e} {row['W']:11.2e} {row['W/k']:12.3g} "
                  f"{row['S/k']:16.3g} {row['tol']:10.3g} {row['golden']:9.3g}")  # fmt: skip
    print(f"largest W diff / kappa {worst['W']:.3g}, state diff / kappa {worst['state']:.3g}, "
          f"W diff / tolerance {worst['tol']:.3g}; {time.perf_counter() - started:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
