"""A ``--cmd`` port for ``adadiag-ref conform`` (its file protocol, docs/golden.md): ``python _cmd_port.py IN OUT``.

It reads ``w0``, ``grads``, ``optimizer`` and ``config`` (the API's keywords), runs the library's core step by
step, and writes ``params`` and every state field after every step as ``state_FIELD`` (work frame).
"""

from __future__ import annotations

import json
import sys

import numpy as np

import adadiag_ref as ar


def main(input_path: str, output_path: str) -> None:
    with np.load(input_path) as data:
        w, grads = data["w0"], data["grads"]
        cfg = ar.make_config(str(data["optimizer"]), **json.loads(str(data["config"])))
    state, params, states = ar.init(w, cfg), [], {}
    for g in grads:
        w, state = ar.step(state, g, cfg, w)
        params.append(np.array(w))
        for name in ("count", "P", "Q", "M", "V", "r", "s", "u", "v"):
            value = getattr(state, name, None)
            if value is not None:
                states.setdefault(f"state_{name}", []).append(np.array(value))
    np.savez(output_path, params=np.stack(params), **{k: np.stack(v) for k, v in states.items()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
