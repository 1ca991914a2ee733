"""``adadiag-ref ode``: report, JSON, plot, progress bar, errors, and the subparser hook."""

from __future__ import annotations

import argparse
import json

import pytest

from adadiag_ref.ode import cli


def test_text_report(capsys):
    rc = cli.main(["--optimizer", "adadiag", "--problem", "least_squares", "--integrator", "dopri5", "--t-end", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "verdict: MONOTONE" in out
    for phrase in ("largest H increase", "energy balance", "||grad L||", "invariants", "evaluations"):
        assert phrase in out


def test_json_output_has_the_documented_keys(capsys):
    rc = cli.main(
        ["--optimizer", "hfacdiag", "--problem", "factorization", "--integrator", "rk4", "--t-end", "2", "--json"]
    )
    payload = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in ("max_h_increase", "h0", "h_end", "grad_norm_end", "n_steps", "n_evals", "verdict"):
        assert key in payload
    assert payload["n_steps"] == 200 and payload["integrator"] == "rk4"
    assert payload["system_description"].startswith("hfacdiag(")


def test_violation_is_reported_with_options(capsys):
    rc = cli.main(["--optimizer", "adam", "--b", "8", "--t-end", "5", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert rc == 0 and payload["verdict"] == "violated" and payload["max_dhdt"] > 0


@pytest.mark.parametrize("integrator", ["euler", "sie", "rk4", "dp5"])
def test_integrator_names_and_aliases(integrator, capsys):
    rc = cli.main(
        ["--optimizer", "adafacdiag", "--problem", "rosenbrock", "--integrator", integrator, "--t-end", "0.5", "--json"]
    )
    payload = json.loads(capsys.readouterr().out)
    assert rc == 0 and payload["status"] == "success"


def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.png"
    rc = cli.main(["--optimizer", "adadiag_pp", "--t-end", "2", "--refresh-every", "0.5", "--plot", str(path)])
    assert rc == 0 and path.stat().st_size > 10_000
    assert f"plot: {path}" in capsys.readouterr().out
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_forced_goes_to_stderr(capsys):
    rc = cli.main(["--optimizer", "adam", "--integrator", "rk4", "--t-end", "1", "--progress"])
    captured = capsys.readouterr()
    assert rc == 0 and "100.0%" in captured.err and "100.0%" not in captured.out


def test_no_progress_bar_when_not_a_tty(capsys):
    cli.main(["--optimizer", "adam", "--integrator", "rk4", "--t-end", "1"])
    assert "%" not in capsys.readouterr().err


def test_order_flag(capsys):
    rc = cli.main(["--optimizer", "adam", "--integrator", "semi_implicit_euler", "--t-end", "1", "--order", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert rc == 0 and abs(payload["observed_order"] - 1.0) < 0.15


def test_errors(capsys):
    assert cli.main(["--optimizer", "lion"]) == 2  # checked by make_system: registered families count
    assert "unknown system 'lion'" in capsys.readouterr().err
    assert cli.main(["--optimizer", "adam", "--clip-threshold", "1", "--t-end", "1"]) == 2
    assert "clip_threshold" in capsys.readouterr().err
    assert cli.main(["--optimizer", "hfac", "--moments", "zero", "--t-end", "1"]) == 3
    assert "ILL_POSED" in capsys.readouterr().out


def test_add_parser_registers_the_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="adadiag-ref")
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["ode", "--optimizer", "momentum_sgd", "--t-end", "1", "--integrator", "rk4"])
    assert args.func is cli.run
    assert args.func(args) == 0
    assert "momentum_sgd" in capsys.readouterr().out


def test_discrete_limit_flag(capsys, tmp_path):
    args = ["--optimizer", "adadiag", "--problem", "factorization", "--discrete-limit", "--t-end", "1"]
    args += ["--refresh-every", "0.25", "--hs", "0.01,0.005,0.0025"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "fitted order: 1.0" in out and "refresh every 0.25" in out
    path = tmp_path / "limit.png"
    assert cli.main([*args, "--json", "--no-bias-correction", "--plot", str(path)]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert abs(payload["order"] - 1.0) < 0.05 and payload["hs"] == [0.01, 0.005, 0.0025]
    assert payload["bias_correction"] is False and path.stat().st_size > 0
    assert cli.main([*args[:-2], "--hs", "0.3,0.1"]) == 2
    assert "must divide" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*args[:-2], "--hs", "0.01"])


def test_a_family_registered_at_run_time_reaches_the_cli(capsys):
    """``--import MODULE`` registers a family (tests/_ode_plugin_family.py) before the optimizer is looked up."""
    import sys

    import adadiag_ref as ar
    from adadiag_ref.optim.families import FAMILIES

    try:
        rc = cli.main(["--import", "_ode_plugin_family", "--optimizer", "pluginball", "--t-end", "2", "--json"])
        payload = json.loads(capsys.readouterr().out)
    finally:
        FAMILIES.pop("pluginball", None)
        ar.OPTIMIZERS.pop("pluginball", None)
        sys.modules.pop("_ode_plugin_family", None)
    assert rc == 0 and payload["system"] == "pluginball" and payload["verdict"] == "monotone"
    assert cli.main(["--import", "no_such_module_48", "--optimizer", "adam"]) == 2
    assert "no_such_module_48" in capsys.readouterr().err


def test_json_trajectory_flag(capsys):
    assert cli.main(["--optimizer", "adam", "--integrator", "rk4", "--t-end", "1", "--json", "--trajectory"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert len(payload["trajectory"]["t"]) == 201 and payload["trajectory"]["t"][-1] == 1.0
