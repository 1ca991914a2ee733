"""``adadiag-ref golden {generate,verify}`` and ``adadiag-ref replay``.

``replay`` makes the reference usable from any language through files::

    adadiag-ref replay --optimizer adadiag --config '{"lr": 0.01, "update_freq": 4}' \\
        --input in.npz --output out.npz

``in.npz`` holds ``w0`` (shape ``S``) and ``grads`` (shape ``(K, *S)``, any
float dtype; the run uses the dtype of ``w0``).  ``out.npz`` receives
``params`` (``(K, *S)``, ``params[t-1] = W_{t+1}``), ``state_FIELD`` (the
state after every step, work frame), ``w0``, ``config`` (the full config as a
JSON string), ``library_version`` and ``conditioning`` (``(K,)``: ``kappa_t``, how well
the bases of step ``t`` are determined, docs/golden.md "Tolerances").  Every golden ``.npz`` is a valid
``in.npz``, and its manifest entry gives the optimizer and config (as do the
``optimizer`` and ``config`` entries of an ``adadiag-ref conform`` input, so
``replay`` is itself a ``--cmd`` port); ``--optimizer`` and ``--config``
override them.
"""

from __future__ import annotations

import argparse
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from .._cli import INPUT_ERRORS, ErrorParser, fail, input_file, output_file, parse_and_run
from ..config import OPTIMIZERS, make_config
from ..replay import trajectory_conditioning
from .format import api_config, config_from_dict, config_to_dict, default_data_dir, load_manifest
from .generator import generate, run_core, stack_states
from .verify import verify

__all__ = ["add_parser", "main", "run_generate", "run_replay", "run_verify"]


