"""Every ```python block in README.md and docs/*.md runs as written, and prints what the page shows.

The blocks of one file run in order in one namespace (a later block may use names defined by an earlier one),
so a page reads as one session a newcomer can paste.  A failure names the file and the line of the block.
Anything that is not runnable Python (signatures, pseudo-code, shell) belongs in another fence.

Printed output, one convention: a ```output fence right after a ```python block (only blank lines between)
holds what that block prints to stdout, and the test compares it with what running the block printed
(trailing spaces and blank lines at the end aside).  ``...`` in an output block matches any text, as doctest's
ELLIPSIS does, for digits that differ between machines.  Output is never typed as a comment on a ``print``
line (``print(x)  # 12``): nothing would check it, so the test refuses such a comment; an explanation goes on
the line above, the output into the ```output block.

Test counts: a page that says how many tests a file holds writes it as "`tests/test_x.py` (N)"; N is checked
against what pytest collects from that file.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import subprocess
import sys
import tokenize
import traceback
import types
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
_FENCE = re.compile(r"^```(\S*)\s*$")
_TEST_COUNT = re.compile(r"`(tests/test_\w+\.py)` \((\d+)\)")


class Fence(NamedTuple):
    """A fenced block: its language, the line numbers of its opening and closing fence, and its text."""

    lang: str
    start: int
    end: int
    text: str


class Block(NamedTuple):
    """A ```python block and the ```output block right after it (``None`` when it has none)."""

    line: int
    source: str
    output: str | None


def fences(path: Path) -> list[Fence]:
    """Every fenced block of a Markdown file, in order."""
    found: list[Fence] = []
    lang: str | None = None
    start = 0
    lines: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _FENCE.match(line.strip())
        if lang is None:
            if match:
                lang, start, lines = match.group(1), number, []
        elif line.strip() == "```":
            found.append(Fence(lang, start, number, "\n".join(lines) + "\n"))
            lang = None
        else:
            lines.append(line)
    assert lang is None, f"{path.name}: unterminated fence opened at line {start}"
    return found


def doc_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a page with their ```output blocks; an output block after anything else is an error."""
    text_lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    previous: Fence | None = None
    for fence in fences(path):
        if fence.lang == "output":
            between = text_lines[previous.end : fence.start - 1] if previous is not None else ["(start of page)"]
            if previous is None or previous.lang != "python" or any(line.strip() for line in between):
                raise AssertionError(f"{path.name}: the output block at line {fence.start} follows no python block")
            blocks[-1] = blocks[-1]._replace(output=fence.text)
        elif fence.lang == "python":
            blocks.append(Block(fence.start, fence.text, None))
        previous = fence
    return blocks


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(first line number, source)`` of every ```python block of a Markdown file, in order."""
    return [(block.line, block.source) for block in doc_blocks(path)]


def commented_prints(source: str) -> list[int]:
    """Lines (1-based, in ``source``) of a ``print(...)`` statement with a comment: output typed by hand."""
    first: dict[int, str] = {}
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        row = token.start[0]
        first.setdefault(row, token.string)
        if token.type == tokenize.COMMENT and first[row] == "print":
            found.append(row)
    return found


def output_mismatch(want: str, got: str) -> str | None:
    """``None`` when ``got`` is what ``want`` shows (``...`` matching any text), else a readable difference."""

    def tidy(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.rstrip("\n").splitlines()) + "\n"

    checker, flags = doctest.OutputChecker(), doctest.ELLIPSIS
    if checker.check_output(tidy(want), tidy(got), flags):
        return None
    return checker.output_difference(doctest.Example("", tidy(want)), tidy(got), flags)


def run_page(path: Path, rel: str) -> list[str]:
    """Run a page's python blocks in one namespace; the problems found (a failing block, a wrong output)."""
    module = types.ModuleType("__docs__")  # a real module: dataclasses defined in a snippet look theirs up
    sys.modules["__docs__"] = module
    namespace: dict[str, object] = module.__dict__
    problems = []
    for block in doc_blocks(path):
        for row in commented_prints(block.source):
            problems.append(f"{rel}:{block.line + row}: a comment on a print line reads as its output, unchecked; "
                            "put the output in an ```output block after the python block")  # fmt: skip
        stdout = io.StringIO()
        try:
            code = compile(block.source, f"{rel}:{block.line}", "exec")
            with contextlib.redirect_stdout(stdout):
                exec(code, namespace)
        except (Exception, SystemExit) as exc:  # any failure of the snippet, sys.exit included
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            problems.append(f"{rel}, python block at line {block.line} fails: {detail}\n{traceback.format_exc()}")
            break
        if block.output is not None:
            difference = output_mismatch(block.output, stdout.getvalue())
            if difference:
                problems.append(f"{rel}, python block at line {block.line} prints other than its output block:\n"
                                f"{difference}")  # fmt: skip
    sys.modules.pop("__docs__", None)
    return problems


