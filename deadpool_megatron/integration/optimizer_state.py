"""Helpers over the torch optimizers inside Megatron's optimizer wrappers."""

from __future__ import annotations

from typing import Any, Iterable

import torch


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside Megatron's (possibly chained) optimizer, in order."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in inner_optimizers(opt)]
    return [optimizer.optimizer] if getattr(optimizer, "optimizer", None) is not None else []


def iter_optimizer_tensors(optimizer: Any) -> Iterable[tuple[str, Any]]:
    """(name, value) for every optimizer parameter and state entry, in a stable order."""
    for oi, inner in enumerate(inner_optimizers(optimizer)):
        for gi, group in enumerate(inner.param_groups):
            for pi, param in enumerate(group["params"]):
                prefix = f"opt{oi}.g{gi}.p{pi}"
                yield f"{prefix}.param", param
                for key in sorted(inner.state.get(param, {})):
                    yield f"{prefix}.{key}", inner.state[param][key]


def _adam_state(param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Exactly the state torch's Adam/AdamW creates lazily at a parameter's first step
    (torch/optim/adam.py, `_init_group`), so a run that allocates it early stays
    bit-identical to one that does not."""
    from torch.optim.adam import _get_scalar_dtype

    fused = bool(group.get("fused"))
    if group.get("capturable") or fused:
        step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=param.device)
    else:
        step = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
    state = {"step": step,
             "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def allocate_optimizer_state(optimizer: Any) -> None:
    """Give every parameter its optimizer state now, as its first step would.

    The shard's layout (what a snapshot holds) is then fixed from iteration 0, so the
    initial state can be snapshotted, and a spare can receive a snapshot without a dummy
    optimizer step. Only optimizers whose lazy initialisation is known exactly are
    accepted: anything else could make the run differ from one without DeadPool.
    TransformerEngine's FusedAdam initialises through its own `initialize_state(param,
    store_param_remainders)`, which its step calls the same way (not run here: no GPU).
    """
    for inner in inner_optimizers(optimizer):
        te_init = getattr(inner, "initialize_state", None)
        if te_init is not None and not isinstance(inner, torch.optim.Adam):
            remainders = bool(getattr(inner, "store_param_remainders", False))
            for group in inner.param_groups:
                for param in group["params"]:
                    if not inner.state.get(param):
                        te_init(param, remainders)
            continue
        if not isinstance(inner, torch.optim.Adam):
            raise TypeError(
                f"DeadPool snapshots need the optimizer state allocated before the first "
                f"step, which it knows how to do for torch's Adam/AdamW only, not for "
                f"{type(inner).__module__}.{type(inner).__name__}; use --optimizer adam "
                f"without TransformerEngine/apex fused optimizers, or run without --deadpool")
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state.get(param):
                    inner.state[param] = _adam_state(param, group)
