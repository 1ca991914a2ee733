"""``adadiag-ref conform``: run a port of any framework over every golden case and report.

A port is one of

* a ``torch.optim.Optimizer`` class (``--torch pkg.mod:Class``): built per case as
  ``Class([p], **config)`` on one float parameter ``p = W_1``; each step sets ``p.grad = G_t`` and calls
  ``step()``; the entries of ``optimizer.state[p]`` named like the fixture's state fields
  (``step`` or ``count``, ``P Q M V r s u v``, work frame) are compared too;
* an optax transformation factory (``--optax pkg.mod:factory``): ``tx = factory(**config)`` with optax's
  names (``learning_rate``, ``b1``, ``b2``; :func:`~adadiag_ref.golden.format.api_options`); each step is
  ``updates, s = tx.update(G_t, s, W_t)``, ``W_{t+1} = optax.apply_updates(W_t, updates)``, under
  ``jax.jit``; a NamedTuple in the optax state with fields named like the fixture's state fields is
  compared (the library's own ``CoreTransformState`` through ``core_states``);
* a command (``--cmd "..."``) that reads an input ``.npz`` and writes an output ``.npz``, once per case
  (the file protocol: :data:`CMD_PROTOCOL`, docs/golden.md).

Every case runs, whatever the others do: a port that raises (or a command that fails) is a failed case
with its traceback (the port's frames; the kit's own are left out).  The fixture's config is given under the
API's names (:func:`~adadiag_ref.golden.format.api_options`), only the keys that apply to the optimizer
(:func:`applicable_options`: an unrotated optimizer has no ``update_freq``); a keyword the port does not take is
left out when its value is the library's default, and otherwise the case is *not applicable* to the port:
skipped, counted and listed, never a failure.  What the constructor's signature names decides; a keyword a port
would swallow through ``**kwargs`` counts only when declared (``accepts``, ``--accepts``).

The states of torch.optim's Adam/AdamW (``step``, ``exp_avg``, ``exp_avg_sq``) and optax's ``ScaleByAdamState``
(``count``, ``mu``, ``nu``) are recognised; other names are mapped with ``--state-map exp_avg=M,...``, and raw
moments are detected or declared (``--moments``; :func:`~adadiag_ref.golden.compare.compare`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from .._cli import ErrorParser, fail, output_file, parse_and_run, positive_int
from ..config import OPTIMIZERS, make_config
from .compare import KNOWN_STATE_NAMES, ComparisonReport, compare, error_report, parse_state_map, port_traceback
from .format import STATE_FIELDS, GoldenCase, api_options, default_data_dir, load_cases, state_key

__all__ = [
    "CMD_PROTOCOL",
    "UNROTATED_ONLY_KEYS",
    "ConformOptions",
    "ConformResult",
    "NotApplicable",
    "add_parser",
    "applicable_options",
    "cmd_runner",
    "conform_options",
    "infer_optimizer",
    "junit_xml",
    "list_cases",
    "load_object",
    "main",
    "not_applicable_report",
    "optax_runner",
    "port_options",
    "port_runner",
    "process_seconds",
    "run_conform",
    "select_cases",
    "torch_runner",
]

Runner = Callable[[GoldenCase], ComparisonReport]

CMD_PROTOCOL = """\
input .npz (written by adadiag-ref conform, one per case):
  w0            (S)            float32/float64: W_1; the case's dtype
  grads         (K, *S)        same dtype: grads[t-1] = G_t
  optimizer     0-d str        adamw adadiag adadiag_pp adafactor adafacdiag adafacdiag_pp hfac hfacdiag
  config        0-d str        JSON object: the hyperparameters under the API's names (lr, betas, eps, ...)
  case          0-d str        the case's name
  refresh_steps (R,) int64     the steps t that refresh the basis (t = 1 and (t - 1) mod T == 0)
