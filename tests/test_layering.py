"""The library's import structure, read from the source (``ast``), not from a running interpreter.

Every module of ``adadiag_ref`` and ``adapters`` (installed as ``adadiag_ref.adapters``)
belongs to one floor; a module imports only from its own floor or the floors below.
Every import counts, also one inside a function (a lazy import) or under
``TYPE_CHECKING``: hiding an import in a function does not change the design.
Neither modules nor packages import each other in a circle.

Floors, from the bottom:

0. foundation: ``_xp``, ``config``, ``linalg``, ``_kernels``, ``buffers``, ``_cli`` (array
   namespaces, frozen configs, decompositions, numba kernels, the output-buffer pool, CLI error plumbing);
1. optimizer: ``optim`` (families with their state types, rotation, schedules, layout, the engine,
   core, in place), ``memory``, ``replay``;
2. the public facade ``adadiag_ref`` (``__init__``: re-exports floors 0-1);
3. tools built on the optimizer: ``golden``, ``testing``, ``ode``, ``perf.allocator``,
   ``perf.params``;
4. framework adapters: ``adapters`` (torch, optax);
5. applications: the command lines (``cli``, ``golden.cli``, ``ode.cli``, ``perf.cli``), ``perf.bench`` (with its
   sections ``perf.refresh`` and ``perf.steady``), ``perf.gpu`` (``bench --gpu``),
   ``report`` and ``reproduce`` (which trains through the torch adapter).

The library also reads no environment variable and never ends the process: ``SystemExit`` and
``sys.exit`` appear only in ``_cli.py`` (argparse's ``error`` must not return) and in
``if __name__ == "__main__":`` blocks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "adadiag_ref"

FLOORS: tuple[tuple[str, ...], ...] = (
    ("_xp", "config", "linalg", "_kernels", "buffers", "_cli"),
    ("optim", "memory", "replay"),
    ("",),  # the package's __init__ (the public facade)
    ("golden", "testing", "ode", "perf", "perf.allocator", "perf.params"),
    ("adapters",),
    (
        "cli",
        "golden.cli",
        "golden.conform",
        "pytest_plugin",
        "ode.cli",
        "perf.cli",
        "perf.bench",
        "perf.refresh",
        "perf.steady",
        "perf.gpu",
        "report",
        "reproduce",
    ),
)


def _module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the package and of ``adapters/``."""
    files = {}
    for folder, prefix in ((ROOT / PACKAGE, [PACKAGE]), (ROOT / "adapters", [PACKAGE, "adapters"])):
        for path in sorted(folder.rglob("*.py")):
            parts = prefix + list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


MODULES = _module_files()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str, tree: ast.AST) -> set[str]:
    """Every module of the library that ``name`` imports, wherever the import statement stands."""
    package = name.split(".") if _is_package(name) else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            source = ".".join(p for p in (base, node.module or "") if p)
            # "from pkg import sub" imports the module pkg.sub; "from pkg import name" imports pkg
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        for target in targets:
            while target and target not in MODULES:  # "adadiag_ref.optim.core.update" -> the module
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, ast.parse(path.read_text(), str(path))) for name, path in MODULES.items()}


def floor_of(name: str) -> int:
    """The floor of ``name``: that of the longest entry of :data:`FLOORS` naming it or a package above it."""
    relative = name[len(PACKAGE) + 1 :] if name != PACKAGE else ""
    best: tuple[int, int] | None = None
    for level, entries in enumerate(FLOORS):
        for entry in entries:
            if relative == entry or (entry and relative.startswith(entry + ".")):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), level)
    if best is None:
        raise KeyError(f"{name} is on no floor: add it to FLOORS in tests/test_layering.py")
    return best[1]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package_graph() -> dict[str, set[str]]:
    """Modules merged into their top-level package (``adadiag_ref.golden.verify`` -> ``adadiag_ref.golden``)."""

    def unit(name: str) -> str:
        parts = name.split(".")
        if parts[:2] == [PACKAGE, "adapters"]:
            return f"{PACKAGE}.adapters"
        return ".".join(parts[:2])

    merged: dict[str, set[str]] = {}
    for name, deps in GRAPH.items():
        merged.setdefault(unit(name), set()).update(unit(d) for d in deps if unit(d) != unit(name))
    return merged


