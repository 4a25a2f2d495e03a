"""Sequence parallelism with megatron-core's local layer spec on CPU.

The local spec builds its norms with `WrappedTorchNorm` (torch's LayerNorm or RMSNorm),
which asserts that sequence parallelism is off. The norms that do allow it (apex's,
TransformerEngine's: neither runs on CPU) compute the same per-token normalisation and mark
their weights `sequence_parallel`, so that `finalize_model_grads` sums their gradients over
the tensor-parallel group (each rank saw only its part of the sequence). Torch's norm with
that mark is what sequence parallelism needs; that is all this workaround gives it.
"""

from __future__ import annotations

import copy
from typing import Any


def install_sequence_parallel_norm() -> Any:
    """Let WrappedTorchNorm build a norm under --sequence-parallel; returns what it replaced."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__dict__["__new__"]
    build = original.__func__ if isinstance(original, staticmethod) else original

    def new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any,
            **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return build(cls, config, hidden_size, eps, *args, **kwargs)
        plain = copy.copy(config)  # the model's own config is left as it is
        plain.sequence_parallel = False
        norm = build(cls, plain, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True  # its gradient summed over the TP group
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new)
    return original


def restore_norm(original: Any) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    WrappedTorchNorm.__new__ = original
