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
with its traceback.  The fixture's config is given under the API's names
(:func:`~adadiag_ref.golden.format.api_options`); a keyword the port does not take is left out when its
value is the library's default, and fails the case otherwise (the case needs it).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from .._cli import ErrorParser, fail, output_file, parse_and_run, positive_int
from ..config import OPTIMIZERS, make_config
from .compare import ComparisonReport, compare, error_report
from .format import STATE_FIELDS, GoldenCase, api_options, default_data_dir, load_cases, state_key

__all__ = [
    "CMD_PROTOCOL",
    "ConformResult",
    "add_parser",
    "cmd_runner",
    "infer_optimizer",
    "junit_xml",
    "load_object",
    "main",
    "optax_runner",
    "port_options",
    "port_runner",
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


def _library_defaults(optimizer: str, api: str) -> dict[str, Any]:
    """The library's default of every keyword, under the API's names (what leaving a keyword out means here)."""
    cfg = make_config(optimizer)
    values = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init}
    values["momentum"] = values.pop("momentum_enabled", None)
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}  # as JSON gives them
    return api_options(values, api)


def port_options(port: Callable[..., Any], case: GoldenCase, api: str) -> tuple[dict[str, Any], list[str]]:
    """The case's config as keywords ``port`` takes, and the keywords left out (each at the library's default).

    Raises ``ValueError`` when the port lacks a keyword whose value in the case is not the default.
    """
    options = api_options(case.config, api)
    try:
        parameters = inspect.signature(port).parameters
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return options, []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return options, []
    defaults = _library_defaults(case.optimizer, api)
    kept, left_out = {}, []
    for key, value in options.items():
        if key in parameters:
            kept[key] = value
        elif key in defaults and defaults[key] == value:
            left_out.append(key)
        else:
            raise ValueError(
                f"{getattr(port, '__name__', port)} takes no {key!r}, and the case needs {key}={value!r} "
                f"(the library's default is {defaults.get(key)!r})"
            )
    return kept, left_out


def _guarded(runner: Callable[[GoldenCase], ComparisonReport]) -> Runner:
    """A failure to build the port (its constructor raising, a keyword it lacks) fails the case, not the run."""

    def run(case: GoldenCase) -> ComparisonReport:
        try:
            return runner(case)
        except Exception:
            return error_report(case, traceback.format_exc())

    return run


def torch_runner(cls: Any) -> Runner:
    """Cases through a ``torch.optim.Optimizer`` class: ``cls([p], **config)``, ``p.grad = G_t``, ``step()``."""
    import torch

    def run(case: GoldenCase) -> ComparisonReport:
        kwargs, _ = port_options(cls, case, "torch")
        param = torch.nn.Parameter(torch.from_numpy(np.array(case.w0, copy=True)))
        optimizer = cls([param], **kwargs)

        def step_fn(w: np.ndarray, g: np.ndarray, t: int) -> Any:
            param.grad = torch.from_numpy(g)
            optimizer.step()
            state = optimizer.state.get(param, {})
            tensors = {k: v.detach().cpu().numpy() for k, v in state.items() if isinstance(v, torch.Tensor)}
            return param.detach().cpu().numpy().copy(), tensors

        return compare(step_fn, case)

    return _guarded(run)


def _optax_state(state: Any, params: Any) -> dict[str, Any]:
    """The first NamedTuple in an optax state with a field named like a fixture state field (core states: the
    library's ``CoreTransformState`` read through ``core_states``, the moments in the work frame)."""
    import jax

    adapter = sys.modules.get("adadiag_ref.adapters.optax")
    wanted = set(STATE_FIELDS) - {"count"}

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


