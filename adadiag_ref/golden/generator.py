"""Deterministic generator of the shipped golden fixture set.

Every input is drawn from ``numpy.random.default_rng(seed)`` (PCG64, whose
``standard_normal`` stream is identical on every platform and NumPy >= 1.17),
in this fixed order (``docs/golden.md``, "Gradient streams")::

    rng  = numpy.random.default_rng(seed)
    w0   = rng.standard_normal(shape)              # float64
    G    = rng.standard_normal((K, *shape))        # float64, G[t-1] = G_t
    for t in sorted(events):                       # 1-based steps, ascending
        G[t-1] = event(kind, rng)                  # see _event below

The float32 cases cast the float64 draws with ``astype(float32)`` (round to
nearest).  The expected outputs are then produced by the live core
(:func:`adadiag_ref.step`, NumPy backend) in the case's dtype.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from .._xp import to_numpy
from ..config import OPTIMIZERS, make_config
from ..linalg import canonical_svd
from ..optim import init, layout_for, refresh_due, step, to_work
from ..replay import refresh_conditioning
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    STATE_FIELDS,
    GoldenCase,
    Tolerance,
    array_sha256,
    config_to_dict,
    default_data_dir,
    state_key,
)

__all__ = [
    "MAX_BASIS_SENSITIVITY",
    "STREAMS",
    "TOLERANCES",
    "CaseSpec",
    "Stream",
    "basis_sensitivity",
    "case_from_arrays",
    "case_specs",
    "generate",
    "make_case",
    "make_stream",
    "run_core",
    "stack_states",
]

# Tolerances per dtype (justification in docs/golden.md, "Tolerances").
#   float64: the spread measured between the NumPy, torch and JAX CPU backends
#   is <= 3.2e-16 of the trajectory's scale (a few ulps); 1e-12 keeps > 3000x
#   headroom for other LAPACKs and GPUs while every planted bug is >= 1e-10.
#   float32: the measured spread is <= 1.2e-7 of the scale (about one ulp: the
#   canonical SVD of a float32 gradient moves by eps32 / gap); 1e-5 keeps ~80x
#   headroom while a wrong sign or a missing bias correction is O(1e-3) or more.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-12, atol=0.0, state_rtol=1e-10, atol_factor=1e-12),
    "float32": Tolerance(rtol=1e-5, atol=0.0, state_rtol=1e-3, atol_factor=1e-5),
}

STREAM_GENERATOR = (
    "rng = numpy.random.default_rng(seed); w0 = rng.standard_normal(shape); "
    "grads = rng.standard_normal((steps, *shape)); then for each event in ascending step order "
    "grads[t-1] = event (zero | rank1 | repeated, docs/golden.md); float32 cases cast the float64 draws"
)

# basis_method: the golden cases are produced by the reference refresh route, also in float32 (format.py)
BASE_OPTIONS: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1, "basis_method": "svd"}


@dataclass(frozen=True)
class Stream:
    """A seeded gradient stream: shape, length ``K``, refresh period ``T`` and special steps."""

    name: str
    shape: tuple[int, ...]
    steps: int
    update_freq: int | None
    seed: int
    events: dict[int, str] = field(default_factory=dict)
    features: tuple[str, ...] = ()

    def recipe(self) -> dict[str, Any]:
        return {"seed": self.seed, "events": {str(t): kind for t, kind in sorted(self.events.items())}}


# Refreshes happen at t = 1 and (t - 1) mod T == 0: T = 4, K = 12 gives 1, 5, 9.
STREAMS: dict[str, Stream] = {
    s.name: s
    for s in (
        Stream("wide", (3, 5), 12, 4, 1001, {}, ("wide", "multi_refresh")),
        Stream("tall", (5, 3), 12, 4, 1002, {}, ("tall", "multi_refresh")),
        Stream("square", (4, 4), 12, 4, 1003, {}, ("square", "multi_refresh")),
        Stream("vector", (6,), 10, 3, 1004, {}, ("vector_1d", "multi_refresh")),
        Stream("conv", (4, 2, 3, 3), 10, 4, 1005, {}, ("conv_4d", "multi_refresh")),
        # float32 conv cases: seed 1005 puts a near-tie into the float32 completion of Q at t = 9
        # (see basis_sensitivity), so they draw from their own seed.
        Stream("conv32", (4, 2, 3, 3), 10, 4, 1008, {}, ("conv_4d", "multi_refresh")),
        Stream(
            "degenerate",
            (4, 4),
            12,
            4,
            1006,
            # not "repeated" at t = 1: its exact factors leave exact zeros inside the kept rows of a one-sided G~,
            # whose rounding Adam's first (sign-like) step turns into ~1e-10 (docs/golden.md, Ill-posed cases)
            {1: "zero", 5: "repeated", 9: "rank1"},
            ("square", "multi_refresh", "repeated_singular_values", "zero_gradient", "rank_deficient"),
        ),
        Stream(
            "degenerate_wide",
            (3, 5),
            12,
            4,
            1007,
            {5: "repeated", 7: "zero", 9: "rank1"},
            ("wide", "multi_refresh", "repeated_singular_values", "zero_gradient", "rank_deficient"),
        ),
        # a tall conv kernel: 8 x (1 * 2 * 2), worked on as its 4 x 8 transpose
        Stream("tallconv", (8, 1, 2, 2), 10, 3, 1009, {}, ("tall", "conv_4d", "multi_refresh")),
        # rank-deficient refresh gradients, the first at t = 1 (where G~'s zero rows meet empty moments)
        Stream(
            "lowrank",
            (6, 4),
            12,
            4,
            1010,
            {1: "rank1", 9: "rank1"},
            ("tall", "multi_refresh", "rank_deficient", "rank_deficient_first_refresh"),
        ),
        # 7 refreshes (T = 2): signs and completions re-chosen again and again; the first on a rank-1 gradient,
        # the fourth on a cluster whose left subspace is not axis-aligned (Hadamard factor, m = 4)
        Stream(
            "signs",
            (4, 6),
            14,
            2,
            1011,
            {1: "rank1", 7: "repeated"},
            (
                "wide",
                "multi_refresh",
                "many_refreshes",
                "rank_deficient",
                "rank_deficient_first_refresh",
                "repeated_singular_values",
            ),
        ),
    )
}


@dataclass(frozen=True)
class CaseSpec:
    """One case to generate: an optimizer, a stream, a dtype and config overrides."""

    optimizer: str
    stream: str
    dtype: str
    variant: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def name(self) -> str:
        short = {"float64": "f64", "float32": "f32"}[self.dtype]
        suffix = f"-{self.variant}" if self.variant else ""
        return f"{self.optimizer}-{self.stream}-{short}{suffix}"


def case_specs() -> list[CaseSpec]:
    """The shipped set: every optimizer on every float64 stream, two float32 streams, and the variants.

    Each variant is shipped on two streams (``wide`` and ``tallconv``, or as noted) for every optimizer it
    concerns, so that a bug the variant exposes is caught by at least two cases (``tests/test_mutations.py``).
    """
    f32_streams = ("wide", "conv32")
    specs = [
        CaseSpec(opt, stream, "float64") for opt in OPTIMIZERS for stream in STREAMS if stream not in f32_streams[1:]
    ]
    specs += [CaseSpec(opt, stream, "float32") for opt in OPTIMIZERS for stream in f32_streams]
    classic = {"betas": (0.0, 0.999), "beta2_schedule": "adafactor", "relative_step": True, "scale_parameter": True}
    specs += [
        CaseSpec(
            "adafactor",
            "wide",
            "float64",
            "classic",
            classic,
            "original Adafactor: no momentum, 1 - t^-0.8, relative step",
        ),
        CaseSpec(
            "adafacdiag", "wide", "float64", "classic", classic, "AdafacDiag with the original Adafactor schedules"
        ),
        CaseSpec(
            "adadiag", "wide", "float64", "fixed_basis", {"update_freq": None}, "T = infinity: one refresh, t = 1"
        ),
    ]
    adafactors = [n for n, o in OPTIMIZERS.items() if o.config_type.family == "adafactor"]
    factored = [n for n, o in OPTIMIZERS.items() if o.config_type.family != "adam"]
    first_moment = [n for n, o in OPTIMIZERS.items() if o.config_type.family != "adafactor"]
    rotated = [n for n, o in OPTIMIZERS.items() if o.sides > 0]
    variants: list[tuple[str, list[str], dict[str, Any], tuple[tuple[str, dict[str, Any]], ...], str]] = [
        ("nobc", list(OPTIMIZERS), {"bias_correction": False}, (), "raw betas, no bias correction"),
        ("nomom", first_moment, {"betas": (0.0, 0.999)}, (), "momentum off (beta1 = 0)"),
        ("noclip", factored, {"clip_threshold": None}, (), "no update clipping"),
        (
            "classic_lr1",
            adafactors,
            {**classic, "lr": 1.0},
            (),
            "the original Adafactor schedules with lr = 1 above the relative-step cap 1/sqrt(t) from t = 2",
        ),
        (
            "long",
            rotated,
            {},
            (("wide", {"max_basis_dim": 2}), ("tallconv", {"max_basis_dim": 3})),
            "both sides longer than max_basis_dim: no side rotated",
        ),
        (
            "longn",
            rotated,
            {},
            (("wide", {"max_basis_dim": 3}), ("tallconv", {"max_basis_dim": 4})),
            "max_basis_dim = m < n: P rotated (a side equal to the bound is rotated), Q never",
        ),
    ]
    for variant, optimizers, options, streams, about in variants:
        for opt in optimizers:
            for stream, extra in streams or (("wide", {}), ("tallconv", {})):
                specs.append(
                    CaseSpec(opt, stream, "float64", variant, {**options, **extra}, f"{opt} on {stream}: {about}")
                )
    return specs


# ----------------------------------------------------------------------------- streams


def _exact_orthogonal(size: int, rng: np.random.Generator) -> np.ndarray:
    """An orthogonal matrix with exactly representable entries.

    ``size == 4``: the Sylvester-Hadamard matrix / 2 with randomly signed and
    permuted columns (entries +-1/2, so the repeated singular values are not
    aligned with coordinate axes); otherwise a random signed permutation.
    """
    if size == 4:
        h2 = np.array([[1.0, 1.0], [1.0, -1.0]])
        base = np.kron(h2, h2) / 2.0
    else:
        base = np.eye(size)
    perm = rng.permutation(size)
    signs = rng.choice(np.array([-1.0, 1.0]), size=size)
    return base[:, perm] * signs[None, :]  # type: ignore[no-any-return]


def _event(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A special gradient of ``shape`` (matrix view ``a x b = shape[0] x prod(rest)``).

    * ``zero``: all zeros.
    * ``rank1``: ``outer(x, y)``, ``x ~ N(0, I_a)``, ``y ~ N(0, I_b)``.
    * ``repeated``: ``U[:, :k] diag(s) V[:, :k]^T`` with exact orthogonal ``U, V``
      (:func:`_exact_orthogonal`, ``U`` drawn first) and ``s = (2, 2, 1, 1/2, ...)``:
      the two largest singular values are exactly equal.
    """
    a = shape[0] if shape else 1
    b = math.prod(shape[1:]) if len(shape) > 1 else 1
    if kind == "zero":
        return np.zeros(shape)
    if kind == "rank1":
        x = rng.standard_normal(a)
        y = rng.standard_normal(b)
        return np.outer(x, y).reshape(shape)
    if kind == "repeated":
        k = min(a, b)
        s = np.array([2.0, 2.0] + [2.0 ** (-i) for i in range(k - 2)])[:k]
        U = _exact_orthogonal(a, rng)[:, :k]
        V = _exact_orthogonal(b, rng)[:, :k]
        return ((U * s[None, :]) @ V.T).reshape(shape)  # type: ignore[no-any-return]
    raise ValueError(f"unknown stream event {kind!r}")