def test_snippet_extraction_sees_fences_and_skips_other_languages(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 1\n```\n```text\nnot python\n```\n```python\ny = x + 1\n```\n")
    assert python_blocks(page) == [(2, "x = 1\n"), (8, "y = x + 1\n")]


def test_output_blocks_are_compared_with_what_the_block_prints(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    right = "```python\nprint(6 * 7)\nprint(2 / 3)\n```\n\n```output\n42\n0.666...\n```\n"
    page.write_text(right)
    assert doc_blocks(page) == [Block(1, "print(6 * 7)\nprint(2 / 3)\n", "42\n0.666...\n")]
    assert run_page(page, "page.md") == []
    page.write_text(right.replace("42", "41"))
    (problem,) = run_page(page, "page.md")
    assert "prints other than its output block" in problem and "41" in problem and "42" in problem
    page.write_text("```python\nprint(42)  # 42\n```\n")
    (problem,) = run_page(page, "page.md")
    assert problem.startswith("page.md:2: a comment on a print line")
    page.write_text("```text\n$ ls\n```\n```output\nx\n```\n")
    with pytest.raises(AssertionError, match="follows no python block"):
        doc_blocks(page)
    assert commented_prints("print('#not a comment')\nx = 1  # fine\nprint(x)\n") == []


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_as_written(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not python_blocks(path):
        pytest.skip(f"{path.name} has no python blocks")
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    (tmp_path / "docs").symlink_to(ROOT / "docs")  # and read the committed results as from the repository root
    monkeypatch.setenv("MPLBACKEND", "Agg")
    problems = run_page(path, str(path.relative_to(ROOT)))
    if problems:
        pytest.fail("\n\n".join(problems))
    assert os.getcwd() == str(tmp_path)


def _collected(files: list[str]) -> dict[str, int]:
    """How many tests pytest collects from each file (a file skipped at import, a missing extra, collects none)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    counts = dict.fromkeys(files, 0)
    for line in proc.stdout.splitlines():
        name = line.split("::", 1)[0]
        if "::" in line and name in counts:
            counts[name] += 1
    return counts


def count_problems(paths: list[Path]) -> list[str]:
    """Every "`tests/test_x.py` (N)" of the pages whose N is not what pytest collects from that file."""
    claims = [(path, file, int(n)) for path in paths for file, n in _TEST_COUNT.findall(path.read_text())]
    if not claims:
        return []
    counts = _collected(sorted({file for _, file, _ in claims}))
    return [f"{path.name}: {file} ({n}), pytest collects {counts[file]}"
            for path, file, n in claims if counts[file] not in (n, 0)]  # fmt: skip


def test_test_counts_in_the_docs_are_the_collected_ones() -> None:
    assert count_problems(DOC_FILES) == []


def test_a_stale_test_count_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    right = _collected(["tests/test_refresh_size.py"])["tests/test_refresh_size.py"]
    assert right > 0
    page.write_text(f"* `tests/test_refresh_size.py` ({right}): ...\n* `tests/test_refresh_size.py` ({right + 1})\n")
    assert count_problems([page]) == [f"page.md: tests/test_refresh_size.py ({right + 1}), pytest collects {right}"]