def test_every_module_is_on_a_floor() -> None:
    assert len(MODULES) > 40  # the whole library was found
    for name in MODULES:
        floor_of(name)


def test_no_import_runs_up_a_floor() -> None:
    upward = [
        f"{name} (floor {floor_of(name)}) imports {dep} (floor {floor_of(dep)})"
        for name, deps in sorted(GRAPH.items())
        for dep in sorted(deps)
        if floor_of(dep) > floor_of(name)
    ]
    assert not upward, "\n".join(upward)


def _reachable_above_the_foundation(start: str) -> set[str]:
    """Every module ``start`` imports, directly or through modules above floor 0 (the foundation's own lazy
    imports, such as ``_xp``'s numba finiteness scan, are foundation business)."""
    seen, todo = set(), [start]
    while todo:
        for dep in GRAPH.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                if floor_of(dep) > 0:
                    todo.append(dep)
    return seen


FAMILY_PACKAGES = sorted(
    name for name in MODULES if name.count(".") == 3 and name.startswith(f"{PACKAGE}.optim.families.") and
    _is_package(name)
)  # fmt: skip


def test_every_family_package_has_a_reference_and_its_routes_beside_it() -> None:
    assert {p.rsplit(".", 1)[1] for p in FAMILY_PACKAGES} >= {"adam", "adafactor", "hfac"}
    for package in FAMILY_PACKAGES:
        assert f"{package}.reference" in MODULES, package
        routes = [m for m in MODULES if m.startswith(f"{package}.") and m.endswith("_route")]
        assert routes, f"{package} has no route module"


@pytest.mark.parametrize("package", FAMILY_PACKAGES)
def test_the_reference_path_does_not_import_the_fast_path(package: str) -> None:
    # a family's reference (and what it builds on) never reaches a kernel or a route: routes sit beside it
    reached = _reachable_above_the_foundation(f"{package}.reference") | {f"{package}.reference"}
    fast = sorted(m for m in reached if m.startswith(f"{PACKAGE}._kernels") or m.endswith(("_route", "inplace")))
    assert not fast, f"{package}.reference reaches {fast}"


REFERENCE_DRIVER = [f"{PACKAGE}.optim.{m}" for m in ("core", "rotation", "layout", "schedules", "tail", "inplace")]
"""The reference's own modules: ``init``, ``refresh_basis``, ``update``, ``step``, ``update_in_place`` and what they
are made of (the families' ``reference.py`` are checked above)."""

FAST_PATH = ("_route", "_group", ".engine", ".blas_threads", ".batched_refresh", ".dispatch", f"{PACKAGE}._kernels")


@pytest.mark.parametrize("name", REFERENCE_DRIVER)
def test_the_reference_driver_tries_no_route(name: str) -> None:
    # the reference is the paper's equations: it imports no engine, route or kernel module and never reads a
    # family's Routes table (only the engine runs the routes, adadiag_ref/optim/engine.py)
    fast = sorted(m for m in GRAPH[name] if m.endswith(FAST_PATH) or m.startswith(FAST_PATH[-1]))
    assert not fast, f"{name} imports {fast}"
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    reads = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "routes"]
    assert not reads, f"{name} reads a family's routes at lines {reads}"


def _documented_modules() -> set[str]:
    """The modules docs/api.md documents (``scripts/gen_api.py``'s ``MODULES``, read from its source) and the
    family packages (``optim.families.<family>``: a family's ``SPEC`` and state types)."""
    tree = ast.parse((ROOT / "scripts" / "gen_api.py").read_text())
    listed = next(
        node.value for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODULES" for t in node.targets)
    )  # fmt: skip
    return {elt.value for elt in listed.elts} | set(FAMILY_PACKAGES)  # type: ignore[attr-defined]


def _adapter_imports() -> list[tuple[str, str, str]]:
    """``(adapter file, module, name)`` of every ``from adadiag_ref... import name`` in ``adapters/``."""
    found = []
    for path in sorted((ROOT / "adapters").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE):
                found += [(path.name, node.module or "", alias.name) for alias in node.names]
    return found


