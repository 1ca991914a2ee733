"""PyTorch adapter: ``torch.optim.Optimizer`` classes over the array-API core.

The adapter owns no math.  For every parameter with a gradient, one call of
:meth:`CoreOptimizer.step` does exactly what the core's eager driver
:func:`adadiag_ref.step` does, on the parameter's own tensors and device::

    check_inputs(S, G, cfg, W)                    # all parameters first: an error leaves every state untouched
    if refresh_due(t - 1):  S <- refresh_basis(S, G, cfg)   # P, Q <- canonical_svd(G)
    S <- update_in_place(S, G, cfg, W, lr=group["lr"], refreshed=...)
                                                  # W += delta, delta = -eta_t (P U~ Q^T + lambda W_t);
                                                  # bit-identical to update(), moments overwritten in place

The core resolves the torch namespace itself (``array_api_compat``); nothing is
copied to NumPy.

State layout (``optimizer.state[p]``, and ``state_dict()["state"][i]``): a flat
dict of tensors, the core's NamedTuple state flattened field by field, with the
counter ``count`` under the key ``"step"`` (an int32 0-d tensor)::

    AdamW / AdaDiag / AdaDiagPP            step, [P], [Q], M, V
    Adafactor / AdafacDiag / AdafacDiagPP  step, [P], [Q], [M], r, s
    Hfac / HfacDiag                        step, [P], [Q], u, v, r, s

A field the core leaves as ``None`` (no basis on that side, no momentum) is
absent.  All arrays are in the parameter's work frame (``ar.layout_for``) and
in the state dtype: float64 for float64 parameters, float32 for float32,
float16 and bfloat16 ones.
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # name the extra instead of a bare "No module named 'torch'"
    raise ImportError(
        'adadiag_ref.adapters.pytorch needs PyTorch: pip install "adadiag-ref[torch]"', name=exc.name
    ) from exc

from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Any

import adadiag_ref as ar
from adadiag_ref.config import BaseConfig

__all__ = [
    "AdaDiag",
    "AdaDiagPP",
    "AdafacDiag",
    "AdafacDiagPP",
    "Adafactor",
    "AdamW",
    "CoreOptimizer",
    "Hfac",
    "HfacDiag",
    "from_core_state",
    "to_core_state",
]

_STATE_TYPES: dict[str, type] = {"adam": ar.AdamState, "adafactor": ar.AdafactorState, "hfac": ar.HfacState}
_NOT_CONFIG = frozenset({"params", "lr", "maximize", "param_names", "initial_lr"})
"""Group entries that are not part of the frozen core config (lr is passed to ``update`` each step)."""


def from_core_state(state: Any) -> dict[str, torch.Tensor]:
    """Flatten a core NamedTuple state into torch's per-parameter dict (``count`` -> ``"step"``)."""
    flat = {"step": state.count}
    for name in state._fields[1:]:
        value = getattr(state, name)
        if value is not None:
            flat[name] = value
    return flat


def to_core_state(flat: Mapping[str, torch.Tensor], cfg: BaseConfig) -> Any:
    """Rebuild the core NamedTuple state of ``cfg``'s family from the flat dict (absent fields are ``None``)."""
    state_type = _STATE_TYPES[cfg.family]
    fields = state_type._fields  # type: ignore[attr-defined]
    unknown = sorted(set(flat) - {"step", *fields[1:]})
    if unknown or "step" not in flat:
        raise ValueError(
            f"state keys {sorted(flat)} do not belong to optimizer {cfg.name!r} (expected 'step' and a subset of "
            f"{list(fields[1:])}): was the state dict saved by another optimizer?"
        )
    return state_type(count=flat["step"], **{name: flat.get(name) for name in fields[1:]})


def _hashable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    return value


