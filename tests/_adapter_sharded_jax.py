"""Subprocess for ``test_distributed.py``: the optax adapter on 2 host devices.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (set before jax
is imported).  Parameters and gradients are sharded over a 2-device mesh; the
jitted update must give the unsharded single-device result.  Prints one JSON
line: the max |difference| per optimizer.
"""

from __future__ import annotations

import json

import _adapter_import  # noqa: F401
import jax

jax.config.update("jax_enable_x64", True)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from adadiag_ref.adapters.optax import ALIASES  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import adadiag_ref as ar  # noqa: E402

STEPS, FREQ = 7, 3


def run(name: str, shardings) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((8, 6)), "b": rng.standard_normal(6)}
    grads = [{"w": rng.standard_normal((8, 6)), "b": rng.standard_normal(6)} for _ in range(STEPS)]
    params = jax.device_put(params, shardings)
    opt = ALIASES[name](0.01, weight_decay=0.1, update_freq=FREQ)
    state = opt.init(params)
    update = jax.jit(opt.update)
    for g in grads:
        updates, state = update(jax.device_put(g, shardings), state, params)
        params = optax.apply_updates(params, updates)
    return {k: np.asarray(v) for k, v in params.items()}


def main() -> None:
    devices = jax.devices()
    assert len(devices) == 2, devices
    mesh = Mesh(np.array(devices), ("data",))
    sharded = {"w": NamedSharding(mesh, P("data", None)), "b": NamedSharding(mesh, P())}
    single = {"w": jax.sharding.SingleDeviceSharding(devices[0]), "b": jax.sharding.SingleDeviceSharding(devices[0])}
    diffs = {}
    for name in ar.OPTIMIZERS:
        a, b = run(name, sharded), run(name, single)
        diffs[name] = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    print(json.dumps({"devices": len(devices), "max_abs_diff": diffs}))


if __name__ == "__main__":
    main()