output .npz (written by the command):
  params        (K, *S)        required: params[t-1] = W_{t+1}, the parameter after step t
  state_FIELD   (K, *F)        optional, FIELD in count P Q M V r s u v: the state after every step, in the
                               work frame of docs/spec.md (state_P[t-1] = P after step t); compared when given
The command gets the two paths in place of {input} and {output}, or appended as its last two arguments
when it has neither; a non-zero exit status fails the case with the command's stderr."""
"""The ``--cmd`` file protocol (docs/golden.md, "The runner: adadiag-ref conform")."""


# ----------------------------------------------------------------------------- loading a port


def load_object(spec: str) -> Any:
    """``pkg.mod:Name`` (imported; the current directory is searched first) or ``path/file.py:Name``."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r}: expected pkg.module:Name or path/file.py:Name")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"{spec!r}: no file {path}")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        if loader is None or loader.loader is None:
            raise ValueError(f"{spec!r}: cannot load {path}")
        module = importlib.util.module_from_spec(loader)
        sys.modules.setdefault(path.stem, module)
        loader.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # as `python -m` and pytest do: the user's own modules
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{spec!r}: cannot import {module_name} ({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{spec!r}: {module_name} has no attribute {attr!r}") from None


def infer_optimizer(port: Any) -> str | None:
    """The registry name a port implements: a ``core_name`` attribute (the library's torch classes), a class
    named like a torch adapter class (``AdaDiagPP``), or a function named like an optimizer (``adadiag``)."""
    name = getattr(port, "core_name", "")
    if name in OPTIMIZERS:
        return str(name)
    by_class = {entry.class_name: key for key, entry in OPTIMIZERS.items()}
    label = getattr(port, "__name__", "")
    return by_class.get(label) or (label if label in OPTIMIZERS else None)


UNROTATED_ONLY_KEYS = ("update_freq", "max_basis_dim", "basis_method")
"""Config keys of the rotation (refresh period, size cap, SVD route): they say nothing to an optimizer without a
basis (``adamw``, ``adafactor``, ``hfac``), whose cases therefore do not pass them to a port."""


class NotApplicable(Exception):
    """A case needs an option the port does not have (the message says which): skipped, not failed."""


@dataclass(frozen=True)
class ConformOptions:
    """How a port is run and compared (the same for every case).

    Attributes:
        accepts: keywords the port honours through ``**kwargs`` (declared: a ``**kwargs`` alone proves nothing).
        port_options: extra keywords for the constructor or factory (``foreach=False``), over the case's.
        state_map: the port's state names for fixture fields (``{"exp_avg": "M"}``), over the known layouts.
        moments: ``auto``, ``raw`` or ``corrected`` (:func:`~adadiag_ref.golden.compare.compare`).
        rtol, state_rtol: the parameters' and the states' relative tolerance instead of the case's.
        rename: the port's names of the case's keywords (``{"bias_correction": "correct_bias"}``: HF, GaLore,
            SOAP; ``{"update_freq": "precondition_frequency"}``: SOAP), applied before the keywords are matched.
    """

    accepts: tuple[str, ...] = ()
    port_options: dict[str, Any] = field(default_factory=dict)
    state_map: dict[str, str] = field(default_factory=dict)
    moments: str = "auto"
    rtol: float | None = None
    state_rtol: float | None = None
    rename: dict[str, str] = field(default_factory=dict)

    def compare(self, step_fn: Any, case: GoldenCase) -> ComparisonReport:
        """:func:`~adadiag_ref.golden.compare.compare` with these options."""
        return compare(
            step_fn, case, rtol=self.rtol, state_rtol=self.state_rtol, state_map=self.state_map, moments=self.moments
        )


def applicable_options(case: GoldenCase, api: str) -> dict[str, Any]:
    """The case's config under the API's names, without the keys that do not apply to its optimizer
    (:data:`UNROTATED_ONLY_KEYS` for an optimizer without a basis)."""
    options = api_options(case.config, api)
    if OPTIMIZERS[case.optimizer].sides == 0:
        options = {k: v for k, v in options.items() if k not in UNROTATED_ONLY_KEYS}
    return options


def _library_defaults(optimizer: str, api: str) -> dict[str, Any]:
    """The library's default of every keyword, under the API's names (what leaving a keyword out means here)."""
    cfg = make_config(optimizer)
    values = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init}
    values["momentum"] = values.pop("momentum_enabled", None)
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}  # as JSON gives them
    return api_options(values, api)


def port_options(
    port: Callable[..., Any],
    case: GoldenCase,
    api: str,
    accepts: Iterable[str] = (),
    rename: dict[str, str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The case's config as keywords ``port`` takes, and the keywords left out (each at the library's default).

    A keyword counts as taken when the signature names it or ``accepts`` declares it (a port's ``**kwargs``
    would swallow any keyword without honouring it, so it proves nothing; the library's own ports validate
    theirs and take every key).  Raises :class:`NotApplicable` when the port lacks a keyword whose value in
    the case is not the library's default.  ``rename`` gives the port's name of a keyword (its value and
    default are the case's).
    """
    names = rename or {}
    options = applicable_options(case, api)
    label = getattr(port, "__name__", str(port))
    if str(getattr(port, "__module__", "")).startswith("adadiag_ref."):  # the library's own validate every keyword
        return options, []
    try:
        parameters = inspect.signature(port).parameters
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return options, []
    named = {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    swallows = next((n for n, p in parameters.items() if p.kind is p.VAR_KEYWORD), None)
    taken = named | set(accepts)
    defaults = _library_defaults(case.optimizer, api)
    kept, left_out = {}, []
    for key, value in options.items():
        if names.get(key, key) in taken:
            kept[names.get(key, key)] = value
        elif key in defaults and defaults[key] == value:
            left_out.append(key)
        elif swallows is not None:
            raise NotApplicable(
                f"needs {key}={value!r}, which {label} would swallow through **{swallows} (no parameter names "
                f"it); if it honours it, declare it: --accepts {key}"
            )
        else:
            raise NotApplicable(
                f"needs {key}={value!r} (the library's default is {defaults.get(key)!r}); {label} takes no {key!r}"
            )
    return kept, left_out


def not_applicable_report(case: GoldenCase, reason: str) -> ComparisonReport:
    """The report of a case the port cannot run (an option it lacks): neither passed nor failed."""
    report = error_report(case, reason)
    return dataclasses.replace(report, first_diverging_step=None, likely_cause=None, error=None, not_applicable=reason)


def _guarded(runner: Callable[[GoldenCase], ComparisonReport]) -> Runner:
    """A case the port cannot run is not applicable; a failure to build the port (its constructor raising)
    fails the case, not the run, with the port's traceback."""

    def run(case: GoldenCase) -> ComparisonReport:
        try:
            return runner(case)
        except NotApplicable as exc:
            return not_applicable_report(case, str(exc))
        except Exception as exc:
            return error_report(case, port_traceback(exc))

    return run


def _host_state(state: Any) -> dict[str, Any]:
    """A torch optimizer's per-parameter state on the host: tensors as arrays, numbers (a Python ``step``) kept."""
    import torch

    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu().numpy()
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
    return out


def torch_runner(cls: Any, options: ConformOptions | None = None) -> Runner:
    """Cases through a ``torch.optim.Optimizer`` class: ``cls([p], **config)``, ``p.grad = G_t``, ``step()``."""
    import torch

    opts = options or ConformOptions()

    def run(case: GoldenCase) -> ComparisonReport:
        kwargs, _ = port_options(cls, case, "torch", opts.accepts, opts.rename)
        param = torch.nn.Parameter(torch.from_numpy(np.array(case.w0, copy=True)))
        optimizer = cls([param], **{**kwargs, **opts.port_options})

        def step_fn(w: np.ndarray, g: np.ndarray, t: int) -> Any:
            param.grad = torch.from_numpy(g)
            optimizer.step()
            return param.detach().cpu().numpy().copy(), _host_state(optimizer.state.get(param, {}))

        return opts.compare(step_fn, case)

    return _guarded(run)


def _optax_state(state: Any, params: Any, state_map: dict[str, str] | None = None) -> dict[str, Any]:
    """The first NamedTuple in an optax state with a field named like a fixture state field, a known layout's
    (``ScaleByAdamState``'s ``mu``, ``nu``) or a mapped one (core states: the library's ``CoreTransformState``
    read through ``core_states``, the moments in the work frame)."""
    import jax

    adapter = sys.modules.get("adadiag_ref.adapters.optax")
    wanted = (set(STATE_FIELDS) | set(KNOWN_STATE_NAMES) | set(state_map or {})) - {"count", "step"}

    def is_state(x: Any) -> bool:
        if adapter is not None and isinstance(x, adapter.CoreTransformState):
            return True
        return hasattr(x, "_fields") and bool(wanted & set(x._fields))

    for node in jax.tree_util.tree_leaves(state, is_leaf=is_state):
        if adapter is not None and isinstance(node, adapter.CoreTransformState):
            return dict(adapter.core_states(node, params)._asdict())
        if is_state(node):
            return dict(node._asdict())
    return {}


def optax_runner(factory: Callable[..., Any], options: ConformOptions | None = None) -> Runner:
    """Cases through an optax factory: ``tx = factory(**config)`` (optax's names), ``tx.update`` under ``jax.jit``."""
    import jax
    import jax.numpy as jnp
    import optax

    opts = options or ConformOptions()

    def run(case: GoldenCase) -> ComparisonReport:
        if case.dtype == "float64":
            jax.config.update("jax_enable_x64", True)  # a float64 case needs float64 arrays
        kwargs, _ = port_options(factory, case, "optax", opts.accepts, opts.rename)
        tx = factory(**{**kwargs, **opts.port_options})
        box: dict[str, Any] = {"params": jnp.asarray(case.w0)}
        box["state"] = tx.init(box["params"])
        update = jax.jit(tx.update)

        def step_fn(w: np.ndarray, g: np.ndarray, t: int) -> Any:
            updates, box["state"] = update(jnp.asarray(g), box["state"], box["params"])
            box["params"] = optax.apply_updates(box["params"], updates)
            return np.asarray(box["params"]), _optax_state(box["state"], box["params"], opts.state_map)

        return opts.compare(step_fn, case)

    return _guarded(run)


def _cmd_argv(command: str, input_path: Path, output_path: Path) -> list[str]:
    argv = shlex.split(command)
    if not any("{input}" in a or "{output}" in a for a in argv):
        return [*argv, str(input_path), str(output_path)]
    return [a.replace("{input}", str(input_path)).replace("{output}", str(output_path)) for a in argv]


def write_cmd_input(case: GoldenCase, path: Path) -> None:
    """The input ``.npz`` of :data:`CMD_PROTOCOL` for one case."""
    np.savez(
        path,
        w0=case.w0,
        grads=case.grads,
        optimizer=np.array(case.optimizer),
        config=np.array(json.dumps(case.config)),
        case=np.array(case.name),
        refresh_steps=np.array(case.refresh_steps, dtype=np.int64),
    )


def cmd_runner(command: str, timeout: float = 120.0, options: ConformOptions | None = None) -> Runner:
    """Cases through a command of :data:`CMD_PROTOCOL`, one process per case."""
    opts = options or ConformOptions()

    def run(case: GoldenCase) -> ComparisonReport:
        with tempfile.TemporaryDirectory(prefix="adadiag-conform-") as tmp:
            input_path, output_path = Path(tmp) / "input.npz", Path(tmp) / "output.npz"
            write_cmd_input(case, input_path)
            argv = _cmd_argv(command, input_path, output_path)
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                return error_report(case, f"{argv[0]}: {exc}")
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-40:])
                return error_report(case, f"the command exited with status {proc.returncode}:\n{tail}")
            if not output_path.is_file():
                return error_report(case, f"the command wrote no {output_path.name} (it must write params)")
            with np.load(output_path, allow_pickle=False) as data:
                if "params" not in data.files:
                    return error_report(case, f"the output holds {sorted(data.files)}, not params")
                params = np.asarray(data["params"])
                prefix = state_key("")
                states = {k[len(prefix) :]: np.asarray(data[k]) for k in data.files if k.startswith(prefix)}
        if params.shape != (case.steps, *case.shape):
            return error_report(case, f"params has shape {params.shape}, expected {(case.steps, *case.shape)}")
        return compare(
            params,
            case,
            states=states,
            rtol=opts.rtol,
            state_rtol=opts.state_rtol,
            state_map=opts.state_map,
            moments=opts.moments,
        )

    return run


