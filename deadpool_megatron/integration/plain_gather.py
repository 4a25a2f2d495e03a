"""All-gather of plain data (JSON: numbers, strings, lists, dicts) between ranks, never
pickle: what a peer sends is parsed as data, so a corrupt or hostile peer can make a
recovery fail with a clear error but cannot run code in this process
(`torch.distributed.all_gather_object` unpickles whatever arrives)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


class BadPeerData(RuntimeError):
    """A peer's contribution is not the plain data this collective expects."""


def collective_device(group: Any = None) -> torch.device:
    """Where a small tensor for a collective over `group` must live: an NCCL group (a GPU
    job's default group) moves CUDA tensors only, gloo host ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_plain(value: Any, group: Any = None) -> list[Any]:
    """Every rank's `value` (JSON-encodable), in group rank order. Two collectives: the
    lengths, then the bytes padded to the longest."""
    data = json.dumps(value, separators=(",", ":")).encode()
    world = dist.get_world_size(group)
    device = collective_device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(received, mine.to(device), group=group)
    out = []
    for rank, (n, buf) in enumerate(zip(lengths, received)):
        try:
            out.append(json.loads(bytes(buf[:int(n)].cpu().tolist()).decode()))
        except (UnicodeDecodeError, ValueError) as err:
            raise BadPeerData(f"group rank {rank} sent {int(n)} bytes that are not plain "
                              f"data ({err})") from None
    return out
