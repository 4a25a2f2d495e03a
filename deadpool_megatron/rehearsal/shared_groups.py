"""CPU rehearsal: Megatron groups with the same members share one gloo process group.

Every gloo process group runs a transport thread that wakes every 10 ms, plus two worker
threads. Megatron creates some twenty groups per rank whatever the model uses (expert,
context-parallel, remat groups...), most with the members of another (for TP2 x PP2 x DP2,
20 groups but 7 distinct member sets). On 2 cores that idle polling cost 20% of the
training throughput (8 processes x 30 idle groups: 23% fewer matmuls in a side-by-side
run), and creating them 170 ms of every recovery. Collectives on one gloo group run in the
order they are issued, the same on every rank, so sharing is safe for gloo; NCCL keeps its
separate communicators (their streams overlap on a GPU), so this is rehearsal-only.

Every rank also calls new_group for every group of the world, its own or not: some 80
calls per rank at 8 ranks, twice that at 16, all on the same 2 cores. For a gloo group a
rank is not in, torch only counts the call (the count names the next group), so the count
is advanced here without the call.

A Megatron group of the whole world (the distributed optimizer's instance group with one
instance, the model-parallel group where data parallelism is 1) is the default group: the
same members, used by the same training thread. Each would otherwise be a second full mesh
of the world, made again at every recovery since a world-sized group always holds the
replaced rank (about 10 of the 100 ms a recovery spends forming groups at 8 ranks here).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


@contextlib.contextmanager
def groups_shared_by_members() -> Iterator[dict[tuple, Any]]:
    """While active, `torch.distributed.new_group` returns the group already made for the
    same members (and backend: Megatron-LM's `_GLOO` copies name gloo, the default one
    here) instead of a new one. Every rank calls new_group in the same order, so every rank
    makes the same choice. Yields the groups made, by members."""
    original = dist.new_group
    made: dict[tuple, Any] = {}
    if dist.is_initialized():
        world = tuple(range(dist.get_world_size()))
        made[(world, _backend(None), False)] = c10d._get_default_group()

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        members = tuple(sorted(ranks)) if ranks is not None else None
        key = (members, _backend(kwargs.get("backend")),
               kwargs.get("use_local_synchronization", False))
        plain = kwargs.get("pg_options") is None and not args
        if plain and key in made:
            return made[key]
        if plain and members is not None and not key[2] and dist.get_rank() not in members:
            c10d._world.group_count += 1  # as torch's own call would (it names groups)
            made[key] = dist.GroupMember.NON_GROUP_MEMBER
            return made[key]
        group = original(ranks, *args, **kwargs)
        made.setdefault(key, group)
        return group

    dist.new_group = new_group
    try:
        yield made
    finally:
        dist.new_group = original


def _backend(asked: Any) -> str:
    """The backend a new group gets: the one asked for, else the default group's. In a
    spare's local world every group is local, whatever it asks for (reconstruct/spare.py):
    there a `_GLOO` copy shares too, as it will in the generation the spare joins."""
    default = str(dist.get_backend()).lower()
    if asked is None or default == str(dist.Backend.FAKE).lower():
        return default
    return str(asked).lower()
