"""Make ``adadiag_ref.adapters`` importable from a source checkout.

The ``adapters/`` folder is installed as ``adadiag_ref.adapters`` through
``package-dir`` in pyproject.toml.  When the package is imported from the
source tree (or from an editable install whose ``packages.find`` does not list
the mapped package), that name does not resolve; this registers it from the
folder so the adapter tests run either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ADAPTERS_DIR = Path(__file__).resolve().parent.parent / "adapters"


def ensure_adapters() -> ModuleType:
    """Import ``adadiag_ref.adapters``, registering it from ``adapters/`` when needed."""
    try:
        return importlib.import_module("adadiag_ref.adapters")
    except ModuleNotFoundError:
        pass
    import adadiag_ref

    spec = importlib.util.spec_from_file_location(
        "adadiag_ref.adapters", ADAPTERS_DIR / "__init__.py", submodule_search_locations=[str(ADAPTERS_DIR)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["adadiag_ref.adapters"] = module
    spec.loader.exec_module(module)
    adadiag_ref.adapters = module  # type: ignore[attr-defined]
    return module


ensure_adapters()