def optax_runner(factory: Callable[..., Any]) -> Runner:
    """Cases through an optax factory: ``tx = factory(**config)`` (optax's names), ``tx.update`` under ``jax.jit``."""
    import jax
    import jax.numpy as jnp
    import optax

    def run(case: GoldenCase) -> ComparisonReport:
        if case.dtype == "float64":
            jax.config.update("jax_enable_x64", True)  # a float64 case needs float64 arrays
        kwargs, _ = port_options(factory, case, "optax")
        tx = factory(**kwargs)
        box: dict[str, Any] = {"params": jnp.asarray(case.w0)}
        box["state"] = tx.init(box["params"])
        update = jax.jit(tx.update)

        def step_fn(w: np.ndarray, g: np.ndarray, t: int) -> Any:
            updates, box["state"] = update(jnp.asarray(g), box["state"], box["params"])
            box["params"] = optax.apply_updates(box["params"], updates)
            return np.asarray(box["params"]), _optax_state(box["state"], box["params"])

        return compare(step_fn, case)

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


def cmd_runner(command: str, timeout: float = 120.0) -> Runner:
    """Cases through a command of :data:`CMD_PROTOCOL`, one process per case."""

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
        return compare(params, case, states={k: v for k, v in states.items() if k in STATE_FIELDS})

    return run


# ----------------------------------------------------------------------------- running and reporting


@dataclass(frozen=True)
class ConformResult:
    """Every case's report and time, for one port (``target``: what was run)."""

    target: str
    reports: tuple[ComparisonReport, ...]
    seconds: tuple[float, ...]

    @property
    def failed(self) -> list[ComparisonReport]:
        return [r for r in self.reports if not r.passed]

    @property
    def total_seconds(self) -> float:
        return float(sum(self.seconds))

    def text(self, verbose: bool = False) -> str:
        """One line per case (a failing case: its full report when ``verbose``), then the count and the time."""
        lines = []
        for report in self.reports:
            if verbose and not report.passed:
                lines.append(str(report))
            else:
                lines.append(report.summary())
                if report.error and not report.passed:
                    lines.append("  " + "\n  ".join(report.error.rstrip().splitlines()[-6:]))
        passed = len(self.reports) - len(self.failed)
        lines.append(f"{passed}/{len(self.reports)} cases pass ({self.target}; {self.total_seconds:.1f} s)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "adadiag-conform",
            "format_version": 1,
            "target": self.target,
            "cases": len(self.reports),
            "passed": len(self.reports) - len(self.failed),
            "failed": len(self.failed),
            "seconds": self.total_seconds,
            "results": [{**r.to_dict(), "seconds": s} for r, s in zip(self.reports, self.seconds)],
        }


def junit_xml(result: ConformResult) -> str:
    """JUnit XML: one ``testcase`` per case; a mismatch is a ``failure``, a port that raised an ``error``."""
    errors = sum(1 for r in result.failed if r.error is not None and r.first_mismatch is None)
    suite = ET.Element(
        "testsuite",
        name="adadiag-ref conform",
        tests=str(len(result.reports)),
        failures=str(len(result.failed) - errors),
        errors=str(errors),
        skipped="0",
        time=f"{result.total_seconds:.3f}",
    )
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="target", value=result.target)
    for report, seconds in zip(result.reports, result.seconds):
        optimizer = report.case.split("-")[0]
        case = ET.SubElement(
            suite, "testcase", classname=f"adadiag_ref.conform.{optimizer}", name=report.case, time=f"{seconds:.3f}"
        )
        if report.passed:
            continue
        kind = "error" if report.error is not None and report.first_mismatch is None else "failure"
        node = ET.SubElement(case, kind, message=report.summary(), type=kind)
        node.text = str(report)
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def run_conform(
    runner: Runner, cases: Iterable[GoldenCase], target: str, progress: Callable[[str], None] | None = None
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
    return ConformResult(target, tuple(reports), tuple(seconds))


def select_cases(
    directory: str | Path | None, optimizers: list[str] | None, dtype: str | None, names: list[str] | None
) -> list[GoldenCase]:
    """The cases of a fixture set, filtered by optimizer, dtype and name (an unknown name is an error)."""
    cases = [c for c in load_cases(directory, dtype=dtype) if optimizers is None or c.optimizer in optimizers]
    if names:
        known = {c.name for c in cases}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"no case {', '.join(unknown)} among the selected ones")
        cases = [c for c in cases if c.name in names]
    return cases


