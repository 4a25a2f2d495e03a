"""Every RNG stream a rank draws from: torch CPU, CUDA, and Megatron's tensor-parallel tracker."""

from __future__ import annotations

from typing import Any

import torch


def get_rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])
