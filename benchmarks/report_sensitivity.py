"""How much each optimizer amplifies rounding on the report's problem, and why AdafacDiag++ most of all.

The report (``adadiag-ref report``) runs every optimizer on ``0.5 ||A W B - C||^2`` (16 x 24, cond 100, float64,
T = 20) on every backend.  Backends round differently; whether that shows depends on the optimizer.  This script
measures, for every optimizer, with ``adadiag_ref.report.sensitivity`` (NumPy against NumPy with ``W_1`` changed
by ``delta Z``, ``Z`` standard normal):

* ``growth/step``: the finite-time growth factor of the parameter deviation for ``delta = 1e-10`` (above the
  rounding floor, in the linear regime), fitted over steps 1..200 or until the deviation exceeds 1e-4;
* for ``delta = 1e-15`` (the report's :data:`~adadiag_ref.report.PERTURBATION`): the largest relative loss drift
  over 200 steps, the first step at which it exceeds the report's tolerance 1e-10, and the first step at which
  the parameter drift exceeds 1e-8 (within ``--long`` steps);
* (unless ``--no-backends``) the largest relative loss difference between NumPy and every other installed backend
  over 200 steps, the first step at which it exceeds 1e-10 within ``--long`` steps, and, at the steps where it
  does, its largest ratio to the ``1e-15`` run's drift so far (what ``compare_backends`` bounds by
  ``AMPLIFICATION_MARGIN``).

``--mechanism`` adds AdafacDiag++'s diagnostics: the refresh-step structure's margins (its entries against the
rank tolerance), the smallest relative singular-value gap at each refresh, whether Adafactor's update clipping is
active, the linearity of the amplification (``e(t) / delta`` for two sizes of a kick at one step), and the growth
factor with one ingredient changed at a time (no refresh, no clipping, ``eps = 1e-16``, smaller learning rates).

Run: ``python benchmarks/report_sensitivity.py [--long 1000] [--no-backends] [--mechanism]``
(about 2 minutes with every backend and ``--long 1000``; docs/golden.md, "Cross-backend sensitivity").
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import adadiag_ref as ar
from adadiag_ref import report
from adadiag_ref.optim import core

TOL = report.CROSS_BACKEND_RTOL


def _first(mask: np.ndarray) -> str:
    hits = np.nonzero(mask)[0]
    return str(int(hits[0]) + 1) if hits.size else "-"


def _backend_deviations(steps: int) -> dict[str, np.ndarray]:
    """Per optimizer: the largest relative loss deviation from NumPy over the other backends, per step."""
    rows = report.run_report(steps=steps, out=lambda _: None, progress=False)
    ref = {r.optimizer: np.asarray(r.curve) for r in rows if r.backend == "numpy"}
    worst: dict[str, np.ndarray] = {name: np.zeros(steps) for name in ref}
    for r in rows:
        if r.backend != "numpy":
            dev = np.abs(np.asarray(r.curve) - ref[r.optimizer]) / np.abs(ref[r.optimizer])
            worst[r.optimizer] = np.maximum(worst[r.optimizer], dev)
    print("backends compared with numpy: " + ", ".join(sorted({r.backend for r in rows} - {"numpy"})))
    return worst


def table(long: int, backends: bool) -> None:
    cross = _backend_deviations(long) if backends else {}
    head = (
        "| optimizer | growth/step | 1e-15: max loss drift, 200 steps | 1e-15: loss drift > 1e-10 at step "
        "| 1e-15: param drift > 1e-8 at step | backends: max loss diff, 200 steps | backends: > 1e-10 at step "
        "| backends / 1e-15 drift so far, max where > 1e-10 |"
    )
    print(f"(first steps within {long} steps; '-': never)")
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    for name in ar.OPTIMIZERS:
        linear = report.sensitivity(name, steps=200, delta=1e-10)
        tiny = report.sensitivity(name, steps=long, delta=report.PERTURBATION)
        loss = np.asarray(tiny.loss_deviation)
        param = np.asarray(tiny.param_deviation)
        row = [
            name,
            f"{linear.growth_per_step():.3f}",
            f"{loss[:200].max():.1e}",
            _first(loss > TOL),
            _first(param > 1e-8),
        ]
        if name in cross:
            dev = cross[name]
            envelope = np.maximum.accumulate(loss)
            flagged = dev > TOL
            ratio = f"{(dev[flagged] / envelope[flagged]).max():.2g}" if flagged.any() else "-"
            row += [f"{dev[:200].max():.1e}", _first(flagged), ratio]
        else:
            row += ["", "", ""]
        print("| " + " | ".join(row) + " |")


# ----------------------------------------------------------------------------- AdafacDiag++'s mechanism


def _config(**overrides: Any) -> Any:
    return ar.make_config("adafacdiag_pp", **{"lr": 3e-2, "update_freq": report.UPDATE_FREQ, **overrides})


def _run(cfg: Any, W0: np.ndarray, steps: int, kick: tuple[int, np.ndarray] | None = None) -> list[dict[str, Any]]:
    """The report's loop for one config, with what each step saw: ``W_{t+1}``, the loss and the clip ratio."""
    p = report.least_squares_problem()
    W = W0.copy()
    state = ar.init(W, cfg)
    out = []
    eps = np.finfo(np.float64).eps
    for t in range(1, steps + 1):
        if kick is not None and t == kick[0]:
            W = W + kick[1]
        R = p.A @ W @ p.B - p.C
        G = p.A.T @ R @ p.B.T
        refreshing = ar.refresh_due(t - 1, cfg)
        W, state = ar.step(state, G, cfg, W)
        info: dict[str, Any] = {"W": W, "loss": 0.5 * float(np.sum(R * R))}
        if state.P is not None and state.Q is not None:
            G_rot = state.P.T @ G @ state.Q
            if refreshing:  # the refresh-step structure (docs/spec.md, section 5), against the rank tolerance
                S = np.linalg.svd(G, compute_uv=False)
                ratio = np.abs(G_rot) / (max(G.shape) * eps * S[0])
                zeroed = core.refresh_step_structure(G_rot, True, True, np) == 0
                info["floor"] = (int(zeroed.sum()), ratio[zeroed].max(), ratio[~zeroed].min())
                info["gap"] = float(np.min(-np.diff(S)) / S[0])
                G_rot = core.refresh_step_structure(G_rot, True, True, np)
            U = G_rot * np.sqrt(state.r.sum()) / (np.sqrt(state.r)[:, None] * np.sqrt(state.s)[None, :])
            info["rms_u"] = float(np.sqrt(np.mean(U * U)))
            info["r_min"], info["s_min"] = float(state.r.min()), float(state.s.min())
        out.append(info)
    return out


