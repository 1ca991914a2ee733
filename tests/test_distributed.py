"""The adapters under data parallelism: torch DDP (2 processes, gloo, CPU) and optax on 2 JAX host devices.

Tolerances: DDP ranks feed the identical allreduced gradient to identical code,
so ranks must agree bit for bit.  Against the single-process run (per-shard
gradients averaged by hand: for 2 ranks ``g0/2 + g1/2`` is what DDP's
pre-divided allreduce sums) the same is expected, checked at rtol 1e-12 in
float64.  Sharded JAX reductions round differently from unsharded ones:
atol 1e-12 on O(1) float64 parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _adapter_import  # noqa: F401
import pytest

torch = pytest.importorskip("torch")

from _ranks import free_port, spawn_ranks  # noqa: E402

import adadiag_ref as ar  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
DEADLINE = 300.0  # seconds for one run of the DDP ranks (observed: well under a minute on 2 cores)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_ddp_ranks_bit_identical_and_equal_to_single_process(tmp_path):
    import _ddp_worker

    names = list(ar.OPTIMIZERS)
    spawn_ranks(_ddp_worker.worker, (free_port(), str(tmp_path), names), _ddp_worker.WORLD, DEADLINE)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(_ddp_worker.WORLD)]
    for name in names:
        for p0, p1 in zip(ranks[0][name], ranks[1][name]):
            assert torch.equal(p0, p1), name  # after 3 refreshes, every rank holds the same bits
        reference = _ddp_worker.reference_run(name)
        for p, ref in zip(ranks[0][name], reference):
            torch.testing.assert_close(p, ref, rtol=1e-12, atol=1e-14)
        # split refresh: each rank decomposes a share of the matrices and broadcasts -> the same bits
        for r in range(_ddp_worker.WORLD):
            for p_split, p_full in zip(ranks[r][name + "/split"], ranks[0][name]):
                assert torch.equal(p_split, p_full), (name, r)


def test_optax_sharded_over_two_host_devices_equals_unsharded():
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(TESTS_DIR / "_adapter_sharded_jax.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=TESTS_DIR,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 2
    assert set(report["max_abs_diff"]) == set(ar.OPTIMIZERS)
    for name, diff in report["max_abs_diff"].items():
        assert diff <= 1e-12, (name, diff)


_SHARDED_CORE_SCRIPT = """
import json, jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as Ps
import adadiag_ref as ar
mesh = Mesh(np.array(jax.devices()), ("d",))
rng = np.random.default_rng(0)
w0, gs = rng.standard_normal((4, 6)), rng.standard_normal((7, 4, 6))
w = jax.device_put(jnp.asarray(w0), NamedSharding(mesh, Ps("d", None)))
g = jax.device_put(jnp.asarray(gs), NamedSharding(mesh, Ps(None, "d", None)))
out = {}
for name in ar.OPTIMIZERS:
    ar.init(w, ar.make_config(name))  # eager init next to a 2-device sharded parameter
    got = np.asarray(ar.replay(name, w, g, lr=1e-2, update_freq=3))
    out[name] = float(np.abs(got - ar.replay(name, w0, gs, lr=1e-2, update_freq=3)).max())
print(json.dumps({"devices": len(jax.devices()), "max_abs_diff": out}))
"""


def test_core_runs_eagerly_on_sharded_jax_arrays():
    """The core itself (no adapter) on parameters sharded over 2 host devices equals the NumPy run."""
    pytest.importorskip("jax")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED_CORE_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 2
    for name, diff in report["max_abs_diff"].items():
        assert diff <= 1e-12, (name, diff)  # sharded reductions round differently: 1e-12 on O(1) float64 values


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_split_refresh_with_a_kept_basis_gives_the_bits_of_ar_step(tmp_path):
    """Under split_refresh only the owner decomposes, so only it sees a refresh keep the previous basis: every
    rank must still pass the update the owner's ``refreshed`` (False when kept, True otherwise), as ``ar.step``."""
    import _ddp_worker

    spawn_ranks(_ddp_worker.kept_basis_worker, (free_port(), str(tmp_path)), _ddp_worker.WORLD, DEADLINE)
    ranks = [torch.load(tmp_path / f"kept{r}.pt") for r in range(_ddp_worker.WORLD)]
    for name in _ddp_worker.KEPT_NAMES:
        reference = _ddp_worker.kept_basis_stream(name, None)
        for r in range(_ddp_worker.WORLD):
            for p, ref in zip(ranks[r][name], reference, strict=True):
                assert torch.equal(p, ref), (name, r)