def make_stream(stream: Stream, dtype: str = "float64") -> tuple[np.ndarray, np.ndarray]:
    """``(w0, grads)`` of a stream, in ``dtype`` (drawn in float64, then cast)."""
    rng = np.random.default_rng(stream.seed)
    w0 = rng.standard_normal(stream.shape)
    grads = rng.standard_normal((stream.steps, *stream.shape))
    for t in sorted(stream.events):
        grads[t - 1] = _event(stream.events[t], stream.shape, rng)
    return w0.astype(dtype), grads.astype(dtype)


# ----------------------------------------------------------------------------- running the core


def run_core(
    cfg: Any, w0: np.ndarray, grads: np.ndarray, state_steps: Iterable[int] = ()
) -> tuple[np.ndarray, dict[int, dict[str, np.ndarray]]]:
    """Run the live core (NumPy) and return ``(params, states)``.

    ``params[t-1] = W_{t+1}``; ``states[t]`` maps each non-``None`` state field
    after step ``t`` to a host array.
    """
    wanted = set(state_steps)
    state = init(w0, cfg)
    w = w0
    params = []
    states: dict[int, dict[str, np.ndarray]] = {}
    for k in range(grads.shape[0]):
        w, state = step(state, grads[k], cfg, w)
        params.append(to_numpy(w))
        if k + 1 in wanted:
            states[k + 1] = {
                name: to_numpy(getattr(state, name))
                for name in STATE_FIELDS
                if name in state._fields and getattr(state, name) is not None
            }
    return np.stack(params, axis=0) if params else np.zeros((0, *w0.shape), dtype=w0.dtype), states


