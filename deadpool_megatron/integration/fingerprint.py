"""SHA-256 fingerprint of the whole job's training state, for bit-identity checks.

Each rank hashes its parameters, its optimizer's parameters and state (Adam moments, step)
and the scheduler's step counter; the per-rank digests are combined in rank order.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from deadpool_megatron.integration.optimizer_state import iter_optimizer_tensors
from deadpool_megatron.integration.plain_gather import all_gather_plain, collective_device


def _hash_tensor(h: "hashlib._Hash", name: str, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _hash_value(h: "hashlib._Hash", name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        _hash_tensor(h, name, value)
    else:
        h.update(f"{name}={value!r}".encode())


def rank_digest(model: list[Any], optimizer: Any, scheduler: Any) -> bytes:
    h = hashlib.sha256()
    for ci, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            _hash_tensor(h, f"model{ci}.{name}", param)
    for name, value in iter_optimizer_tensors(optimizer):
        _hash_value(h, name, value)
    _hash_value(h, "scheduler.num_steps", scheduler.num_steps)
    return h.digest()


def combine(digests: list[bytes]) -> str:
    h = hashlib.sha256()
    for d in digests:
        h.update(d)
    return h.hexdigest()


def job_fingerprint(model: list[Any], optimizer: Any, scheduler: Any, group: Any = None) -> str:
    """Collective over `group` (default: world); every rank gets the same hex digest."""
    digest = rank_digest(model, optimizer, scheduler)
    gathered = all_gather_plain(digest.hex(), group=group)
    return combine([bytes.fromhex(d) for d in gathered])


def job_param_norm(model: list[Any], group: Any = None) -> float:
    """Collective: the L2 norm over every rank's parameters (replicas counted each time),
    in float64. Two runs that differ only by floating-point reassociation (a spread replay)
    end with norms that agree to many digits, where fingerprints differ entirely."""
    local = sum(float(p.detach().double().pow(2).sum()) for chunk in model
                for p in chunk.parameters())
    total = torch.tensor([local], dtype=torch.float64, device=collective_device(group))
    torch.distributed.all_reduce(total, group=group)
    return float(total.sqrt())
