"""The golden-vector format, version 3 (specified in ``docs/golden.md``, with its changelog).

A fixture set is a directory holding ``manifest.json`` and one ``<case>.npz``
per case.  The manifest says what every case is (optimizer, full config,
dtype, shape, gradient-stream recipe, tolerances, refresh steps); the ``.npz``
holds the numbers:

==========================  =================================================
key                         content
==========================  =================================================
``w0``                      initial parameter ``W_1``, shape ``S``
``grads``                   gradient stream, shape ``(K, *S)``; ``grads[t-1] = G_t``
``params``                  parameter after every step, shape ``(K, *S)``;
                            ``params[t-1] = W_{t+1}``
``state_{field}``           optimizer state after every step (work frame),
                            shape ``(K, *field_shape)``: ``state_P[t-1]`` is
                            ``P`` after step ``t``; ``field`` is one of
                            ``count P Q M V r s u v`` (absent = ``None``)
==========================  =================================================

The manifest's ``config`` of a case holds the keyword arguments of the API
(``make_config(optimizer, **config)``, the torch classes, the optax aliases
after :func:`api_options`): ``momentum``, not the dataclass field
``momentum_enabled``; no ``name`` or ``sides`` (the optimizer decides them).

Version 3 adds the basis conditioning of every refresh (the manifest's ``conditioning``, one
``kappa`` per refresh step) and the factors that turn it into a tolerance (``tolerance``'s
``conditioning_factor`` and ``state_conditioning_factor``, docs/golden.md, "Tolerances").  A version 2
case has neither: :meth:`GoldenCase.conditioning_per_step` computes ``kappa`` from its gradients, with
the library's factors.

Version 1 (states at three steps as ``state_t{t:03d}_{field}``, the config
with ``name``, ``sides`` and ``momentum_enabled``) is still read: its config
is translated on load (:func:`config_from_dict` takes either spelling).

Every ``.npz`` is also a valid input of ``adadiag-ref replay`` (it has ``w0``
and ``grads``).
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..config import BaseConfig, make_config
from ..replay import trajectory_conditioning

__all__ = [
    "CONDITIONING_FACTOR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "READABLE_VERSIONS",
    "STATE_CONDITIONING_FACTOR",
    "STATE_FIELDS",
    "GoldenCase",
    "Tolerance",
    "api_config",
    "api_options",
    "array_sha256",
    "conditioning_rtol",
    "config_from_dict",
    "config_to_dict",
    "default_data_dir",
    "load_case",
    "load_cases",
    "load_manifest",
    "state_key",
]

FORMAT_NAME = "adadiag-golden"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""Versions :func:`load_manifest` accepts; changes between them: docs/golden.md, "Format changelog"."""
MANIFEST_NAME = "manifest.json"
STATE_FIELDS = ("count", "P", "Q", "M", "V", "r", "s", "u", "v")


CONDITIONING_FACTOR = 1.0
"""``C`` of the parameters' conditioning tolerance ``C * kappa_t`` (:func:`conditioning_rtol`).

Measured (``benchmarks/conditioning_tolerance.py``, docs/golden.md "Tolerances"): NumPy, torch and JAX
trajectories differ by at most ``0.047 kappa_t`` of the trajectory's scale at ``lr = 1e-2`` and ``0.21 kappa_t``
at ``lr = 0.1`` on random and near-tied spectra (gaps 1e-4 .. 1e-12): about ``2 lr kappa_t``.  ``C = 1`` keeps
20x headroom at the golden ``lr`` and 5x at ``lr = 0.1``."""

STATE_CONDITIONING_FACTOR = 100.0
"""``C`` of the states' conditioning tolerance: the bases and moments move by up to ``3.6 kappa_t`` on their own
scale (measured, same runs; Wedin's bound ``eps ||G|| / gap`` with ``||G||`` a little above ``sigma_max``);
100 keeps 28x headroom."""


def conditioning_rtol(kappa: float | np.ndarray, factor: float = CONDITIONING_FACTOR) -> float | np.ndarray:
    """The relative tolerance two correct implementations meet after a refresh of conditioning ``kappa``.

    ``factor * kappa``, ``kappa`` from :func:`adadiag_ref.linalg.basis_conditioning` (the largest over the
    refreshes so far, :func:`adadiag_ref.replay.trajectory_conditioning`).  A comparison uses the larger of
    this and the case's own tolerance, so a well-conditioned case keeps its golden tolerance
    (``kappa ~ 1e-14`` for a Gaussian gradient against ``rtol = 1e-12``).
    """
    return factor * kappa


def default_data_dir() -> Path:
    """The fixture set shipped with the package (``adadiag_ref/golden/data``)."""
    return Path(__file__).resolve().parent / "data"