# ----------------------------------------------------------------------------- running and reporting


@dataclass(frozen=True)
class ConformResult:
    """Every case's report and time, for one port (``target``: what was run; ``startup``: the seconds before the
    first case, from the process's start where it is known: imports, loading the fixtures, loading the port)."""

    target: str
    reports: tuple[ComparisonReport, ...]
    seconds: tuple[float, ...]
    startup: float = 0.0

    @property
    def failed(self) -> list[ComparisonReport]:
        return [r for r in self.reports if r.failed]

    @property
    def skipped(self) -> list[ComparisonReport]:
        """The cases that do not apply to the port (an option it lacks), each with its reason."""
        return [r for r in self.reports if r.not_applicable is not None]

    @property
    def passed(self) -> list[ComparisonReport]:
        return [r for r in self.reports if r.passed]

    @property
    def total_seconds(self) -> float:
        return float(sum(self.seconds))

    def counts(self) -> str:
        """``14/14 applicable cases pass, 2 not applicable``."""
        applicable = len(self.reports) - len(self.skipped)
        text = f"{len(self.passed)}/{applicable} applicable cases pass"
        return text + (f", {len(self.skipped)} not applicable" if self.skipped else "")

    def text(self, verbose: bool = False) -> str:
        """One line per case (a failing case: its full report when ``verbose``), then the count and the time."""
        lines = []
        for report in self.reports:
            if verbose and report.failed:
                lines.append(str(report))
            else:
                lines.append(report.summary())
                if report.error and report.failed:
                    lines.append("  " + "\n  ".join(report.error.rstrip().splitlines()[-6:]))
        wall = self.startup + self.total_seconds
        lines.append(
            f"{self.counts()} ({self.target}; {wall:.1f} s wall: {self.startup:.1f} s start-up, "
            f"{self.total_seconds:.1f} s in the cases)"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "adadiag-conform",
            "format_version": 2,
            "target": self.target,
            "cases": len(self.reports),
            "passed": len(self.passed),
            "failed": len(self.failed),
            "not_applicable": len(self.skipped),
            "seconds": self.total_seconds,
            "startup_seconds": self.startup,
            "results": [{**r.to_dict(), "seconds": s} for r, s in zip(self.reports, self.seconds)],
        }


