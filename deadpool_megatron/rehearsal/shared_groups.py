"""CPU rehearsal: Megatron groups with the same members share one gloo process group.

Every gloo process group runs a transport thread that wakes every 10 ms, plus two worker
threads. Megatron creates some twenty groups per rank whatever the model uses (expert,
context-parallel, remat groups...), most with the members of another (for TP2 x PP2 x DP2,
20 groups but 7 distinct member sets). On 2 cores that idle polling cost 20% of the
training throughput (8 processes x 30 idle groups: 23% fewer matmuls in a side-by-side
run), and creating them 170 ms of every recovery. Collectives on one gloo group run in the
order they are issued, the same on every rank, so sharing is safe for gloo; NCCL keeps its
separate communicators (their streams overlap on a GPU), so this is rehearsal-only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist


@contextlib.contextmanager
def groups_shared_by_members() -> Iterator[dict[tuple, Any]]:
    """While active, `torch.distributed.new_group` returns the group already made for the
    same members (and backend) instead of a new one. Every rank calls new_group in the same
    order, so every rank makes the same choice. Yields the groups made, by members."""
    original = dist.new_group
    made: dict[tuple, Any] = {}

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        members = tuple(sorted(ranks)) if ranks is not None else None
        key = (members, kwargs.get("backend"), kwargs.get("use_local_synchronization", False))
        if kwargs.get("pg_options") is None and key in made:
            return made[key]
        group = original(ranks, *args, **kwargs)
        made.setdefault(key, group)
        return group

    dist.new_group = new_group
    try:
        yield made
    finally:
        dist.new_group = original