def state_key(name: str) -> str:
    """The ``.npz`` key of state field ``name`` at every step (format 2: shape ``(K, *field_shape)``)."""
    return f"state_{name}"


def _state_key_v1(t: int, name: str) -> str:
    """Format 1's key of state field ``name`` after step ``t`` (states at a few steps only)."""
    return f"state_t{t:03d}_{name}"


def array_sha256(x: np.ndarray) -> str:
    """SHA-256 of an array's dtype, shape and C-order little-endian bytes."""
    a = np.ascontiguousarray(x)
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    h = hashlib.sha256()
    h.update(f"{a.dtype.str}|{a.shape}|".encode())
    h.update(a.tobytes())
    return h.hexdigest()


GOLDEN_BASIS_METHOD = "svd"
"""The refresh route of every golden case: the reference (the canonical SVD), in float32 as in float64.

``basis_method`` was added to the configs after format version 1; a manifest
entry without it means this route, and :func:`config_to_dict` leaves it out when
it has this value."""


FIELD_TO_API = {"momentum_enabled": "momentum"}
"""Config dataclass fields whose API keyword differs (``make_config``, the torch classes and optax aliases take
``momentum``): the one place where a fixture key and a field name part."""
DERIVED_FIELDS = ("name", "sides")
"""Config fields the optimizer's name decides; format 2 does not write them (format 1 did)."""
OPTAX_NAMES = {"lr": "learning_rate"}
"""Fixture keys that optax's aliases spell differently; ``betas`` becomes ``b1`` and ``b2`` (:func:`api_options`)."""