def junit_xml(result: ConformResult) -> str:
    """JUnit XML: one ``testcase`` per case; a mismatch is a ``failure``, a port that raised an ``error``, a case
    that does not apply ``skipped``."""
    errors = sum(1 for r in result.failed if r.error is not None and r.first_mismatch is None)
    suite = ET.Element(
        "testsuite",
        name="adadiag-ref conform",
        tests=str(len(result.reports)),
        failures=str(len(result.failed) - errors),
        errors=str(errors),
        skipped=str(len(result.skipped)),
        time=f"{result.total_seconds:.3f}",
    )
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="target", value=result.target)
    for report, seconds in zip(result.reports, result.seconds):
        optimizer = report.case.split("-")[0]
        case = ET.SubElement(
            suite, "testcase", classname=f"adadiag_ref.conform.{optimizer}", name=report.case, time=f"{seconds:.3f}"
        )
        if report.not_applicable is not None:
            ET.SubElement(case, "skipped", message=f"not applicable: {report.not_applicable}")
            continue
        if report.passed:
            continue
        kind = "error" if report.error is not None and report.first_mismatch is None else "failure"
        node = ET.SubElement(case, kind, message=report.summary(), type=kind)
        node.text = str(report)
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def process_seconds() -> float | None:
    """Seconds since this process started (Linux's ``/proc``), or ``None`` where that is not known."""
    try:
        fields_ = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return max(0.0, uptime - int(fields_[19]) / ticks)  # field 22 of stat: the start time in clock ticks