def stack_states(states: dict[int, dict[str, np.ndarray]], steps: Iterable[int]) -> dict[str, np.ndarray]:
    """``{state_key(field): (K, *field_shape) array}`` from :func:`run_core`'s per-step states (format 2)."""
    order = list(steps)
    names = [name for name in STATE_FIELDS if all(name in states[t] for t in order)] if order else []
    return {state_key(name): np.stack([states[t][name] for t in order], axis=0) for name in names}


def refresh_steps(cfg: Any, steps: int) -> tuple[int, ...]:
    """The steps ``t`` whose gradient refreshes the basis (``t = 1`` and ``(t - 1) mod T == 0``)."""
    return tuple(t for t in range(1, steps + 1) if refresh_due(t - 1, cfg))


def basis_sensitivity(cfg: Any, grads: np.ndarray, steps: Iterable[int]) -> float:
    """Largest change of the canonical bases at ``steps`` when computed in float64 instead of the input dtype.

    The canonical completion picks columns by comparing residual norms up to a
    relative tie tolerance ``max(m, n) eps``; when two norms differ by about
    that much, the rounding of one implementation or another decides, and the
    basis (hence the whole trajectory) changes by O(1).  A float32 case is
    shipped only if this is below :data:`MAX_BASIS_SENSITIVITY`.
    """
    worst = 0.0
    for t in steps:
        g = grads[t - 1]
        if g.ndim < 2 or cfg.sides == 0:
            continue
        layout = layout_for(tuple(g.shape), cfg)
        work = to_work(g, layout, np)
        low = canonical_svd(work)
        high = canonical_svd(work.astype(np.float64))
        for a, b in ((low.P, high.P), (low.Q, high.Q)):
            if a is not None and b is not None:
                worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b))))
    return worst


