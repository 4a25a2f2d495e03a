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


def materialize_optimizer_state(optimizer: Any) -> None:
    """Give a fresh optimizer its state tensors, so that state can be loaded into it.

    torch's Adam creates its state lazily at the first step, and Megatron's distributed
    optimizer (without apex/TE) cannot describe an empty state. A zero-gradient step creates
    it; everything it touches is overwritten by the load that follows.
    """
    for inner in inner_optimizers(optimizer):
        if inner.state:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        with torch.no_grad():
            inner.step()
        inner.zero_grad(set_to_none=True)