def test_the_adapters_import_only_public_names() -> None:
    # the adapters are shells over the public API: every name they import is in the __all__ of a module the API
    # reference documents (or is such a module); no kernel module enters them (their engines run the kernels)
    import importlib

    public = _documented_modules()
    private = []
    for where, module, name in _adapter_imports():
        target = f"{module}.{name}"
        ok = target in public or (module in public and name in getattr(importlib.import_module(module), "__all__", ()))
        if not ok:
            private.append(f"{where}: from {module} import {name}")
    assert not private, private
    assert _adapter_imports(), "the test reads no import"


def _documented_floors() -> list[set[str]]:
    """The floor table of docs/architecture.md, as sets of module names relative to the package."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| floor | modules |") :].split("\n\n", 1)[0]
    floors = []
    for row in table.splitlines()[2:]:
        cells = row.strip("|").split("|")
        names = {"" if n == f"{PACKAGE}/__init__.py" else n for n in cells[1].split("`")[1::2]}
        floors.append(names)
    return floors


def test_the_architecture_page_lists_the_floors_this_test_enforces() -> None:
    assert _documented_floors() == [set(entries) for entries in FLOORS]


def test_no_import_cycle_between_modules() -> None:
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH) or [])


def test_no_import_cycle_between_packages() -> None:
    graph = _package_graph()
    assert f"{PACKAGE}.golden" in graph and f"{PACKAGE}.testing" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    # the detectors themselves: a lazy import inside a function counts like any other
    tree = ast.parse("def f():\n    from ..report import run_report\n")
    deps = _imports(f"{PACKAGE}.optim.core", tree)
    assert deps == {f"{PACKAGE}.report"} and floor_of(f"{PACKAGE}.report") > floor_of(f"{PACKAGE}.optim.core")
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# ----------------------------------------------------------------------------- what library code never does


def _main_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if __name__ == "__main__":`` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
        ):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


EXITS = {"SystemExit", "sys.exit", "exit", "quit", "os._exit"}
ENVIRONMENT = {"os.environ", "os.environb", "os.getenv", "os.getenvb", "os.putenv", "environ", "getenv"}

KNOWN_ENVIRONMENT_READS: set[tuple[str, str]] = set()


def _findings(source: str, names: set[str], *, skip_main: bool) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    skipped = _main_blocks(tree) if skip_main else set()
    hits = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Name | ast.Attribute) and _dotted(node) in names:
            hits.append((node.lineno, _dotted(node)))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            hits += [(node.lineno, a.name) for a in node.names if a.name in names]
    return hits


@pytest.mark.parametrize("name", sorted(MODULES))
def test_library_code_never_exits(name: str) -> None:
    path = MODULES[name]
    if name == f"{PACKAGE}._cli":  # the one place: argparse's error() must not return
        return
    hits = _findings(path.read_text(), EXITS, skip_main=True)
    assert not hits, f"{path.relative_to(ROOT)}: {hits}: raise an exception; the CLI turns it into an exit status"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_library_reads_no_environment_variable(name: str) -> None:
    path = MODULES[name]
    source = path.read_text()
    lines = source.splitlines()
    relative = path.relative_to(ROOT).as_posix()
    hits = [
        (line, what)
        for line, what in _findings(source, ENVIRONMENT, skip_main=False)
        if not any(relative == f and var in lines[line - 1] for f, var in KNOWN_ENVIRONMENT_READS)
    ]
    assert not hits, f"{relative}: {hits}: choose behaviour through a config option or an argument"


def test_the_source_checks_see_what_they_forbid() -> None:
    exits = (
        "import sys\ndef f():\n    raise SystemExit(2)\ndef g():\n    sys.exit(1)\n"
        "if __name__ == '__main__':\n    sys.exit(0)\n"
    )
    assert _findings(exits, EXITS, skip_main=True) == [(3, "SystemExit"), (5, "sys.exit")]
    env = "import os\nfrom os import getenv\nA = os.environ.get('X')\nB = os.getenv('Y')\n"
    assert sorted(_findings(env, ENVIRONMENT, skip_main=False)) == [(2, "getenv"), (3, "os.environ"), (4, "os.getenv")]
