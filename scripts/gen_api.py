"""Write docs/api.md, the API reference, from the docstrings of the public modules.

    python scripts/gen_api.py           # rewrite docs/api.md
    python scripts/gen_api.py --check   # exit 1 if docs/api.md is stale (tests/test_api_docs.py does this)

Covered: every name in ``__all__`` of the modules below, in that order; an object already documented under an
earlier module (``adadiag_ref.config.make_config`` is ``adadiag_ref.make_config``) gets a one-line pointer to
that entry instead of a second copy.  The framework adapters are described in docs/adapters.md; their entries
here need torch and optax installed.  The page depends only on the source (signatures and docstrings), not on
the machine, and is written from a fresh interpreter: an optimizer registered before the adapters are imported
becomes their attribute (tests/test_api_docs.py runs this script in a subprocess).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "api.md"
MODULES = (
    "adadiag_ref",
    "adadiag_ref.buffers",
    "adadiag_ref.testing",
    "adadiag_ref.golden",
    "adadiag_ref.golden.conform",
    "adadiag_ref.ode",
    "adadiag_ref.report",
    "adadiag_ref.config",
    "adadiag_ref.linalg",
    "adadiag_ref.optim",
    "adadiag_ref.optim.families",
    "adadiag_ref.adapters.pytorch",
    "adadiag_ref.adapters.optax",
)


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    text = re.sub(r"ForwardRef\('([^']*)'\)", r"'\1'", text)  # NamedTuple fields under postponed annotations
    return re.sub(r"<function (\S+) at 0x[0-9a-f]+>", r"\1", text)  # a function default: its name, not its address


def _identity(obj: Any) -> int | None:
    """What makes two exported names one object to document once; ``None`` for a plain value (two equal numbers
    or strings are not the same thing)."""
    return None if isinstance(obj, (str, bytes, int, float, bool, type(None))) else id(obj)


def _entry(module_name: str, name: str, obj: Any) -> list[str]:
    if inspect.isclass(obj):
        kind = "class"
        doc = inspect.getdoc(obj) or ""
        head = f"{name}{_signature(obj)}"
    elif callable(obj):
        kind = "function"
        doc = inspect.getdoc(obj) or ""
        head = f"{name}{_signature(obj)}"
    else:  # a constant: its type, and its value when short
        kind = "constant"
        doc = ""
        text = repr(obj)
        head = f"{name}: {type(obj).__name__}" + (f" = {text}" if len(text) <= 80 else "")
    lines = [f"### `{module_name}.{name}` ({kind})", "", "```text", head, "```", ""]
    if doc:
        lines += [doc, ""]
    return lines


ENTRY_POINTS = [
    "## Which entry point is for what",
    "",
    "| entry point | what it does | use it for |",
    "|---|---|---|",
    "| `step(state, G, cfg, W)` | checks the input, refreshes the basis when due, updates; returns `(W_next, state)` "
    "| an eager training loop of your own (the reference driver) |",
    "| `step(..., out=buffer)` | the same bits, `W_next` written into `buffer`; the state's moments may be "
    "updated in place | a driver that owns the state (`replay` is one) |",
    "| `refresh_basis`, `update` | the two pure halves of `step` (`update` never refreshes); `update` returns "
    "`(delta, state)` | `jax.jit`, custom schedules, your own refresh policy |",
    "| `Engine(params, cfg)`, `engine.step(grads, params)` | a stateful optimizer over a whole model: flat state per "
    "group, host step counter, one finiteness read-back, batched rotations and refreshes, an entrywise family's "
    "arithmetic once per flat group; `engine.routes()` says which code runs | a whole model on a device backend "
    "(CuPy, CUDA torch), or any driver that steps many parameters |",
    "| `multi_step(states, grads, cfg, params, count=k)` | the engine's one step as a function of states: `step` of "
    "every parameter of a model in one call | a functional driver that keeps the states itself |",
    "| `refresh_bases(states, grads, cfg)` | `refresh_basis` of many parameters, one stacked decomposition per work "
    "shape | your own multi-parameter driver's refresh steps |",
    "| `update_in_place(state, G, cfg, W)` | `update` followed by `W += delta`, bit for bit, into the caller's "
    "buffers | frameworks with mutable tensors (the torch adapter) |",
    "| `optim.core.preconditioned_direction` | `P U~ Q^T` without step size or decay | optax-style `scale_by` blocks |",
    "| `replay(name, W0, grads, ...)` | a whole gradient stream through `step`; the trajectory | golden files, "
    "comparing another implementation step by step |",
    "| `check_inputs`, `refresh_due` | the checks and the schedule `step` applies | drivers built from the pure "
    "halves |",
    "",
]
"""The table at the top of the page (issue-level guidance no docstring holds)."""


def render() -> str:
    """The whole page, as a string."""
    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `python scripts/gen_api.py` (do not edit by hand; "
        "`tests/test_api_docs.py` fails when this page is stale). The equations are in [spec.md](spec.md); "
        "the framework adapters in [adapters.md](adapters.md); adding a family in [extending.md](extending.md).",
        "",
        *ENTRY_POINTS,
    ]
    documented: dict[int, str] = {}  # object identity -> where its entry is
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        out += [f"## `{module_name}`", ""]
        summary = (inspect.getdoc(module) or "").split("\n\n")[0]
        if summary:
            out += [summary, ""]
        pointers = []
        for name in module.__all__:
            if name.startswith("__"):
                continue
            obj, key = getattr(module, name), f"{module_name}.{name}"
            identity = _identity(obj)
            if identity in documented:
                pointers.append(f"- `{key}`: the same object as `{documented[identity]}`")
                continue
            if identity is not None:
                documented[identity] = key
            out += _entry(module_name, name, obj)
        if pointers:
            out += ["Also exported here, documented above:", "", *pointers, ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from the docstrings")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run python scripts/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
