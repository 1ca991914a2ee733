"""The GPU path's CPU proxies, printed: host conversions and namespace calls per step and per refresh.

``array_api_strict`` arrays stand in for device arrays (:mod:`adadiag_ref.perf.traffic`).  Run on demand::

    python benchmarks/device_traffic.py

Prints, per optimizer, one step without refresh (state counter vs host counter ``count=``, ``check`` off and
on) and a refresh of a ``1/i``-spectrum float32 matrix at sides 256 and 512, then ``multi_step`` over 2 and 16
parameters, then the refreshes due at one step over 2 and 16 parameters, one by one (``refresh_basis``) and
batched (``refresh_bases``).  The limits the tests hold (``tests/test_device_traffic.py``) are printed beside them.
"""

from __future__ import annotations

import time

import array_api_strict as xs
import numpy as np

import adadiag_ref as ar
from adadiag_ref.perf.traffic import count_traffic


def one_step(name: str, rng: np.random.Generator) -> str:
    cfg = ar.make_config(name, update_freq=10)
    w = xs.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    state = ar.init(w, cfg)
    g = xs.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    w, state = ar.step(state, g, cfg, w, count=0)  # the refresh step
    cells = []
    for count in (None, 1):
        for check in (False, True):
            with count_traffic() as traffic:
                ar.step(state, g, cfg, w, check=check, **({} if count is None else {"count": count}))
            cells.append(f"{traffic.host_conversions:3d} {traffic.namespace_calls:4d}")
    return f"{name:14s} " + " | ".join(cells)


def refresh(name: str, method: str, side: int, rng: np.random.Generator) -> str:
    U, _ = np.linalg.qr(rng.standard_normal((side, side)))
    V, _ = np.linalg.qr(rng.standard_normal((side, side)))
    G = xs.asarray(((U / np.arange(1, side + 1)) @ V.T).astype(np.float32))
    cfg = ar.make_config(name, basis_method=method)
    state = ar.init(G, cfg)
    start = time.perf_counter()
    with count_traffic() as traffic:
        ar.refresh_basis(state, G, cfg)
    seconds = time.perf_counter() - start
    counts = f"{traffic.host_conversions:5d} {traffic.namespace_calls:6d}"
    return f"{name:11s} {method:5s} {side:4d}  {counts}  {seconds:6.2f} s"


def many(name: str, n: int, rng: np.random.Generator) -> str:
    cfg = ar.make_config(name)
    ws = [xs.asarray(rng.standard_normal((8, 12)).astype(np.float32)) for _ in range(n)]
    states = [ar.init(w, cfg) for w in ws]
    gs = [xs.asarray(rng.standard_normal((8, 12)).astype(np.float32)) for _ in range(n)]
    ws, states = ar.multi_step(states, gs, cfg, ws, count=0)
    with count_traffic() as traffic:
        ar.multi_step(states, gs, cfg, ws, count=1)
    views = sum(v for k, v in traffic.calls.items() if k in ("reshape", "__getitem__", "astype"))
    return f"{name:8s} {n:3d} params  {traffic.host_conversions:3d} {traffic.namespace_calls:5d} (views {views})"


def refreshes(name: str, method: str, n: int, rng: np.random.Generator) -> str:
    cfg = ar.make_config(name, basis_method=method)
    gs = [xs.asarray(rng.standard_normal((32, 48)).astype(np.float32)) for _ in range(n)]
    states = [ar.init(g, cfg) for g in gs]
    cells = []
    for batched in (False, True):
        with count_traffic() as traffic:
            if batched:
                ar.refresh_bases(states, gs, cfg)
            else:
                for state, g in zip(states, gs, strict=True):
                    ar.refresh_basis(state, g, cfg)
        cells.append(f"{traffic.host_conversions:4d} {traffic.namespace_calls:5d}")
    return f"{name:11s} {method:5s} {n:3d} params  " + " | ".join(cells)


def main() -> None:
    rng = np.random.default_rng(0)
    print("one step without refresh, 64 x 96 float32: host conversions, namespace calls")
    print(f"{'':14s} {'state counter':^19s} | {'':8s} | {'count=':^19s}")
    print(f"{'optimizer':14s} {'check off':>9s} | {'check on':>8s} | {'check off':>9s} | {'check on':>8s}")
    for name in ar.OPTIMIZERS:
        print(one_step(name, rng))
    print("\nrefresh of a 1/i-spectrum float32 matrix (limits at 512: <= 32 conversions, <= 1000 calls)")
    print(f"{'optimizer':11s} {'basis':5s} {'side':>4s}  {'conv':>5s} {'calls':>6s}  {'time':>8s}")
    for name, method in (("adadiag", "auto"), ("adadiag", "svd"), ("adadiag_pp", "auto")):
        for side in (256, 512):
            print(refresh(name, method, side, rng))
    print("\nmulti_step, 8 x 12 float32 parameters, check on: conversions, namespace calls")
    for name in ("adamw", "adadiag", "adafactor"):
        for n in (2, 16):
            print(many(name, n, rng))
    print("\nthe refreshes of one step, 32 x 48 float32: conversions, namespace calls")
    print(f"{'optimizer':11s} {'basis':5s} {'':10s}  {'one by one':>10s} | {'batched':>10s}")
    for name, method in (("adadiag", "auto"), ("adadiag", "svd"), ("adadiag_pp", "auto")):
        for n in (2, 16):
            print(refreshes(name, method, n, rng))


if __name__ == "__main__":
    main()