def config_to_dict(cfg: BaseConfig) -> dict[str, Any]:
    """The keyword arguments that rebuild ``cfg``, under the API's names, as JSON-ready values.

    ``make_config(cfg.name, **config_to_dict(cfg)) == cfg`` (``kernels`` aside), and the same
    keywords build the torch class (``AdaDiag(params, **config)``).  Every init field is written
    except ``name`` and ``sides`` (the optimizer decides them, :data:`DERIVED_FIELDS`), ``kernels``
    (it chooses who computes, numba or the reference code, equal to rounding, not what) and
    ``basis_method`` when it is ``"svd"`` (:data:`GOLDEN_BASIS_METHOD`); ``momentum_enabled`` is
    written as ``momentum`` (:data:`FIELD_TO_API`); ``betas`` as a list.
    ``batch_dims`` is written only when it is not 0.
    """
    out: dict[str, Any] = {}
    for f in fields(cfg):
        if not f.init or f.name in ("kernels", *DERIVED_FIELDS):
            continue
        if f.name == "basis_method" and cfg.basis_method == GOLDEN_BASIS_METHOD:
            continue
        if f.name == "batch_dims" and cfg.batch_dims == 0:
            continue
        value = getattr(cfg, f.name)
        out[FIELD_TO_API.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
    return out


def config_from_dict(name: str, options: dict[str, Any]) -> BaseConfig:
    """Inverse of :func:`config_to_dict`; also reads format 1's keys (``name``, ``sides``, ``momentum_enabled``)."""
    opts = {"basis_method": GOLDEN_BASIS_METHOD, **api_config(name, options)}
    return make_config(name, **opts)


def api_config(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A fixture config under the API's names: format 1's ``name`` and ``sides`` checked and dropped,
    ``momentum_enabled`` renamed ``momentum``; a format 2 config is returned as is (a copy)."""
    out = {}
    for key, value in options.items():
        if key == "sides" and int(value) != make_config(name).sides:
            raise ValueError(f"config says sides={value} but optimizer {name!r} has sides={make_config(name).sides}")
        if key == "name" and value != name:
            raise ValueError(f"config says name={value!r} but the case's optimizer is {name!r}")
        if key not in DERIVED_FIELDS:
            out[FIELD_TO_API.get(key, key)] = value
    return out


def api_options(config: dict[str, Any], api: str = "torch") -> dict[str, Any]:
    """A case's config as keyword arguments of one API.

    ``"torch"`` (and ``"core"``): as stored (``lr``, ``betas``, ``momentum``, ...), for
    ``Class(params, **options)`` and ``make_config(optimizer, **options)``.  ``"optax"``:
    ``learning_rate`` for ``lr`` and ``b1``, ``b2`` for ``betas``, for ``alias(**options)``.
    """
    if api in ("torch", "core"):
        return dict(config)
    if api != "optax":
        raise ValueError(f"unknown API {api!r}; choose torch, core or optax")
    out = {OPTAX_NAMES.get(k, k): v for k, v in config.items() if k != "betas"}
    if "betas" in config:
        out["b1"], out["b2"] = (float(b) for b in config["betas"])
    return out


@dataclass(frozen=True)
class Tolerance:
    """How a trajectory is checked against a case.

    A value ``x`` matches the golden ``y`` when ``|x - y| <= atol + rtol |y|``.
    ``atol`` is absolute, fixed at generation time as ``atol_factor * scale``
    with ``scale = max |W|`` over ``w0`` and the whole trajectory, so that
    entries passing near zero (whose relative error is meaningless) are judged
    on the trajectory's own scale.  State arrays use ``state_rtol`` and an
    ``atol`` of ``state_rtol * max |array|`` per array.

    After a refresh whose basis is poorly determined the tolerances widen
    (:meth:`GoldenCase.tolerances_per_step`): at step ``t`` ``rtol_t = max(rtol,
    conditioning_factor kappa_t)``, ``atol_t = max(atol, conditioning_factor kappa_t scale)``
    and ``state_rtol_t = max(state_rtol, state_conditioning_factor kappa_t)``.
    """

    rtol: float
    atol: float
    state_rtol: float
    atol_factor: float = 0.0
    conditioning_factor: float = CONDITIONING_FACTOR
    state_conditioning_factor: float = STATE_CONDITIONING_FACTOR

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tolerance:
        return cls(
            rtol=float(d["rtol"]),
            atol=float(d["atol"]),
            state_rtol=float(d.get("state_rtol", d["rtol"])),
            atol_factor=float(d.get("atol_factor", 0.0)),
            conditioning_factor=float(d.get("conditioning_factor", CONDITIONING_FACTOR)),
            state_conditioning_factor=float(d.get("state_conditioning_factor", STATE_CONDITIONING_FACTOR)),
        )


@dataclass(frozen=True)
class GoldenCase:
    """One golden case: its manifest entry and (once loaded) its arrays."""

    name: str
    optimizer: str
    config: dict[str, Any]
    dtype: str
    shape: tuple[int, ...]
    steps: int
    refresh_steps: tuple[int, ...]
    state_steps: tuple[int, ...]
    tolerance: Tolerance
    stream: dict[str, Any]
    features: tuple[str, ...] = ()
    description: str = ""
    file: str = ""
    sha256: dict[str, str] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    conditioning: tuple[float, ...] = ()
    """``kappa`` of each refresh (aligned with ``refresh_steps``; format 3), ``()`` when not stored."""

    # ------------------------------------------------------------------ access
    def make_config(self) -> BaseConfig:
        """The validated :class:`~adadiag_ref.config.BaseConfig` of this case."""
        return config_from_dict(self.optimizer, self.config)

    @property
    def w0(self) -> np.ndarray:
        return self.arrays["w0"]

    @property
    def grads(self) -> np.ndarray:
        return self.arrays["grads"]

    @property
    def params(self) -> np.ndarray:
        return self.arrays["params"]

    def state(self, t: int) -> dict[str, np.ndarray]:
        """State fields stored after step ``t``, work frame (absent fields are ``None`` in the core).

        Format 2 stores every step; a format 1 case only its ``state_steps`` (other steps give ``{}``).
        """
        out = {}
        for name in STATE_FIELDS:
            stacked = self.arrays.get(state_key(name))
            if stacked is not None:
                out[name] = stacked[t - 1]
            elif _state_key_v1(t, name) in self.arrays:
                out[name] = self.arrays[_state_key_v1(t, name)]
        return out

    def conditioning_per_step(self) -> np.ndarray:
        """``kappa_t``, ``t = 1..K``: the largest refresh conditioning at steps ``<= t`` (``(K,)`` float64).

        From the stored ``conditioning`` (format 3), else computed from the gradients
        (:func:`adadiag_ref.replay.trajectory_conditioning`; a format 2 case, loaded with its arrays).
        """
        if len(self.conditioning) != len(self.refresh_steps) or not self.refresh_steps:
            return trajectory_conditioning(self.make_config(), self.grads)
        at_refresh = np.zeros(self.steps)
        for t, kappa in zip(self.refresh_steps, self.conditioning, strict=True):
            at_refresh[t - 1] = kappa
        return np.maximum.accumulate(at_refresh)

    def tolerances_per_step(self, rtol: float | None = None, atol: float | None = None) -> tuple[np.ndarray, ...]:
        """``(rtol_t, atol_t, state_rtol_t)`` for ``t = 1..K``: the case's tolerance (``rtol``, ``atol``
        override it), widened by the basis conditioning where it is larger (:class:`Tolerance`)."""
        tol = self.tolerance
        rtol = tol.rtol if rtol is None else rtol
        atol = tol.atol if atol is None else atol
        kappa = self.conditioning_per_step()
        cond = np.asarray(conditioning_rtol(kappa, tol.conditioning_factor), dtype=np.float64)
        scale = float(max(np.max(np.abs(self.w0)), np.max(np.abs(self.params))))  # as the case's own atol
        state = np.asarray(conditioning_rtol(kappa, tol.state_conditioning_factor), dtype=np.float64)
        return np.maximum(rtol, cond), np.maximum(atol, cond * scale), np.maximum(tol.state_rtol, state)

    # ------------------------------------------------------------------ manifest
    def manifest_entry(self) -> dict[str, Any]:
        """The case's entry of a format 3 manifest (states at every step: no ``state_steps``)."""
        return {
            "name": self.name,
            "file": self.file,
            "optimizer": self.optimizer,
            "config": self.config,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "steps": self.steps,
            "refresh_steps": list(self.refresh_steps),
            "tolerance": self.tolerance.to_dict(),
            "stream": self.stream,
            "features": list(self.features),
            "description": self.description,
            "sha256": dict(self.sha256),
            "conditioning": list(self.conditioning),
        }

    @classmethod
    def from_manifest_entry(cls, entry: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> GoldenCase:
        """A case from its manifest entry (format 1, 2 or 3; a format 1 config is translated, :func:`api_config`)."""
        steps = int(entry["steps"])
        return cls(
            name=entry["name"],
            optimizer=entry["optimizer"],
            config=api_config(entry["optimizer"], entry["config"]),
            dtype=entry["dtype"],
            shape=tuple(int(d) for d in entry["shape"]),
            steps=steps,
            refresh_steps=tuple(int(t) for t in entry["refresh_steps"]),
            state_steps=tuple(int(t) for t in entry.get("state_steps", range(1, steps + 1))),
            tolerance=Tolerance.from_dict(entry["tolerance"]),
            stream=dict(entry.get("stream", {})),
            features=tuple(entry.get("features", ())),
            description=entry.get("description", ""),
            file=entry.get("file", f"{entry['name']}.npz"),
            sha256=dict(entry.get("sha256", {})),
            arrays=arrays or {},
            conditioning=tuple(float(k) for k in entry.get("conditioning", ())),
        )


def load_manifest(directory: str | Path | None = None) -> dict[str, Any]:
    """Read and check ``manifest.json`` of a fixture directory (default: the shipped set)."""
    path = Path(directory) if directory is not None else default_data_dir()
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FileNotFoundError(f"no {MANIFEST_NAME} in {path}; run `adadiag-ref golden generate --out {path}`")
    try:
        manifest: dict[str, Any] = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:  # its message names a line and a column, not the file
        raise ValueError(f"{manifest_path} is not valid JSON: {exc}") from exc
    if manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{manifest_path} is not an {FORMAT_NAME} manifest (format={manifest.get('format')!r})")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise ValueError(f"{manifest_path} has format_version {version!r}; this library reads {readable}")
    return manifest


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of one case file; a truncated or corrupt file is a ``ValueError`` that names it."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: np.asarray(data[key]) for key in data.files}
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:  # numpy's and zipfile's messages omit the path
        raise ValueError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc


def load_cases(
    directory: str | Path | None = None,
    *,
    optimizer: str | None = None,
    dtype: str | None = None,
    feature: str | None = None,
    arrays: bool = True,
) -> list[GoldenCase]:
    """All cases of a fixture directory, optionally filtered; with their arrays unless ``arrays=False``."""
    path = Path(directory) if directory is not None else default_data_dir()
    manifest = load_manifest(path)
    out = []
    for entry in manifest["cases"]:
        if optimizer is not None and entry["optimizer"] != optimizer:
            continue
        if dtype is not None and entry["dtype"] != dtype:
            continue
        if feature is not None and feature not in entry.get("features", ()):
            continue
        data = _read_arrays(path / entry["file"]) if arrays else None
        out.append(GoldenCase.from_manifest_entry(entry, data))
    return out


def load_case(name_or_path: str | Path, directory: str | Path | None = None) -> GoldenCase:
    """One case, by name (looked up in ``directory``, default the shipped set) or by ``.npz`` path.

    A path's manifest is the ``manifest.json`` next to it.
    """
    candidate = Path(name_or_path)
    if candidate.suffix == ".npz" and candidate.is_file():
        path, key, wanted = candidate.parent, "file", candidate.name
    else:
        path = Path(directory) if directory is not None else default_data_dir()
        key, wanted = "name", str(name_or_path)
    entries = [e for e in load_manifest(path)["cases"] if e[key] == wanted]
    if not entries:
        raise KeyError(f"no golden case {str(name_or_path)!r} in {path}")
    return GoldenCase.from_manifest_entry(entries[0], _read_arrays(path / entries[0]["file"]))
