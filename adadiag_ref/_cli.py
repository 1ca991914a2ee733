"""Shared command-line plumbing: every usage or input error is one line on stderr and exit status 2.

``adadiag-ref: error: MESSAGE`` is the argparse convention (without the usage
block, which ``--help`` prints); a verification that runs and fails exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "INPUT_ERRORS",
    "ErrorParser",
    "add_progress_flags",
    "bar_disable",
    "check_output_file",
    "cpu_name",
    "fail",
    "finite_positive",
    "input_file",
    "int_at_least",
    "int_list",
    "output_file",
    "plot_file",
    "plot_problem",
    "positive_int",
    "pyplot",
]

PROG = "adadiag-ref"

INPUT_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # includes json.JSONDecodeError and the core's validation errors
    TypeError,
    KeyError,
    OSError,  # missing, unreadable or unwritable files
    EOFError,  # a truncated .npz member
    zipfile.BadZipFile,  # a truncated or corrupt .npz
    json.JSONDecodeError,
)
"""What a command's bad input raises; :func:`parse_and_run` turns them into one error line."""


def fail(message: str) -> int:
    """Print ``adadiag-ref: error: MESSAGE`` (one line) on stderr; returns the exit status 2."""
    text = " ".join(str(message).split())  # one line, whatever the exception text holds
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return 2


class ErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are the same single line (its sub-parsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        sub = self.prog[len(PROG) :].strip() if self.prog.startswith(PROG) else ""
        hint = f" (see {PROG} {sub} --help)" if sub else f" (see {PROG} --help)"
        sys.exit(fail(message + hint))


def parse_and_run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """``parser.parse_args(argv)``, then call ``args.func(args)``; an input error becomes one line on stderr and
    exit status 2."""
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], Any] = args.func
    try:
        return int(func(args))
    except INPUT_ERRORS as exc:
        if isinstance(exc, KeyError) and exc.args:
            return fail(str(exc.args[0]))
        return fail(str(exc) or type(exc).__name__)


def finite_positive(text: str) -> float:
    """argparse ``type=``: a finite number > 0 (times, steps, tolerances)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def finite_nonnegative(text: str) -> float:
    """argparse ``type=``: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse ``type=`` factory: an integer ``>= minimum`` (counts, sizes, seeds)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    convert.__name__ = f"int_at_least_{minimum}"
    return convert


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1 (step counts)."""
    return int_at_least(1)(text)


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """argparse ``type=`` factory: a non-empty comma list of distinct integers, each ``>= minimum`` (seeds, sides)."""

    def convert(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"every value must be an integer >= {minimum}, got {text!r}")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"values must be distinct, got {text!r}")
        return values

    convert.__name__ = "int_list"
    return convert


def _output_problem(path: str) -> str | None:
    """Why ``path`` cannot be written as a file (its folder missing or read-only, or a folder itself), or None."""
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        return f"folder {str(folder)!r} does not exist"
    if target.is_dir():
        return "is a folder, not a file"
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return "is not writable"
    return None


def output_file(text: str) -> str:
    """argparse ``type=``: a file that can be written (its folder exists and is writable); checked at parse time."""
    problem = _output_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text


def plot_problem(path: str | os.PathLike[str]) -> str | None:
    """Why matplotlib cannot draw a figure to ``path``: it is not installed, or cannot write the file type the
    suffix names (``.txt``); ``None`` when it can.  No suffix is matplotlib's default format (PNG)."""
    if importlib.util.find_spec("matplotlib") is None:
        return 'needs matplotlib: pip install "adadiag-ref[plot]"'
    suffix = Path(path).suffix.lower().lstrip(".")
    if not suffix:
        return None
    from matplotlib.backend_bases import FigureCanvasBase  # what savefig consults; no backend is chosen

    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        return f"matplotlib cannot write .{suffix} files (it writes {', '.join(sorted(formats))})"
    return None


def plot_file(text: str) -> str:
    """argparse ``type=`` of every ``--plot``: a writable file (:func:`output_file`) that matplotlib can draw
    (:func:`plot_problem`); checked at parse time, so a bad one costs no work and loses no result."""
    output_file(text)
    problem = plot_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text


def input_file(text: str) -> str:
    """argparse ``type=``: an existing, readable file (not a folder); checked at parse time."""
    target = Path(text)
    if not target.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if target.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder, not a file")
    if not os.access(target, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: is not readable")
    return text


def add_progress_flags(parser: Any) -> None:
    """``--progress`` / ``--no-progress`` (dest ``progress``: ``True``, ``False`` or ``None``, the default).

    ``None`` means a bar only when stderr is a terminal: tqdm's ``disable=None`` (:func:`bar_disable`), so a
    redirected stderr receives no bars."""
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="always show progress bars")
    bar.add_argument(
        "--no-progress", dest="progress", action="store_false", help="never show them (default: on a terminal)"
    )


def bar_disable(progress: bool | None) -> bool | None:
    """tqdm's ``disable`` for a ``progress`` flag: ``None`` (only when stderr is a terminal) stays ``None``."""
    return None if progress is None else not progress


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend; ``RuntimeError`` naming the ``plot`` extra when
    matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - matplotlib is installed in the test environment
        raise RuntimeError(
            "plotting needs matplotlib: pip install 'adadiag-ref[plot]' (or pip install matplotlib)"
        ) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def check_output_file(path: str, flag: str) -> None:
    """Refuse, before any work, an output file whose folder is missing or read-only, or which names a folder.

    Raises ``ValueError`` naming ``flag`` and ``path``."""
    problem = _output_problem(path)
    if problem:
        raise ValueError(f"{flag} {path}: {problem}")


def cpu_name(fallback: str | None = None) -> str:
    """The processor's model name (``/proc/cpuinfo``'s ``model name``) for the machine lines of reports, else
    ``fallback`` (``platform.processor()`` when ``None``)."""
    name = platform.processor() if fallback is None else fallback
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    return name
