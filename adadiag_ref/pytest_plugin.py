"""pytest plugin: the golden conformance cases inside a user's own test suite.

Registered through the ``pytest11`` entry point of the package, so it is active wherever adadiag-ref is
installed (it does nothing unless asked).  Two ways to use it:

* ``pytest --adadiag-ref=pkg.mod:Class`` (a ``torch.optim.Optimizer`` class), ``--adadiag-ref=pkg.mod:factory
  --adadiag-ref-kind=optax`` (an optax factory) or ``--adadiag-ref-cmd="..."`` (a command of the
  ``adadiag-ref conform`` file protocol) adds one test per golden case, ``adadiag-ref::<case>``, run exactly
  as ``adadiag-ref conform`` runs it; ``--adadiag-ref-optimizer=NAME`` says which optimizer it implements
  when the name does not tell (default for a command: every case).  A case that needs an option the port lacks
  is skipped with the reason (not applicable); ``--adadiag-ref-accepts``, ``--adadiag-ref-state-map``,
  ``--adadiag-ref-moments``, ``--adadiag-ref-rtol``, ``--adadiag-ref-state-rtol``, ``--adadiag-ref-rename`` and
  ``--adadiag-ref-port-option`` are ``conform``'s ``--accepts``, ``--state-map``, ``--moments``, ``--rtol``,
  ``--state-rtol``, ``--rename`` and ``--port-option``.
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
    group.addoption("--adadiag-ref-accepts", metavar="KEY,...", default=None, help="keywords honoured via **kwargs")
    group.addoption("--adadiag-ref-state-map", metavar="NAME=FIELD,...", default=None, help="the port's state names")
    group.addoption("--adadiag-ref-moments", choices=["auto", "raw", "corrected"], default="auto", help="M, V kept")
    group.addoption("--adadiag-ref-rtol", type=float, default=None, help="the parameters' rtol (default: the case's)")
    group.addoption("--adadiag-ref-state-rtol", type=float, default=None, help="the states' rtol (default: the case's)")
    group.addoption("--adadiag-ref-rename", metavar="KEY=PORT_KEY,...", default=None, help="the port's keyword names")
    group.addoption(
        "--adadiag-ref-port-option", metavar="KEY=VALUE", action="append", default=[], help="an extra keyword (JSON)"
    )


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
        if report.not_applicable is not None:
            pytest.skip(f"not applicable: {report.not_applicable}")
        if not report.passed:
            raise _Failed(str(report))

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:  # type: ignore[override]
        if isinstance(excinfo.value, _Failed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int, str]:
        return "adadiag-ref", 0, f"adadiag-ref conformance: {self.name}"


class _Cases(pytest.Collector):
    """The conformance items, collected as pytest collects any node (so that its count is reported)."""

    def __init__(self, *, cases: Any = (), runner: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cases, self.runner = list(cases), runner

    def collect(self) -> list[Any]:
        return [ConformanceItem.from_parent(self, name=c.name, case=c, runner=self.runner) for c in self.cases]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[Any]) -> None:
    """``--adadiag-ref`` / ``--adadiag-ref-cmd``: append one item per case of the port's optimizer(s), reported to
    pytest's collection (``collected N items`` counts them)."""
    target, command = config.getoption("adadiag_ref"), config.getoption("adadiag_ref_cmd")
    if target is None and command is None:
        return
    from .golden.conform import conform_options, load_object, port_runner, select_cases

    try:
        if command is not None:
            kind, spec = "cmd", command
        else:
            kind = config.getoption("adadiag_ref_kind") or (
                "torch" if isinstance(load_object(target), type) else "optax"
            )
            spec = target
        options = conform_options(
            config.getoption("adadiag_ref_accepts"),
            config.getoption("adadiag_ref_port_option"),
            config.getoption("adadiag_ref_state_map"),
            config.getoption("adadiag_ref_moments"),
            config.getoption("adadiag_ref_rtol"),
            config.getoption("adadiag_ref_state_rtol"),
            config.getoption("adadiag_ref_rename"),
        )
        runner, inferred = port_runner(kind, spec, options=options)
        chosen = config.getoption("adadiag_ref_optimizer")
        optimizers = chosen.split(",") if chosen else inferred
        if optimizers is None and kind != "cmd":
            raise ValueError(f"say which optimizer {spec} implements: --adadiag-ref-optimizer=NAME")
        cases = select_cases(config.getoption("adadiag_ref_dir"), optimizers, None, None)
    except ValueError as exc:
        raise pytest.UsageError(f"--adadiag-ref: {exc}") from None
    parent = _Cases.from_parent(session, name="adadiag-ref", nodeid="adadiag-ref", cases=cases, runner=runner)
    report = session.ihook.pytest_make_collect_report(collector=parent)
    session.ihook.pytest_collectreport(report=report)
    items.extend(x for x in report.result if isinstance(x, pytest.Item))
