"""docs/api.md is generated from the docstrings and must be fresh (regenerate: python scripts/gen_api.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "scripts" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_fresh() -> None:
    expected = _generator().render()
    current = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert current == expected, "docs/api.md is stale: run python scripts/gen_api.py"


def test_api_reference_covers_every_public_name() -> None:
    import adadiag_ref
    import adadiag_ref.ode

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for module in (adadiag_ref, adadiag_ref.ode):
        for name in module.__all__:
            if not name.startswith("__"):
                assert f"### `{module.__name__}.{name}`" in text, name
