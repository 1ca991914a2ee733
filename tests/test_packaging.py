"""Packaging: licence, package list, the adapters' install hints, and a wheel build without warnings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import adadiag_ref
from adadiag_ref.golden import load_manifest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_is_an_spdx_expression_with_its_file() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License") and "the adadiag-ref developers" in text


def test_version_has_one_source() -> None:
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "adadiag_ref.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", adadiag_ref.__version__)
    assert f"## [{adadiag_ref.__version__}]" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def test_every_folder_of_the_package_is_listed() -> None:
    """setuptools warns about (and may drop) a folder with files that is not in ``packages``."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    package = ROOT / "adadiag_ref"
    folders = {
        ".".join(("adadiag_ref", *d.relative_to(package).parts))
        for d in [package, *package.rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(f.is_file() for f in d.iterdir())
    }
    assert folders | {"adadiag_ref.adapters"} == listed


def test_cuda_extras_are_the_cupy_wheels_of_cuda_12_and_13() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert [re.split(r"[<>=!~ ]", r)[0] for r in extras["cuda"]] == ["cupy-cuda12x"]
    assert [re.split(r"[<>=!~ ]", r)[0] for r in extras["cuda13"]] == ["cupy-cuda13x"]
    assert {"torch", "jax", "cuda", "numba", "plot", "test"} <= set(extras)


_IMPORT_WITHOUT = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # what an environment without the framework looks like to import
sys.path.insert(0, {tests!r})
from _adapter_import import ensure_adapters
ensure_adapters()
import importlib
try:
    importlib.import_module({module!r})
except ImportError as exc:
    print(exc)
else:
    print("imported")
"""


@pytest.mark.parametrize(
    ("module", "blocked", "command"),
    [
        ("adadiag_ref.adapters.pytorch", ["torch"], 'pip install "adadiag-ref[torch]"'),
        ("adadiag_ref.adapters.optax", ["jax"], 'pip install "adadiag-ref[jax]"'),
        ("adadiag_ref.adapters.optax", ["optax"], 'pip install "adadiag-ref[jax]"'),
    ],
)
def test_adapter_without_its_framework_names_the_install_command(module: str, blocked: list[str], command: str) -> None:
    code = _IMPORT_WITHOUT.format(blocked=blocked, tests=str(ROOT / "tests"), module=module)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert command in out, out


@pytest.mark.slow  # builds in an isolated environment: pip fetches setuptools from the index (about 10 s)
def test_wheel_and_sdist_build_without_warnings(tmp_path: Path) -> None:
    pytest.importorskip("build")
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # it makes setuptools print "byte-compiling is disabled" warnings
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    warnings = [line for line in log.splitlines() if re.search(r"warn|deprecat", line, re.IGNORECASE)]
    assert not warnings, "\n".join(warnings)
    (wheel,) = tmp_path.glob("*.whl")
    assert len(list(tmp_path.glob("*.tar.gz"))) == 1
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(f"adadiag_ref-{adadiag_ref.__version__}.dist-info/METADATA").decode()
    assert "adadiag_ref/golden/data/manifest.json" in names
    shipped = len(load_manifest()["cases"])
    assert sum(n.startswith("adadiag_ref/golden/data/") and n.endswith(".npz") for n in names) == shipped
    assert {"adadiag_ref/adapters/pytorch.py", "adadiag_ref/adapters/optax.py", "adadiag_ref/py.typed"} <= names
    assert f"adadiag_ref-{adadiag_ref.__version__}.dist-info/licenses/LICENSE" in names
    assert "License-Expression: MIT" in metadata and f"Version: {adadiag_ref.__version__}" in metadata
