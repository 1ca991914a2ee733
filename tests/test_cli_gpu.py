"""``bench --gpu`` and ``reproduce --device`` (issue 24, items 6 and 7).

On a machine without CuPy or without a CUDA device (CI) the refusals are checked: one line
``adadiag-ref: error: ...`` on stderr, exit status 2, no output file, no work started.  The tests marked
``gpu`` run the real measurements on a CUDA machine (skipped without one, see ``tests/conftest.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from conftest import _load_backend, assert_one_line_error, run_cli


@pytest.fixture
def no_gpu_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU bench's and the CPU bench's work fail the test: a refusal must come before them."""
    from adadiag_ref.perf import bench, gpu

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark ran before the checks")

    monkeypatch.setattr(gpu, "run", started)
    monkeypatch.setattr(bench, "run", started)


def _no_cuda_device_cupy() -> types.ModuleType:
    """A stand-in for an installed CuPy on a machine without a CUDA driver: asking for devices raises."""

    def device_count() -> int:
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=device_count))  # type: ignore[attr-defined]
    return cupy


# ------------------------------------------------------------------ bench --gpu refusals (CPU)


def test_bench_gpu_without_cupy(tmp_path: Path, capsys, monkeypatch, no_gpu_work) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    target = tmp_path / "gpu.json"
    code, out, err = run_cli(["bench", "--gpu", "--quick", "--json", str(target)], capsys)
    assert_one_line_error(code, err, "CuPy", 'pip install "adadiag-ref[cuda]"')
    assert out == "" and not target.exists()


def test_bench_gpu_without_a_cuda_device(tmp_path: Path, capsys, monkeypatch, no_gpu_work) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _no_cuda_device_cupy())
    target = tmp_path / "gpu.json"
    code, out, err = run_cli(["bench", "--gpu", "--json", str(target)], capsys)
    assert_one_line_error(code, err, "CUDA device", "no CUDA-capable device")
    assert out == "" and not target.exists()


def test_bench_gpu_needs_neither_numba_nor_threadpoolctl(capsys, monkeypatch, no_gpu_work) -> None:
    # the GPU path is decided before the CPU bench's check for its extras: the message is about CuPy
    for name in ("numba", "threadpoolctl", "cupy"):
        monkeypatch.setitem(sys.modules, name, None)
    code, _, err = run_cli(["bench", "--gpu", "--quick"], capsys)
    line = assert_one_line_error(code, err, "CuPy")
    assert "numba" not in line and "threadpoolctl" not in line


@pytest.mark.parametrize(
    "extra",
    [
        ["--steady"],
        ["--refresh-routes"],
        ["--refresh-scaling"],
        ["--threads", "2"],
        ["--retain-freed-memory"],
        ["--no-functional"],
        ["--plot", "{folder}/scaling.png"],
    ],
    ids=lambda v: v[0],
)
def test_bench_gpu_refuses_the_cpu_only_options(extra: list[str], tmp_path: Path, capsys, no_gpu_work) -> None:
    target = tmp_path / "gpu.json"
    argv = ["bench", "--gpu", "--json", str(target), *(a.format(folder=tmp_path) for a in extra)]
    code, out, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "--gpu", extra[0])
    assert out == "" and not target.exists()


def test_bench_json_needs_gpu(tmp_path: Path, capsys, no_gpu_work) -> None:
    target = tmp_path / "cpu.json"
    code, out, err = run_cli(["bench", "--quick", "--json", str(target)], capsys)
    assert_one_line_error(code, err, "--json", "--gpu")
    assert out == "" and not target.exists()


def test_bench_gpu_json_folder_checked_up_front(tmp_path: Path, capsys, no_gpu_work) -> None:
    code, _, err = run_cli(["bench", "--gpu", "--json", str(tmp_path / "no" / "such" / "gpu.json")], capsys)
    assert_one_line_error(code, err, "--json", "does not exist")


# ------------------------------------------------------------------ reproduce --device refusals (CPU)


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    from adadiag_ref.reproduce import train

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started before the device was checked")

    monkeypatch.setattr(train, "compare", started)


def test_reproduce_cuda_without_cuda(tmp_path: Path, capsys, monkeypatch, no_training) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    json_path, plot_path = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["reproduce", "--quick", "--device", "cuda", "--json", str(json_path), "--plot", str(plot_path)]
    code, out, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "--device cuda", "CUDA", "torch")
    assert out == "" and not json_path.exists() and not plot_path.exists()
    assert list(tmp_path.iterdir()) == []
    assert (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()) == before


def test_reproduce_device_must_be_cpu_or_cuda(capsys, no_training) -> None:
    code, _, err = run_cli(["reproduce", "--quick", "--device", "tpu"], capsys)
    assert_one_line_error(code, err, "--device", "invalid choice", "tpu")


