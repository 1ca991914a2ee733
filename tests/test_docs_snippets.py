"""Every ```python block in README.md and docs/*.md runs as written.

The blocks of one file run in order in one namespace (a later block may use names defined by an earlier one),
so a page reads as one session a newcomer can paste.  A failure names the file and the line of the block.
Anything that is not runnable Python (signatures, pseudo-code, shell) belongs in another fence.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
_FENCE = re.compile(r"^```(\S*)\s*$")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(first line number, source)`` of every ```python block of a Markdown file, in order."""
    blocks: list[tuple[int, str]] = []
    lang: str | None = None
    start = 0
    lines: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _FENCE.match(line.strip())
        if lang is None:
            if match:
                lang, start, lines = match.group(1), number, []
        elif line.strip() == "```":
            if lang == "python":
                blocks.append((start, "\n".join(lines) + "\n"))
            lang = None
        else:
            lines.append(line)
    assert lang is None, f"{path.name}: unterminated fence opened at line {start}"
    return blocks


def test_snippet_extraction_sees_fences_and_skips_other_languages(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 1\n```\n```text\nnot python\n```\n```python\ny = x + 1\n```\n")
    assert python_blocks(page) == [(2, "x = 1\n"), (8, "y = x + 1\n")]


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_as_written(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(path)
    if not blocks:
        pytest.skip(f"{path.name} has no python blocks")
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    (tmp_path / "docs").symlink_to(ROOT / "docs")  # and read the committed results as from the repository root
    monkeypatch.setenv("MPLBACKEND", "Agg")
    module = types.ModuleType("__docs__")  # a real module: dataclasses defined in a snippet look theirs up
    monkeypatch.setitem(sys.modules, "__docs__", module)
    namespace: dict[str, object] = module.__dict__
    rel = path.relative_to(ROOT)
    for line, source in blocks:
        try:
            code = compile(source, f"{rel}:{line}", "exec")
            exec(code, namespace)
        except (Exception, SystemExit) as exc:  # any failure of the snippet, sys.exit included
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            pytest.fail(f"{rel}, python block at line {line} fails: {detail}\n{traceback.format_exc()}")
    assert os.getcwd() == str(tmp_path)
