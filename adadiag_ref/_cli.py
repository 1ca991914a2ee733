"""Shared command-line plumbing: every usage or input error is one line on stderr and exit status 2.

``adadiag-ref: error: MESSAGE`` is the argparse convention (without the usage
block, which ``--help`` prints); a verification that runs and fails exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["INPUT_ERRORS", "ErrorParser", "check_output_file", "fail", "finite_positive", "positive_int", "run_parsed"]

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
"""What a command's bad input raises; :func:`run_parsed` turns them into one error line."""


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


def run_parsed(args: argparse.Namespace) -> int:
    """Call ``args.func(args)``; an input error becomes one line on stderr and exit status 2."""
    func: Callable[[argparse.Namespace], Any] = args.func
    try:
        return int(func(args))
    except INPUT_ERRORS as exc:
        if isinstance(exc, KeyError) and exc.args:
            return fail(str(exc.args[0]))
        return fail(str(exc) or type(exc).__name__)


def parse_and_run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """``parser.parse_args(argv)`` then :func:`run_parsed`."""
    return run_parsed(parser.parse_args(argv))


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


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1 (step counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def check_output_file(path: str, flag: str) -> None:
    """Refuse, before any work, an output file whose folder is missing or which names a folder (``ValueError``)."""
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: folder {str(folder)!r} does not exist")
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, not a file")