def _deviation(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> np.ndarray:
    return np.array([np.abs(x["W"] - y["W"]).max() / np.abs(x["W"]).max() for x, y in zip(a, b, strict=True)])


def _growth(dev: np.ndarray, saturation: float = 1e-4) -> float:
    above = np.nonzero(dev > saturation)[0]
    dev = dev[: above[0] if above.size else dev.size]
    t = np.arange(1, dev.size + 1)
    return float(np.exp(np.polyfit(t, np.log(dev), 1)[0]))


def mechanism(steps: int = 200) -> None:
    p = report.least_squares_problem()
    Z = np.random.default_rng(1).standard_normal(p.W0.shape)
    base = _run(_config(), p.W0, steps)
    print("\nAdafacDiag++ on the report's problem (lr 3e-2, T = 20), NumPy:")
    print("refresh  zeroed  max zeroed |G~|/tol  min kept |G~|/tol  min gap(sigma)/sigma_1")
    for t, info in enumerate(base, start=1):
        if "floor" in info:
            zeroed, hi, lo = info["floor"]
            print(f"{t:7d} {zeroed:7d} {hi:20.2e} {lo:18.2e} {info['gap']:23.2e}")
    rms = np.array([i["rms_u"] for i in base])
    print(
        f"clipping: RMS(G~ / sqrt(V)) in [{rms.min():.1f}, {rms.max():.1f}] (threshold 1): active at "
        f"{int((rms > 1).sum())}/{steps} steps; min r in [{min(i['r_min'] for i in base):.1e}, "
        f"{max(i['r_min'] for i in base):.1e}], min s in [{min(i['s_min'] for i in base[1:]):.1e}, "
        f"{max(i['s_min'] for i in base[1:]):.1e}] (max r, s ~ 4)"
    )
    print("linearity: kick W at step t0 by delta Z; e(t) / delta (the same for both deltas: a linear amplification)")
    for t0 in (42, 102):
        for delta in (1e-11, 1e-9):
            kicked = _run(_config(), p.W0, steps, (t0, delta * Z))
            dev = _deviation(base, kicked) / delta
            marks = [t for t in (t0 + 20, t0 + 40, t0 + 60) if t <= steps]
            print(f"  t0 = {t0:3d}, delta = {delta:.0e}: " + ", ".join(f"t = {t}: {dev[t - 1]:.2e}" for t in marks))
    dev = _deviation(base, _run(_config(), p.W0 + 1e-10 * Z, steps))
    above = np.nonzero(dev > 1e-4)[0]
    window = int(above[0]) if above.size else steps
    factors = dev[1:window] / dev[: window - 1]  # factors[k]: step k + 2 over step k + 1
    at_refresh = {t: factors[t - 2] for t in range(2, window + 1) if ar.refresh_due(t - 1, _config())}
    others = [f for k, f in enumerate(factors) if k + 2 not in at_refresh]
    print(
        f"per-step growth of a 1e-10 change of W_1 up to step {window}: geometric mean "
        f"{np.exp(np.mean(np.log(factors))):.3f}; at the refresh steps "
        + ", ".join(f"{t}: {f:.2f}" for t, f in at_refresh.items())
        + f"; median of the others {np.median(others):.3f}"
    )
    print("growth/step (delta = 1e-10, as in the table) with one ingredient changed:")
    variants: dict[str, dict[str, Any]] = {
        "as in the report": {},
        "no refresh after t = 1 (T = inf)": {"update_freq": None},
        "no update clipping": {"clip_threshold": None},
        "eps = 1e-16 instead of 1e-30": {"eps": 1e-16},
        "lr = 1e-2": {"lr": 1e-2},
        "lr = 3e-3": {"lr": 3e-3},
    }
    for label, overrides in variants.items():
        cfg = _config(**overrides)
        a = _run(cfg, p.W0, steps)
        b = _run(cfg, p.W0 + 1e-10 * Z, steps)
        print(f"  {label:34} {_growth(_deviation(a, b)):.3f}   L({steps}) = {a[-1]['loss']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=1000, help="horizon for the 'first step' columns (default 1000)")
    parser.add_argument("--no-backends", action="store_true", help="skip the cross-backend columns")
    parser.add_argument("--mechanism", action="store_true", help="AdafacDiag++'s diagnostics as well")
    args = parser.parse_args()
    if args.long < 200:
        parser.error(f"--long must be at least 200, got {args.long}")
    table(args.long, not args.no_backends)
    if args.mechanism:
        mechanism()


if __name__ == "__main__":
    main()
