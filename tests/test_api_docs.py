"""docs/api.md is generated from the docstrings and must be fresh (regenerate: python scripts/gen_api.py).

Both checks read the page as a fresh interpreter renders it (a subprocess): the adapters make an attribute of
every optimizer registered before their import, so a page rendered inside the test session would depend on the
tests run before (tests/test_extending.py registers a family).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PUBLIC_MODULES = (
    "adadiag_ref",
    "adadiag_ref.buffers",
    "adadiag_ref.testing",
    "adadiag_ref.golden",
    "adadiag_ref.ode",
    "adadiag_ref.report",
    "adadiag_ref.config",  # OptimizerSpec
    "adadiag_ref.linalg",  # set_decomposition_budget
    "adadiag_ref.optim.families",  # register_family, FamilySpec, Flow
    "adadiag_ref.adapters.pytorch",  # CoreOptimizer
    "adadiag_ref.adapters.optax",  # core_alias, scale_by_core, core_states
)
"""Every name in the ``__all__`` of these must have its entry on the page (held here, apart from the
generator's list, so a module dropped from it fails)."""

_RENDER = """
import importlib, importlib.util, json, sys
sys.path.insert(0, {tests!r})
from _adapter_import import ensure_adapters
ensure_adapters()
spec = importlib.util.spec_from_file_location("gen_api", {script!r})
gen_api = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_api)
public = {{name: list(importlib.import_module(name).__all__) for name in {modules!r}}}
print(json.dumps({{"page": gen_api.render(), "public": public}}))
"""


@pytest.fixture(scope="module")
def rendered() -> dict:
    """The page and the public names, from a fresh interpreter."""
    pytest.importorskip("torch", reason="the page documents the torch adapter")
    pytest.importorskip("optax", reason="the page documents the optax adapter")
    script = ROOT / "scripts" / "gen_api.py"
    code = _RENDER.format(tests=str(ROOT / "tests"), script=str(script), modules=PUBLIC_MODULES)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_api_reference_is_fresh(rendered: dict) -> None:
    current = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert current == rendered["page"], "docs/api.md is stale: run python scripts/gen_api.py"


def test_api_reference_covers_every_public_name(rendered: dict) -> None:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    missing = [
        f"{module}.{name}"
        for module, names in rendered["public"].items()
        for name in names
        if not name.startswith("__") and f"`{module}.{name}`" not in text  # its entry, or a pointer to it
    ]
    assert not missing, f"not in docs/api.md: {', '.join(missing)}"