# ----------------------------------------------------------------------------- the command


def port_runner(kind: str, target: str, timeout: float = 120.0) -> tuple[Runner, list[str] | None]:
    """The runner of a port (``kind``: ``torch``, ``optax`` or ``cmd``; ``target``: ``MOD:NAME`` or the command)
    and the optimizers it implements when its name tells (``None``: say it, or for ``cmd``, every case).

    Raises ``ValueError`` (a usage error) when the port cannot be loaded or its framework is missing."""
    if kind == "cmd":
        return cmd_runner(target, timeout), None
    if kind not in ("torch", "optax"):
        raise ValueError(f"unknown port kind {kind!r}; choose torch, optax or cmd")
    port = load_object(target)
    inferred = infer_optimizer(port)
    try:
        runner = torch_runner(port) if kind == "torch" else optax_runner(port)
    except ModuleNotFoundError as exc:
        extra = "torch" if kind == "torch" else "jax"
        raise ValueError(f"--{kind} needs {exc.name}: pip install 'adadiag-ref[{extra}]'") from None
    return runner, None if inferred is None else [inferred]


def _build_runner(args: argparse.Namespace) -> tuple[Runner, str, list[str] | None]:
    """The runner, a label of the target and the optimizers to check (``None``: every case)."""
    kind = "cmd" if args.cmd is not None else "torch" if args.torch is not None else "optax"
    target = {"cmd": args.cmd, "torch": args.torch, "optax": args.optax}[kind]
    runner, inferred = port_runner(kind, target, args.timeout)
    optimizers = args.optimizer or inferred
    if optimizers is None and kind != "cmd":
        raise ValueError(f"say which optimizer {target} implements: --optimizer NAME ({', '.join(OPTIMIZERS)})")
    return runner, f"--{kind} {target}", optimizers


def _optimizer_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown optimizer(s) {text!r}; choose from {', '.join(OPTIMIZERS)}")
    return names


def run_command(args: argparse.Namespace) -> int:
    """Exit 0 when every case passes, 1 when one fails, 2 for a usage or input error (one line on stderr)."""
    runner, target, optimizers = _build_runner(args)
    directory = Path(args.dir) if args.dir else default_data_dir()
    cases = select_cases(directory, optimizers, args.dtype, args.case)
    if not cases:
        return fail(f"conform: no golden case in {directory} for {', '.join(optimizers or ['any optimizer'])}")
    result = run_conform(runner, cases, target)
    print(result.text(verbose=args.verbose))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    if args.junit:
        Path(args.junit).write_text(junit_xml(result))
    return 1 if result.failed else 0


def add_parser(subparsers: Any) -> None:
    """Register ``conform`` on an argparse ``subparsers`` object."""
    parser = subparsers.add_parser(
        "conform",
        help="check a port (torch class, optax factory or command) against every golden case",
        description="Run a port over the golden cases; compare parameters and states at every step.",
        epilog=CMD_PROTOCOL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--torch", metavar="MOD:CLASS", help="a torch.optim.Optimizer class (pkg.mod:Class or file.py:Class)"
    )
    target.add_argument("--optax", metavar="MOD:FACTORY", help="an optax transformation factory (pkg.mod:factory)")
    target.add_argument("--cmd", metavar="COMMAND", help="a command reading {input}.npz, writing {output}.npz (below)")
    parser.add_argument(
        "--optimizer",
        type=_optimizer_list,
        default=None,
        help="the optimizer(s) it implements, comma list (default: from the class or function name; --cmd: all)",
    )
    parser.add_argument("--dtype", choices=["float64", "float32"], default=None, help="only the cases of this dtype")
    parser.add_argument("--case", action="append", default=None, help="only this case (repeatable)")
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
