"""pytest plugin: the golden conformance cases inside a user's own test suite.

Registered through the ``pytest11`` entry point of the package, so it is active wherever adadiag-ref is
installed (it does nothing unless asked).  Two ways to use it:

* ``pytest --adadiag-ref=pkg.mod:Class`` (a ``torch.optim.Optimizer`` class), ``--adadiag-ref=pkg.mod:factory
  --adadiag-ref-kind=optax`` (an optax factory) or ``--adadiag-ref-cmd="..."`` (a command of the
  ``adadiag-ref conform`` file protocol) adds one test per golden case, ``adadiag-ref::<case>``, run exactly
  as ``adadiag-ref conform`` runs it; ``--adadiag-ref-optimizer=NAME`` says which optimizer it implements
  when the name does not tell (default for a command: every case).
* the fixture ``adadiag_ref_case``: a test that takes it runs once per golden case (a
  :class:`~adadiag_ref.golden.GoldenCase`), optionally narrowed with ``@pytest.mark.adadiag_ref(optimizer=...,
  dtype=...)``; it then calls :func:`adadiag_ref.testing.assert_trajectory_close` on its own step function.
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["ConformanceItem"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("adadiag-ref", "golden conformance cases of adadiag-ref")
    group.addoption("--adadiag-ref", metavar="MOD:NAME", default=None, help="a port to check against every case")
    group.addoption(
        "--adadiag-ref-kind",
        choices=["torch", "optax"],
        default=None,
        help="the port's kind (default: a class is torch)",
    )
    group.addoption("--adadiag-ref-cmd", metavar="COMMAND", default=None, help="a command of the conform protocol")
    group.addoption("--adadiag-ref-optimizer", metavar="NAME", default=None, help="the optimizer(s) it implements")
    group.addoption("--adadiag-ref-dir", metavar="DIR", default=None, help="fixture directory (default: shipped)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "adadiag_ref(optimizer=None, dtype=None): narrow adadiag_ref_case")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``adadiag_ref_case``: one test per golden case (narrowed by the ``adadiag_ref`` marker)."""
    if "adadiag_ref_case" not in metafunc.fixturenames:
        return
    from .golden import load_cases

    marker = metafunc.definition.get_closest_marker("adadiag_ref")
    options = dict(marker.kwargs) if marker is not None else {}
    cases = load_cases(metafunc.config.getoption("adadiag_ref_dir"), **options)
    metafunc.parametrize("adadiag_ref_case", cases, ids=[c.name for c in cases])


class _Failed(Exception):
    """A case that did not conform; its report is the message."""


class ConformanceItem(pytest.Item):
    """One golden case run through the port (``runner``): fails with the comparison report."""

    def __init__(self, *, case: Any, runner: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case, self.runner = case, runner

    def runtest(self) -> None:
        report = self.runner(self.case)
        if not report.passed:
            raise _Failed(str(report))

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:  # type: ignore[override]
        if isinstance(excinfo.value, _Failed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int, str]:
        return "adadiag-ref", 0, f"adadiag-ref conformance: {self.name}"


class _Cases(pytest.Collector):
    def collect(self) -> list[Any]:  # the items are added by pytest_collection_modifyitems
        return []


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[Any]) -> None:
    """``--adadiag-ref`` / ``--adadiag-ref-cmd``: append one item per case of the port's optimizer(s)."""
    target, command = config.getoption("adadiag_ref"), config.getoption("adadiag_ref_cmd")
    if target is None and command is None:
        return
    from .golden.conform import load_object, port_runner, select_cases

    if command is not None:
        kind, spec = "cmd", command
    else:
        kind = config.getoption("adadiag_ref_kind") or ("torch" if isinstance(load_object(target), type) else "optax")
        spec = target
    try:
        runner, inferred = port_runner(kind, spec)
    except ValueError as exc:
        raise pytest.UsageError(f"--adadiag-ref: {exc}") from None
    chosen = config.getoption("adadiag_ref_optimizer")
    optimizers = chosen.split(",") if chosen else inferred
    if optimizers is None and kind != "cmd":
        raise pytest.UsageError(f"--adadiag-ref: say which optimizer {spec} implements: --adadiag-ref-optimizer=NAME")
    parent = _Cases.from_parent(session, name="adadiag-ref", nodeid="adadiag-ref")
    for case in select_cases(config.getoption("adadiag_ref_dir"), optimizers, None, None):
        items.append(ConformanceItem.from_parent(parent, name=case.name, case=case, runner=runner))