class CoreOptimizer(torch.optim.Optimizer):
    """Any of the core's eight optimizers as a ``torch.optim.Optimizer``.

    Args:
        params: parameters or parameter groups (dicts), as for any torch optimizer;
            a group may override every keyword below.
        lr: learning rate eta; read from ``param_groups`` at every step, so
            ``torch.optim.lr_scheduler`` works.
        betas: (beta_1, beta_2).  ``beta_1 = 0`` turns momentum off.
        eps: smoothing term; ``None`` takes the family default (1e-8 Adam family,
            1e-30 Adafactor/Hfac families).
        weight_decay: decoupled weight decay lambda (``W <- W - eta (U + lambda W)``).
            The default is the core's 0.0 (``torch.optim.AdamW`` defaults to 0.01).
        update_freq: basis refresh period T (``None``: refresh at t = 1 only).
        maximize: ascend the objective (the gradient is negated before the core sees it).
        split_refresh: under ``torch.distributed`` with identical gradients on every
            rank (DDP), rank ``r`` decomposes only the ``j``-th matrices due for a
            refresh with ``j mod world_size == r`` and broadcasts their bases; the
            result is bit-identical to every rank decomposing every matrix.  Ignored
            when no process group is initialised.
        name: the core optimizer name; the subclasses fix it.
        **family_options: other core config fields (``max_basis_dim``,
            ``bias_correction``, ``state_dtype``, ``clip_threshold``, ``beta2_schedule``,
            ``decay_rate``, ``relative_step``, ``scale_parameter``, ``eps2``, ``momentum``).

    Errors: sparse or complex gradients and parameters raise ``RuntimeError``;
    a non-finite gradient or a mismatched shape or dtype raises ``ValueError``.
    Every parameter is validated before any is updated, so on an error no
    parameter and no state has changed.
    """

    core_name: str = ""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float | None = None,
        weight_decay: float = 0.0,
        update_freq: int | None = 200,
        *,
        maximize: bool = False,
        split_refresh: bool = False,
        name: str | None = None,
        **family_options: Any,
    ) -> None:
        name = name or self.core_name
        self.split_refresh = bool(split_refresh)
        if name not in ar.OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(ar.OPTIMIZERS)}")
        self.core_name = name
        self._configs: dict[tuple[Any, ...], BaseConfig] = {}
        if isinstance(lr, torch.Tensor):
            lr = float(lr)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "update_freq": update_freq,
            "maximize": bool(maximize),
            **family_options,
        }
        self._build_config(defaults)  # invalid hyperparameters raise here, before any state exists
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._build_config(group)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "core_name": self.core_name, "split_refresh": self.split_refresh}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.split_refresh = bool(state.get("split_refresh", False))
        self._configs = {}

    # ------------------------------------------------------------------ config

    def _build_config(self, group: Mapping[str, Any]) -> BaseConfig:
        """The frozen core config of a group (cached on its hyperparameter values, lr excluded)."""
        options = {k: _hashable(v) for k, v in group.items() if k not in _NOT_CONFIG}
        key = tuple(sorted(options.items()))
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = ar.make_config(self.core_name, **options)
            self._configs[key] = cfg
        return cfg

    def config(self, group_index: int = 0) -> BaseConfig:
        """The core config used for ``param_groups[group_index]`` (its ``lr`` field is overridden at each step)."""
        return self._build_config(self.param_groups[group_index])

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step for every parameter with a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            cfg = self._build_config(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = self._checked_grad(p, group)
                flat = self.state.get(p)
                state = to_core_state(flat, cfg) if flat else ar.init(p, cfg)
                ar.check_inputs(state, grad, cfg, p)
                work.append((p, grad, state, cfg, group["lr"]))
        due = [ar.refresh_due(int(state.count), cfg) for _, _, state, cfg, _ in work]
        bases = self._refresh([item for item, d in zip(work, due) if d])
        for (p, grad, state, cfg, lr), refreshed in zip(work, due):
            if refreshed:
                state = bases.pop(0)
            # same numbers as ``p += ar.update(...)[0]`` (bit for bit), without new moment tensors
            state = ar.update_in_place(state, grad, cfg, p, lr=lr, refreshed=refreshed)
            self.state[p] = from_core_state(state)
        return loss

    def _refresh(self, items: list[tuple[Any, ...]]) -> list[Any]:
        """New bases (``refresh_basis``) for the parameters due, split over ranks when asked."""
        dist = torch.distributed
        if not (self.split_refresh and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return [ar.refresh_basis(state, grad, cfg) for _, grad, state, cfg, _ in items]
        world, rank = dist.get_world_size(), dist.get_rank()
        out = []
        for j, (_, grad, state, cfg, _) in enumerate(items):
            owner = j % world
            if owner == rank:
                state = ar.refresh_basis(state, grad, cfg)
            else:  # receive into fresh buffers: the old bases may be referenced by a saved state_dict
                state = state._replace(
                    **{f: getattr(state, f).clone() for f in ("P", "Q") if getattr(state, f) is not None}
                )
            for basis in (state.P, state.Q):
                if basis is not None:
                    dist.broadcast(basis, src=owner)
            out.append(state)
        return out

    @staticmethod
    def _checked_grad(p: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
        grad = p.grad
        assert grad is not None
        if grad.is_sparse or grad.layout != torch.strided:
            raise RuntimeError(
                f"sparse gradients ({grad.layout}) are not supported: the AdaDiag optimizers rotate the dense "
                "gradient matrix; use dense gradients (e.g. nn.Embedding(sparse=False))"
            )
        if torch.is_complex(grad) or torch.is_complex(p):
            raise RuntimeError(
                f"complex parameters/gradients ({p.dtype}) are not supported: AdaDiag is defined for real "
                "parameters; optimise torch.view_as_real(param) instead"
            )
        return -grad if group["maximize"] else grad

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` output, keeping the state's own dtype.

        ``torch.optim.Optimizer.load_state_dict`` casts floating state to the
        parameter's dtype, which would round a bfloat16 parameter's float32
        moments to bfloat16; here tensors only move to the parameter's device.
        """
        saved_state = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for param_id, p in zip(saved_ids, params, strict=True):
            if param_id in saved_state:
                self.state[p] = {k: v.detach().clone().to(device=p.device) for k, v in saved_state[param_id].items()}
        for group in self.param_groups:
            self._build_config(group)


class AdamW(CoreOptimizer):
    """AdamW (identity basis), the baseline of AdaDiag.

    The core's ``'adamw'``; keywords as :class:`CoreOptimizer`.
    """

    core_name = "adamw"


class AdaDiag(CoreOptimizer):
    """AdaDiag (Algorithm 1): Adam moments in the one-sided eigenbasis, ``G~ = P^T G``.

    The core's ``'adadiag'``; keywords as :class:`CoreOptimizer`.
    """

    core_name = "adadiag"


class AdaDiagPP(CoreOptimizer):
    """AdaDiag++: Adam moments in the two-sided basis, ``G~ = P^T G Q``.

    The core's ``'adadiag_pp'``; keywords as :class:`CoreOptimizer`.
    """

    core_name = "adadiag_pp"


class Adafactor(CoreOptimizer):
    """Adafactor: factored second moment ``V = r s^T / (1^T r)`` (identity basis).

    The core's ``'adafactor'``; keywords as :class:`CoreOptimizer`.
    """

    core_name = "adafactor"


class AdafacDiag(CoreOptimizer):
    """AdafacDiag: Adafactor in the one-sided basis ``G~ = P^T G``.

    The core's ``'adafacdiag'``; keywords as :class:`CoreOptimizer`.
    """

    core_name = "adafacdiag"


class AdafacDiagPP(CoreOptimizer):
    """AdafacDiag++: Adafactor in the two-sided basis ``G~ = P^T G Q``.

    The core's ``'adafacdiag_pp'``; keywords as :class:`CoreOptimizer`.
    """

    core_name = "adafacdiag_pp"


class Hfac(CoreOptimizer):
    """Hfac: factored first and second moments (identity basis).

    The core's ``'hfac'``; keywords as :class:`CoreOptimizer`.
    """

    core_name = "hfac"


class HfacDiag(CoreOptimizer):
    """HfacDiag: Hfac in the one-sided basis ``G~ = P^T G``.

    The core's ``'hfacdiag'``; keywords as :class:`CoreOptimizer`.
    """

    core_name = "hfacdiag"


OPTIMIZER_CLASSES: dict[str, type[CoreOptimizer]] = {
    cls.core_name: cls for cls in (AdamW, AdaDiag, AdaDiagPP, Adafactor, AdafacDiag, AdafacDiagPP, Hfac, HfacDiag)
}
"""Core name -> torch class."""