def _run_as_command() -> bool:
    """Whether this process is the ``adadiag-ref`` command (its age is then the start-up), not a host such as
    pytest calling :func:`main`."""
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    return getattr(spec, "name", "") == "adadiag_ref.cli" or Path(sys.argv[0]).name == "adadiag-ref"


_IMPORTED = time.perf_counter()
"""When this module was imported: the start-up's beginning where :func:`process_seconds` is not known."""


def run_conform(
    runner: Runner,
    cases: Iterable[GoldenCase],
    target: str,
    progress: Callable[[str], None] | None = None,
    startup: float = 0.0,
) -> ConformResult:
    """Run every case (each on its own: a failing case never stops the others) and time each."""
    reports, seconds = [], []
    for case in cases:
        start = time.perf_counter()
        report = runner(case)
        seconds.append(time.perf_counter() - start)
        reports.append(report)
        if progress is not None:
            progress(report.summary())
    return ConformResult(target, tuple(reports), tuple(seconds), startup)


def select_cases(
    directory: str | Path | None,
    optimizers: list[str] | None,
    dtype: str | None,
    names: list[str] | None,
    features: list[str] | None = None,
    exclude: list[str] | None = None,
) -> list[GoldenCase]:
    """The cases of a fixture set, filtered by optimizer, dtype, name, feature (every one of ``features``) and
    ``exclude`` (a case name or a feature); an unknown name or feature is an error that lists the known ones."""
    every = load_cases(directory, dtype=dtype)
    cases = [c for c in every if optimizers is None or c.optimizer in optimizers]
    known_features = sorted({f for c in every for f in c.features})
    for label, wanted in (("feature", features or []), ("case or feature", exclude or [])):
        unknown = [f for f in wanted if f not in known_features and f not in {c.name for c in every}]
        if unknown:
            raise ValueError(f"no {label} {', '.join(unknown)}; the features: {', '.join(known_features)}")
    if names:
        known = [c.name for c in cases]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"no case {', '.join(unknown)} among the selected ones; they are: {', '.join(known)}")
        cases = [c for c in cases if c.name in names]
    cases = [c for c in cases if all(f in c.features for f in features or [])]
    dropped = set(exclude or [])
    return [c for c in cases if c.name not in dropped and not dropped & set(c.features)]


