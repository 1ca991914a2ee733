"""Official GaLore (``galore-torch``) as ``adadiag-ref conform`` ports (docs/golden.md, "Recipes").

``GaLoreAdamW`` is its ``AdamW`` (HF's, no projection); ``GaLoreFullRank`` projects every 2-D parameter on all of
its singular vectors, refreshed every ``update_freq`` steps (GaLore's ``update_proj_gap``; it refreshes when
``iter % gap == 0`` with ``iter = t - 1``: the spec's schedule).  The package is loaded without its ``__init__``
(which imports bitsandbytes and transformers), as benchmarks/cpu_adapter_vs_peers.py does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cpu_adapter_vs_peers import galore_adamw

GaLoreAdamW: Any = galore_adamw()
if GaLoreAdamW is None:
    raise ImportError("galore_torch is not installed: pip install --no-deps galore-torch")
for _name in ("transformers.utils.versions", "transformers.utils", "transformers"):
    # the loader's stand-ins for an absent transformers have no __spec__: left in sys.modules, another package's
    # importlib.util.find_spec("transformers") would raise (pytorch-optimizer's does); galore has what it needs
    if getattr(sys.modules.get(_name), "__spec__", True) is None:
        del sys.modules[_name]


class GaLoreFullRank(GaLoreAdamW):  # type: ignore[misc, valid-type]
    """GaLore at full rank: ``rank = min(m, n)``, ``update_proj_gap = update_freq``, ``scale = 1``, ``std``."""

    def __init__(self, params, lr, betas, eps, weight_decay, update_freq, correct_bias=True):  # type: ignore[no-untyped-def]
        params = list(params)
        group = {
            "params": params,
            "rank": min(params[0].shape),
            "update_proj_gap": update_freq,
            "scale": 1.0,
            "proj_type": "std",
        }
        super().__init__(
            [group],
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            correct_bias=correct_bias,
            no_deprecation_warning=True,
        )