def run_generate(args: argparse.Namespace) -> int:
    out = generate(args.out)
    files = sorted(out.iterdir())
    total = sum(f.stat().st_size for f in files if f.is_file())
    print(f"wrote {len(files)} files ({total / 1024:.1f} KiB) to {out}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """Exit 0 when every case matches, 1 when one does not, 2 when the set is missing, empty or unreadable."""
    directory = Path(args.dir) if args.dir else default_data_dir()
    if not directory.is_dir():
        return fail(f"golden verify: no fixture directory {directory}")
    try:
        results = verify(directory)
    except (*INPUT_ERRORS,) as exc:
        return fail(f"golden verify: cannot read the fixture set in {directory}: {exc}")
    if not results:
        return fail(f"golden verify: the fixture set in {directory} holds no cases")
    failed = [r for r in results if not r.passed]
    for result in results:
        if args.verbose or not result.passed:
            print(result.summary())
    print(f"{len(results) - len(failed)}/{len(results)} golden cases match the live core ({directory})")
    return 1 if failed else 0


def _parse_config(text: str | None) -> dict[str, Any]:
    """``--config``: a JSON object, or ``@path`` / a path of a file holding one."""
    if not text:
        return {}
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    elif not text.lstrip().startswith("{") and Path(text).is_file():
        text = Path(text).read_text()
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("--config must be a JSON object")
    return value


def _stored_config(path: str, keys: list[str], data: Any) -> tuple[str | None, dict[str, Any]]:
    """The optimizer and config an input carries: ``optimizer`` and ``config`` entries (``adadiag-ref conform``'s
    input), or the manifest entry of a fixture file (the ``manifest.json`` beside it); ``(None, {})`` otherwise."""
    if "optimizer" in keys and "config" in keys:
        return str(data["optimizer"]), json.loads(str(data["config"]))
    try:
        manifest = load_manifest(Path(path).parent)
    except (OSError, ValueError):  # no fixture set there: a plain w0 + grads input
        return None, {}
    entries = [e for e in manifest["cases"] if e.get("file") == Path(path).name]
    return (entries[0]["optimizer"], entries[0]["config"]) if entries else (None, {})


def run_replay(args: argparse.Namespace) -> int:
    """Exit 0 on success, 2 (one line on stderr) for a bad config, a missing or corrupt input or bad values.

    The optimizer and config come from the input when it carries them (a fixture ``.npz``, or a conform input
    with ``optimizer`` and ``config``); ``--optimizer`` and the keys of ``--config`` override them."""
    if not zipfile.is_zipfile(args.input):  # numpy would call a text file "pickled (object) data"
        return fail(f"replay: --input {args.input} is not an .npz file (a zip of arrays, as np.savez writes)")
    try:
        with np.load(args.input, allow_pickle=False) as data:
            missing = [k for k in ("w0", "grads") if k not in data.files]
            if missing:
                return fail(f"replay: {args.input} lacks {', '.join(missing)} (it needs w0 and grads)")
            w0 = np.asarray(data["w0"])
            grads = np.asarray(data["grads"])
            stored_optimizer, stored = _stored_config(args.input, list(data.files), data)
    except (*INPUT_ERRORS,) as exc:
        return fail(f"replay: cannot read {args.input}: {type(exc).__name__}: {exc}")
    optimizer = args.optimizer or stored_optimizer
    if optimizer is None:
        return fail(f"replay: --optimizer is needed ({args.input} names no optimizer)")
    if optimizer != stored_optimizer:
        stored = {}  # another optimizer's hyperparameters do not carry over
    try:
        options = {**api_config(optimizer, stored), **api_config(optimizer, _parse_config(args.config))}
        # a stored config is a golden case's: its refresh route is the reference's (format.GOLDEN_BASIS_METHOD)
        cfg = config_from_dict(optimizer, options) if stored else make_config(optimizer, **options)
    except (*INPUT_ERRORS,) as exc:
        return fail(f"replay: bad config: {exc}")
    if w0.dtype not in (np.float32, np.float64) or w0.size == 0:
        return fail(f"replay: w0 must be a non-empty float32 or float64 array, got {w0.dtype} of shape {w0.shape}")
    if grads.ndim < 1 or grads.shape[1:] != w0.shape or grads.dtype.kind not in "fiu":
        return fail(f"replay: grads have shape {grads.shape} ({grads.dtype}), expected real (K, *{w0.shape})")
    steps = range(1, grads.shape[0] + 1)
    try:
        params, states = run_core(cfg, w0, grads.astype(w0.dtype), steps)
    except ValueError as exc:
        return fail(f"replay: {exc}")
    arrays = {
        "params": params,
        "w0": w0,
        "config": np.array(json.dumps({"optimizer": optimizer, **config_to_dict(cfg)})),
        "library_version": np.array(__version__),
        "conditioning": trajectory_conditioning(cfg, grads),  # kappa_t: how well step t's bases are determined
        **stack_states(states, steps),
    }
    np.savez(args.output, **arrays)  # type: ignore[arg-type]
    print(f"wrote {params.shape[0]} steps of {optimizer} to {args.output}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Register the ``golden`` and ``replay`` subcommands on an argparse ``subparsers`` object."""
    golden = subparsers.add_parser("golden", help="generate or verify the golden fixture set")
    golden_sub = golden.add_subparsers(dest="golden_command", required=True)
    gen = golden_sub.add_parser("generate", help="write the fixture set (deterministic, seeded)")
    gen.add_argument("--out", default=None, help="output directory (default: the package's golden/data)")
    gen.set_defaults(func=run_generate)
    ver = golden_sub.add_parser("verify", help="check a fixture set against the live core")
    ver.add_argument("dir", nargs="?", default=None, help="fixture directory (default: the shipped set)")
    ver.add_argument("-v", "--verbose", action="store_true", help="print every case, not only failures")
    ver.set_defaults(func=run_verify)

    replay = subparsers.add_parser("replay", help="run an optimizer on w0 and grads from a file")
    replay.add_argument(
        "--optimizer", default=None, choices=list(OPTIMIZERS), help="default: the input's (a fixture or conform input)"
    )
    replay.add_argument(
        "--config", default=None, help="JSON object of config fields, or @file.json (overrides the input's keys)"
    )
    replay.add_argument("--input", required=True, type=input_file, help=".npz with w0 (S) and grads (K, *S)")
    replay.add_argument("--output", required=True, type=output_file, help=".npz to write params (K, *S) to")
    replay.set_defaults(func=run_replay)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (used by the tests): ``main(["golden", "verify"])``."""
    parser = ErrorParser(prog="adadiag-ref")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parse_and_run(parser, argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
