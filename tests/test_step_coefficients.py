"""The step's coefficients follow one rule on every backend and route (docs/spec.md, "The step's coefficients"):
from a host counter, float64 by Python's ``math``, rounded once to the state dtype; so they do not depend on the
processor's SIMD level, and the torch adapter's host numbers are the core's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref.optim.schedules import adafactor_beta2, beta_hats, host_step, relative_step

BETAS = (0.9, 0.95, 0.98, 0.99, 0.999, 0.9999)


def _core_betas(beta: float, count: int, dtype) -> tuple[float, float]:
    cfg = ar.make_config("adamw", betas=(beta, beta))
    b1, b2 = beta_hats(cfg, host_step(count, dtype, np), np)
    return float(b1), float(b2)


def _exact_beta_hat(beta: float, t: int) -> Fraction:
    b = Fraction(beta)
    return b * (1 - b ** (t - 1)) / (1 - b**t)


@pytest.mark.parametrize("beta", BETAS)
def test_host_beta_hat_is_the_float32_nearest_the_exact_value(beta):
    """A loop reference in rational arithmetic: the float64 value rounded once is the float32 nearest the exact
    ``beta (1 - beta^(t-1)) / (1 - beta^t)`` (a float64 error under an ulp moves the float32 rounding with
    probability about 2^-29 per value, so none of these samples may differ)."""
    for t in SAMPLE_STEPS:
        got, _ = _core_betas(beta, t - 1, np.float32)
        exact = _exact_beta_hat(beta, t)
        assert got == _nearest_float32(exact), (beta, t)


SAMPLE_STEPS = (*range(1, 60), 100, 257, 1000, 4097, 10_000)


def _nearest_float32(exact: Fraction) -> float:
    """The float32 nearest ``exact``: the rounded float64 or one of its neighbours, compared exactly."""
    rounded = np.float32(float(exact))
    candidates = (rounded, np.nextafter(rounded, np.float32(-1)), np.nextafter(rounded, np.float32(2)))
    return float(min(candidates, key=lambda c: abs(Fraction(float(c)) - exact)))


def test_float64_host_coefficients_match_rational_arithmetic_to_half_an_ulp_and_a_bit():
    """float64: the C library's ``expm1``/``log`` are within an ulp, so ``beta_hat_t`` is within a few ulps of the
    exact value (the ratio of two ``1 - beta^t`` each within ~1 ulp, times ``beta``)."""
    for beta in BETAS:
        for t in (2, 3, 10, 1000, 10_000):
            got, _ = _core_betas(beta, t - 1, np.float64)
            exact = _exact_beta_hat(beta, t)
            assert abs(Fraction(got) - exact) <= 4 * 2.0**-53 * exact, (beta, t)


def test_adafactor_schedules_on_the_host_are_float64_rounded_once():
    for count in (0, 1, 2, 9, 99, 4095):
        t32 = host_step(count, np.float32, np)
        t = count + 1
        want_beta2 = np.float32(1.0 - t**-0.8) if t > 1 else np.float32(0.0)
        assert float(adafactor_beta2(t32, 0.8, np)) == pytest.approx(float(want_beta2), rel=2**-23)
        assert float(relative_step(1e-2, t32, np)) == float(np.float32(min(1e-2, 1.0 / np.sqrt(float(t)))))


# ----------------------------------------------------------------------------- across forced CPU levels

_PROBE = r"""
import hashlib, json, numpy as np, adadiag_ref as ar
from adadiag_ref.optim.schedules import beta_hats, host_step
out = {}
for dtype in (np.float32, np.float64):
    cfg = ar.make_config("adamw", betas=(0.9, 0.999))
    values = [beta_hats(cfg, host_step(k, dtype, np), np) for k in range(2000)]
    out[f"coefficients-{np.dtype(dtype).name}"] = hashlib.sha256(np.asarray(values, dtype=dtype).tobytes()).hexdigest()
rng = np.random.default_rng(0)
w = rng.standard_normal((6, 10))
grads = [rng.standard_normal((6, 10)) for _ in range(8)]
for name in ("adamw", "adafactor", "hfac"):
    cfg = ar.make_config(name, lr=1e-2, weight_decay=0.1, kernels="reference")
    p, s = w.copy(), ar.init(w, cfg)
    for g in grads:
        p, s = ar.step(s, g, cfg, p)
    out[name] = hashlib.sha256(p.tobytes()).hexdigest()
try:
    import torch
    from adadiag_ref.adapters.pytorch import AdamW
    x = torch.nn.Parameter(torch.from_numpy(w.astype(np.float32)))
    opt = AdamW([x], lr=1e-2, weight_decay=0.1)
    for g in grads:
        x.grad = torch.from_numpy(g.astype(np.float32))
        opt.step()
    out["torch-adamw"] = hashlib.sha256(x.detach().numpy().tobytes()).hexdigest()
except ImportError:
    pass
print(json.dumps(out))
"""


def _probe(env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_unrotated_trajectories_have_the_same_bits_at_every_forced_cpu_level():
    """The coefficients and the unrotated optimizers' trajectories (no GEMM, so no BLAS kernel choice) hash alike
    under every level one machine can force (scripts/cpu_levels.py's table)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from cpu_levels import environment, level_environments

    hashes = {name: _probe(environment(overrides)) for name, overrides in level_environments().items()}
    first_name, first = next(iter(hashes.items()))
    for name, got in hashes.items():
        assert got == first, (first_name, name, {k: (first[k], got.get(k)) for k in first if first[k] != got.get(k)})


@pytest.mark.parametrize("beta", BETAS)
def test_a_device_counter_computes_in_float64_and_rounds_once(beta):
    """A device counter (``array_api_strict`` stands in for one: its arrays are not read on the host) takes the same
    expressions in float64 on the backend and rounds once: the float32 nearest the exact value, as the host's
    (before, they were computed in float32 on the device: NumPy's float32 ``expm1`` is off by an ulp at times)."""
    xs = pytest.importorskip("array_api_strict")
    cfg = ar.make_config("adamw", betas=(beta, beta))
    for t in SAMPLE_STEPS:
        on_device = beta_hats(cfg, xs.asarray(t, dtype=xs.float32), xs)[0]
        assert on_device.dtype == xs.float32
        assert float(on_device) == _nearest_float32(_exact_beta_hat(beta, t)), (beta, t)
    for t in (1, 2, 10, 2000):
        t_device, t_host = xs.asarray(t, dtype=xs.float32), host_step(t - 1, np.float32, np)
        assert float(adafactor_beta2(t_device, 0.8, xs)) == float(adafactor_beta2(t_host, 0.8, np))
        assert float(relative_step(1e-2, t_device, xs)) == float(relative_step(1e-2, t_host, np))