def list_cases(cases: Iterable[GoldenCase]) -> str:
    """One line per case: name, optimizer, dtype, shape, steps and features (``conform --list``)."""
    rows = [
        f"{c.name:32s} {c.optimizer:14s} {c.dtype:8s} {'x'.join(map(str, c.shape)):10s} {c.steps:3d} steps  "
        f"{', '.join(c.features)}"
        for c in cases
    ]
    return "\n".join(rows)


# ----------------------------------------------------------------------------- the command


def port_runner(
    kind: str, target: str, timeout: float = 120.0, options: ConformOptions | None = None
) -> tuple[Runner, list[str] | None]:
    """The runner of a port (``kind``: ``torch``, ``optax`` or ``cmd``; ``target``: ``MOD:NAME`` or the command)
    and the optimizers it implements when its name tells (``None``: say it, or for ``cmd``, every case).

    Raises ``ValueError`` (a usage error) when the port cannot be loaded or its framework is missing."""
    if kind == "cmd":
        return cmd_runner(target, timeout, options), None
    if kind not in ("torch", "optax"):
        raise ValueError(f"unknown port kind {kind!r}; choose torch, optax or cmd")
    try:
        port = load_object(target)
        runner = torch_runner(port, options) if kind == "torch" else optax_runner(port, options)
    except ModuleNotFoundError as exc:
        extra = "torch" if kind == "torch" else "jax"
        raise ValueError(f"--{kind} needs {exc.name}: pip install 'adadiag-ref[{extra}]'") from None
    inferred = infer_optimizer(port)
    return runner, None if inferred is None else [inferred]