MAX_BASIS_SENSITIVITY = 1e-4


def make_case(spec: CaseSpec) -> GoldenCase:
    """Build one case: draw its stream, run the core, fix its tolerances."""
    stream = STREAMS[spec.stream]
    options = {**BASE_OPTIONS, "update_freq": stream.update_freq, **spec.options}
    # the reference code, not the numba kernels (equal to rounding): the fixtures do not depend on numba's presence
    cfg = make_config(spec.optimizer, **options, kernels="reference")
    w0, grads = make_stream(stream, spec.dtype)
    refreshes = refresh_steps(cfg, stream.steps)
    if spec.dtype != "float64":
        sensitivity = basis_sensitivity(cfg, grads, refreshes)
        if sensitivity > MAX_BASIS_SENSITIVITY:
            raise ValueError(
                f"case {spec.name}: the canonical basis is ill-posed in {spec.dtype} (changes by {sensitivity:.2g} "
                "in float64); choose another seed"
            )
    features = [*stream.features, spec.dtype]
    if spec.variant:
        features.append(spec.variant)
    if cfg.update_freq is None:
        features.remove("multi_refresh")
    description = spec.description or (
        f"{spec.optimizer} on the {spec.stream} stream {stream.shape}, {spec.dtype}, "
        f"{stream.steps} steps, refreshes at t = {', '.join(map(str, refreshes))}"
    )
    return case_from_arrays(
        spec.name, cfg, w0, grads, stream={"name": stream.name, **stream.recipe()}, features=features,
        description=description,
    )  # fmt: skip


