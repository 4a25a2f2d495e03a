"""Every RNG stream a rank draws from, as tensors and plain data: Python's `random`, NumPy's
global generator, torch CPU, CUDA on every device, and Megatron's tensor-parallel tracker.

Restored, never re-seeded: a rank restored from a snapshot continues each stream where the
snapshot left it, as the failure-free run does. The state travels to a buddy and back, so
it holds nothing that needs unpickling (snapshot/manifest.py loads it weights-only).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _python_state() -> dict[str, Any]:
    version, words, gauss = random.getstate()
    return {"version": version, "words": torch.from_numpy(np.array(words, dtype=np.int64)),
            "gauss": gauss}


def _set_python_state(state: dict[str, Any]) -> None:
    words = tuple(int(w) for w in state["words"].tolist())
    random.setstate((int(state["version"]), words, state["gauss"]))


def _numpy_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _set_numpy_state(state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["kind"], keys, state["pos"], state["has_gauss"], state["gauss"]))


def _cuda_state() -> dict[str, Any]:
    return {"device": torch.cuda.current_device(), "all": torch.cuda.get_rng_state_all()}


def _set_cuda_state(state: dict[str, Any]) -> None:
    """Every device's state back; the rank's own device's state goes to this process's
    device, which differs when a spare (its own GPU) takes the rank."""
    saved = list(state["all"])
    count = torch.cuda.device_count()
    for index, device_state in enumerate(saved[:count]):
        torch.cuda.set_rng_state(device_state, index)
    torch.cuda.set_rng_state(saved[int(state["device"])], torch.cuda.current_device())


def get_rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state: dict[str, Any] = {"python": _python_state(), "numpy": _numpy_state(),
                             "torch": torch.get_rng_state(),
                             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = _cuda_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    _set_python_state(state["python"])
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        _set_cuda_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])