def test_reproduce_device_defaults_to_cpu() -> None:
    from adadiag_ref.cli import build_parser
    from adadiag_ref.reproduce.train import RunConfig, deterministic

    assert build_parser().parse_args(["reproduce"]).device == "cpu"
    assert RunConfig(task="charlm", steps=2, batch=1).device == "cpu"
    assert deterministic("cpu") and not deterministic("cuda")


# ------------------------------------------------------------------ pieces of perf.gpu that run on the CPU


def test_device_times_syncs_around_each_timing() -> None:
    from adadiag_ref.perf.gpu import device_times

    log: list[str] = []
    times = device_times(lambda: log.append("call"), lambda: log.append("sync"), reps=3, inner=2, warmup=1)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert log == ["call", "sync"] + ["call", "call", "sync"] * 3


def test_device_times_stops_repeating_once_the_budget_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose one call takes seconds (CuPy's gesvd refresh: 25 s on an H100) takes fewer timings, at
    least one: the bench then fits a device session.  The clock advances one second per call."""
    from adadiag_ref.perf import gpu

    clock = [0.0]
    monkeypatch.setattr(gpu.time, "perf_counter", lambda: clock[0])

    def call() -> None:
        clock[0] += 1.0

    assert gpu.device_times(call, lambda: None, reps=9, inner=1, warmup=1, budget_s=2.5) == [1.0, 1.0, 1.0]
    assert gpu.device_times(call, lambda: None, reps=9, inner=2, warmup=0, budget_s=0.5) == [1.0]
    assert len(gpu.device_times(call, lambda: None, reps=4, inner=1, warmup=0)) == 4  # no budget: every timing


def test_torch_direct_adadiag_runs_on_the_cpu() -> None:
    torch = pytest.importorskip("torch")
    from adadiag_ref.memory import llama_parameters
    from adadiag_ref.perf.gpu import torch_direct_adadiag
    from adadiag_ref.perf.params import QUICK

    step = torch_direct_adadiag(llama_parameters(QUICK), "paper", device="cpu")
    for _ in range(3):
        step()
    del torch


def test_torch_adapter_step_runs_on_the_cpu() -> None:
    torch = pytest.importorskip("torch")
    from adadiag_ref.memory import llama_parameters
    from adadiag_ref.perf.gpu import ADAPTER_OPTIMIZERS, _torch_adapter_step
    from adadiag_ref.perf.params import QUICK

    for name in ADAPTER_OPTIMIZERS:
        for options in ({}, {"kernels": "reference"}):  # the rows with CuPy, and without (the engine's reference)
            step = _torch_adapter_step(torch, name, llama_parameters(QUICK), "paper", device="cpu", **options)
            step()
            step()


@pytest.mark.parametrize("kind", ["optax_adamw", "optax_adapter_adamw", "optax_adapter_adadiag"])
def test_optax_steps_run_on_the_cpu_device(kind: str) -> None:
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    from adadiag_ref.memory import llama_parameters
    from adadiag_ref.perf.gpu import _optax_step
    from adadiag_ref.perf.params import QUICK

    specs = llama_parameters(QUICK)
    step, sync = _optax_step(jax, jax.devices("cpu")[0], kind, specs, "paper")
    step()
    step()
    sync()


def test_gpu_tables_print_measured_and_missing_rows() -> None:
    from adadiag_ref.perf.gpu import _print

    row = {"label": "adadiag, CuPy core ar.multi_step", "ms": 2.0, "na": None, "bound": "gemm_1+bandwidth",
           "ratio_to_bound": 2.0, "peer": "torch_direct_adadiag", "ratio_to_peer": 1.25}  # fmt: skip
    missing = {"label": "adadiag, direct torch ops", "ms": None, "na": "torch without CUDA", "bound": None,
               "ratio_to_bound": None, "peer": None, "ratio_to_peer": None}  # fmt: skip
    res = {
        "device": {"name": "a GPU", "cupy": "14", "cuda_runtime": 13000, "torch": None, "jax": None},
        "setup": {
            "model": "quick",
            "quick": True,
            "rule": "paper",
            "parameters": 21,
            "elements": 10,
            "rotated": 14,
            "reps": 2,
            "inner": 3,
            "period": 200,
        },
        "bandwidth_gbs": 1000.0,
        "bounds_ms": {"bandwidth": 0.5, "gemm_1": 0.5, "gemm_2": 1.0, "gemm_1+bandwidth": 1.0, "gemm_2+bandwidth": 1.5},
        "step": {"cupy_adadiag": row, "torch_direct_adadiag": missing},
        "refresh": {
            "cupy_refresh_auto": {"label": "CuPy auto", "ms": 40.0, "na": None, "share": 0.1},
            "torch_svd": {"label": "torch svd", "ms": None, "na": "torch without CUDA", "share": None},
        },
    }
    lines: list[str] = []
    _print(res, lines.append)
    text = "\n".join(lines)
    assert (
        "| adadiag, CuPy core ar.multi_step | 2.000 | gemm_1+bandwidth 1.000 | 2.00 | adadiag, direct torch ops" in text
    )
    assert "n/a (torch without CUDA)" in text and "10.00%" in text


# ------------------------------------------------------------------ on a CUDA machine


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.gpu
def test_bench_gpu_quick_writes_its_tables(tmp_path: Path, capsys) -> None:
    _load_backend("cupy")  # skips without CuPy or a CUDA device
    target = tmp_path / "gpu.json"
    code, out, err = run_cli(["bench", "--gpu", "--quick", "--reps", "2", "--json", str(target)], capsys)
    assert code == 0, err
    doc = json.loads(target.read_text())
    assert set(doc) == {"device", "setup", "bandwidth_gbs", "bounds_ms", "step", "refresh"}
    assert _positive(doc["bandwidth_gbs"])
    assert all(_positive(v) for v in doc["bounds_ms"].values()), doc["bounds_ms"]
    for key in ("cupy_adamw", "cupy_adadiag", "cupy_adadiag_pp", "cupy_adafacdiag", "cupy_hfacdiag"):
        assert _positive(doc["step"][key]["ms"]), doc["step"][key]
    assert _positive(doc["step"]["cupy_adamw"]["ratio_to_bound"])
    for key in ("cupy_refresh_svd", "cupy_refresh_gram", "cupy_refresh_auto", "cupy_refresh_batched_svd",
                "cupy_refresh_batched_gram", "cupy_refresh_batched_auto", "cupy_eigh_float32",
                "cupy_eigh_float64"):  # fmt: skip
        assert _positive(doc["refresh"][key]["ms"]) and _positive(doc["refresh"][key]["share"]), doc["refresh"][key]
    for table in ("step", "refresh"):  # every other row: a number, or n/a with its reason
        for key, row in doc[table].items():
            assert _positive(row["ms"]) or (row["ms"] is None and row["na"]), (key, row)
    assert "| non-refresh step |" in out and "share at T=200" in out
    torch = importlib.import_module("torch") if importlib.util.find_spec("torch") else None
    if torch is not None and torch.cuda.is_available():
        for key in ("torch_fused_adamw", "torch_direct_adadiag", "torch_adapter_adamw", "torch_adapter_adadiag",
                    "torch_adapter_adadiag_pp", "torch_adapter_adamw_no_cupy", "torch_adapter_adadiag_no_cupy",
                    "torch_adapter_adadiag_pp_no_cupy"):  # fmt: skip
            assert _positive(doc["step"][key]["ms"]), doc["step"][key]
        for key in ("torch_svd", "torch_eigh_float32", "torch_eigh_float64", "torch_adapter_refresh_step"):
            assert _positive(doc["refresh"][key]["ms"]), doc["refresh"][key]
    from adadiag_ref.perf.gpu import _jax_gpu

    try:
        _jax_gpu()
    except RuntimeError:
        pass  # JAX or its GPU backend missing: the optax rows say n/a (checked above)
    else:
        for key in ("optax_adamw", "optax_adapter_adamw", "optax_adapter_adadiag"):
            assert _positive(doc["step"][key]["ms"]), doc["step"][key]


@pytest.mark.gpu
def test_reproduce_on_cuda_quick(tmp_path: Path, capsys) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    target = tmp_path / "r.json"
    argv = ["reproduce", "--quick", "--device", "cuda", "--optimizers", "adadiag", "--seeds", "0",
            "--lr-grid", "1e-2", "--steps", "6", "--no-progress", "--json", str(target)]  # fmt: skip
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    doc = json.loads(target.read_text())
    assert doc["device"] == "cuda" and doc["machine"]["gpu"]
    assert {r["optimizer"] for r in doc["runs"]} == {"adamw", "adadiag"}
    assert all(math.isfinite(r["final_val_loss"]) for r in doc["runs"])


def test_torch_engine_row_steps_the_engine_over_torch_tensors_on_the_cpu() -> None:
    """``bench --gpu``'s ``torch_engine_adamw`` row: ``ar.Engine`` over torch parameters (on the CPU here: the
    gathering path; on CUDA with CuPy the CUDA group kernels) writes them in place, as the adapter's AdamW would."""
    torch = pytest.importorskip("torch")
    from adadiag_ref.memory import llama_parameters
    from adadiag_ref.perf.gpu import _TorchEngineSteps
    from adadiag_ref.perf.params import QUICK

    steps = _TorchEngineSteps(llama_parameters(QUICK), torch.device("cpu"))
    before = [p.detach().clone() for p in steps.params]
    steps()
    steps()
    assert steps.engine.count(0) == 2
    assert all(not torch.equal(a, b) for a, b in zip(steps.params, before, strict=True))