def conform_options(
    accepts: str | None = None,
    port_option: Iterable[str] = (),
    state_map: str | None = None,
    moments: str = "auto",
    rtol: float | None = None,
    state_rtol: float | None = None,
    rename: str | None = None,
) -> ConformOptions:
    """:class:`ConformOptions` from the command line's (and the pytest plugin's) text forms: ``accepts`` a comma
    list, each ``port_option`` ``KEY=VALUE`` (a JSON value, else the text), ``state_map`` ``NAME=FIELD,...``,
    ``rename`` ``KEY=PORT_KEY,...``."""
    extra = {}
    for item in port_option:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--port-option {item!r}: expected KEY=VALUE (a JSON value: foreach=false)")
        try:
            extra[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            extra[key.strip()] = text
    return ConformOptions(
        accepts=tuple(k.strip() for k in (accepts or "").split(",") if k.strip()),
        port_options=extra,
        state_map=parse_state_map(state_map or ""),
        moments=moments,
        rtol=rtol,
        state_rtol=state_rtol,
        rename=_pairs(rename or "", "--rename", "KEY=PORT_KEY"),
    )


def _pairs(text: str, flag: str, form: str) -> dict[str, str]:
    """``"a=b,c=d"`` as ``{"a": "b", "c": "d"}``; a malformed pair is a ``ValueError`` naming ``flag``."""
    out = {}
    for pair in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = (x.strip() for x in pair.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"{flag} {pair!r}: expected {form}")
        out[key] = value
    return out


def _target(args: argparse.Namespace) -> tuple[str, str] | None:
    """``(kind, target)`` of the port named on the command line, or ``None`` (``--list`` alone)."""
    for kind in ("cmd", "torch", "optax"):
        if getattr(args, kind) is not None:
            return kind, getattr(args, kind)
    return None


def _optimizer_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown optimizer(s) {text!r}; choose from {', '.join(OPTIMIZERS)}")
    return names


def run_command(args: argparse.Namespace) -> int:
    """Exit 0 when every applicable case passes, 1 when one fails, 2 for a usage or input error (one line on
    stderr) or when no case applies to the port."""
    began = process_seconds() if _run_as_command() else None
    began = time.perf_counter() - _IMPORTED if began is None else began
    clock = time.perf_counter()
    target = _target(args)
    directory = Path(args.dir) if args.dir else default_data_dir()
    if target is None:
        if not args.list:
            return fail("conform: name a port: --torch MOD:CLASS, --optax MOD:FACTORY or --cmd COMMAND (or --list)")
        print(list_cases(select_cases(directory, args.optimizer, args.dtype, args.case, args.feature, args.exclude)))
        return 0
    kind, spec = target
    options = conform_options(
        args.accepts, args.port_option, args.state_map, args.moments, args.rtol, args.state_rtol, args.rename
    )
    runner, inferred = port_runner(kind, spec, args.timeout, options)
    optimizers = args.optimizer or inferred
    if optimizers is None and kind != "cmd" and not args.case:
        raise ValueError(
            f"say which optimizer {spec} implements: --optimizer NAME ({', '.join(OPTIMIZERS)}), or name cases: --case"
        )
    cases = select_cases(directory, optimizers, args.dtype, args.case, args.feature, args.exclude)
    if not cases:
        return fail(f"conform: no golden case in {directory} for {', '.join(optimizers or ['any optimizer'])}")
    if args.list:
        print(list_cases(cases))
        return 0
    startup = began + time.perf_counter() - clock
    result = run_conform(runner, cases, f"--{kind} {spec}", startup=startup)
    print(result.text(verbose=args.verbose))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    if args.junit:
        Path(args.junit).write_text(junit_xml(result))
    if not result.failed and len(result.skipped) == len(result.reports):
        return fail(f"conform: no selected case applies to {spec} ({result.skipped[0].not_applicable})")
    return 1 if result.failed else 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_parser(subparsers: Any) -> None:
    """Register ``conform`` on an argparse ``subparsers`` object."""
    parser = subparsers.add_parser(
        "conform",
        help="check a port (torch class, optax factory or command) against every golden case",
        description="Run a port over the golden cases; compare parameters and states at every step.",
        epilog=CMD_PROTOCOL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--torch", metavar="MOD:CLASS", help="a torch.optim.Optimizer class (pkg.mod:Class or file.py:Class)"
    )
    target.add_argument("--optax", metavar="MOD:FACTORY", help="an optax transformation factory (pkg.mod:factory)")
    target.add_argument("--cmd", metavar="COMMAND", help="a command reading {input}.npz, writing {output}.npz (below)")
    parser.add_argument(
        "--optimizer",
        type=_optimizer_list,
        default=None,
        help="the optimizer(s) it implements, comma list (default: from the class or function name, or the "
        "--case names; --cmd: all)",
    )
    parser.add_argument("--list", action="store_true", help="list the selected cases and their features; run none")
    parser.add_argument("--dtype", choices=["float64", "float32"], default=None, help="only the cases of this dtype")
    parser.add_argument("--case", action="append", default=None, help="only this case (repeatable)")
    parser.add_argument(
        "--feature", action="append", default=None, help="only the cases with this feature (repeatable: all of them)"
    )
    parser.add_argument(
        "--exclude", action="append", default=None, help="leave out this case, or every case with this feature"
    )
    parser.add_argument("--rtol", type=_positive_float, default=None, help="the parameters' rtol (default: the case's)")
    parser.add_argument(
        "--state-rtol", type=_positive_float, default=None, help="the states' rtol (default: the case's)"
    )
    parser.add_argument(
        "--state-map",
        metavar="NAME=FIELD,...",
        default=None,
        help="the port's state names for fixture fields (exp_avg=M,exp_avg_sq=V; torch.optim's and optax's Adam "
        "states are known)",
    )
    parser.add_argument(
        "--moments",
        choices=["auto", "raw", "corrected"],
        default="auto",
        help="the port's M, V: raw EMAs or bias-corrected like the fixture's (default: detected)",
    )
    parser.add_argument(
        "--accepts",
        metavar="KEY,...",
        default=None,
        help="keywords the port honours through **kwargs (a **kwargs alone does not say it)",
    )
    parser.add_argument(
        "--rename",
        metavar="KEY=PORT_KEY,...",
        default=None,
        help="the port's names of the case's keywords (bias_correction=correct_bias)",
    )
    parser.add_argument(
        "--port-option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="an extra keyword for the constructor or factory, VALUE as JSON (foreach=false; repeatable)",
    )
    parser.add_argument("--dir", default=None, help="fixture directory (default: the shipped set)")
    parser.add_argument("--json", metavar="PATH", type=output_file, default=None, help="write the JSON report")
    parser.add_argument("--junit", metavar="PATH", type=output_file, default=None, help="write a JUnit XML report")
    parser.add_argument("--timeout", type=positive_int, default=120, help="--cmd: seconds per case (default 120)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each failing case's full report")
    parser.set_defaults(func=run_command)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (used by the tests): ``main(["conform", "--torch", ...])``."""
    parser = ErrorParser(prog="adadiag-ref")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parse_and_run(parser, argv)