def case_from_arrays(
    name: str,
    cfg: Any,
    w0: np.ndarray,
    grads: np.ndarray,
    *,
    stream: dict[str, Any] | None = None,
    features: Iterable[str] = (),
    description: str = "",
) -> GoldenCase:
    """A case (in memory) from a config and its inputs: the live core's parameters and states at every step,
    the tolerances of ``w0``'s dtype (:data:`TOLERANCES`) and the conditioning of every refresh."""
    steps = int(grads.shape[0])
    refreshes = refresh_steps(cfg, steps)
    state_steps = tuple(range(1, steps + 1))  # every step: a port's first wrong field is found where it begins
    params, states = run_core(cfg, w0, grads, state_steps)
    scale = float(max(np.max(np.abs(w0)), np.max(np.abs(params))))
    base = TOLERANCES[str(w0.dtype)]
    tol = Tolerance(
        rtol=base.rtol, atol=base.atol_factor * scale, state_rtol=base.state_rtol, atol_factor=base.atol_factor
    )
    arrays: dict[str, np.ndarray] = {"w0": w0, "grads": grads, "params": params, **stack_states(states, state_steps)}
    return GoldenCase(
        name=name,
        optimizer=cfg.name,
        config=config_to_dict(cfg),
        dtype=str(w0.dtype),
        shape=tuple(w0.shape),
        steps=steps,
        refresh_steps=refreshes,
        state_steps=state_steps,
        tolerance=tol,
        stream=dict(stream or {}),
        features=tuple(features),
        description=description,
        file=f"{name}.npz",
        sha256={"w0": array_sha256(w0), "grads": array_sha256(grads)},
        arrays=arrays,
        conditioning=tuple(refresh_conditioning(cfg, grads[t - 1]) for t in refreshes),
    )


def generate(out: str | Path | None = None, specs: Iterable[CaseSpec] | None = None) -> Path:
    """Write the fixture set (``manifest.json`` + one ``.npz`` per case) to ``out``.

    Default ``out``: the package's ``golden/data`` directory.  Returns the directory.
    """
    directory = Path(out) if out is not None else default_data_dir()
    directory.mkdir(parents=True, exist_ok=True)
    cases = [make_case(spec) for spec in (specs if specs is not None else case_specs())]
    for case in cases:
        np.savez_compressed(directory / case.file, **case.arrays)  # type: ignore[arg-type]
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library": "adadiag-ref",
        "library_version": __version__,
        "numpy_version": np.__version__,
        "generated_by": "adadiag-ref golden generate",
        "stream_generator": STREAM_GENERATOR,
        "array_layout": {
            "w0": "initial parameter W_1, shape S",
            "grads": "(K, *S): grads[t-1] = G_t",
            "params": "(K, *S): params[t-1] = W_{t+1}, the parameter after step t",
            "state_FIELD": "(K, *field shape): the state field after every step, state_FIELD[t-1] after step t, "
            "work frame (docs/golden.md)",
        },
        "cases": [case.manifest_entry() for case in cases],
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    return directory
