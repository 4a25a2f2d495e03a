"""Two-rank gloo groups made by their two members alone (snapshot pairs, replica fetches).

torch's `new_group` must be called by every rank of the world, member or not, in one
global order: for the snapshot pairs of a ring that is one call per pair of the world on
every rank, O(N) calls per rank per generation. `new_group(use_local_synchronization=True)`
lets only the members call, but names the group by hashing its ranks with how many groups
the calling process already has, which Megatron-LM's initialisation leaves unequal across
ranks: the two members would then wait on different store keys until the timeout.

So the group is made the way `new_group` makes it (`_new_process_group_helper`: a gloo
backend on the generation's default store under a prefix of the group's name, registered
in torch's world with its ranks, so every collective and send/recv of torch's accepts it),
with a name both members derive from the pair itself: nothing world-wide is counted. The
generation's default store is already under `dp/gen{g}/pg/`, so the same pair's group of
another generation never meets this one's keys; within a generation each name is made
once (its callers make each pair once).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def pair_group(ranks: tuple[int, int], name: str, timeout: timedelta, group_desc: str,
               backend: str = dist.Backend.GLOO) -> dist.ProcessGroup:
    """The gloo group of `ranks` (this rank and one peer), called by those two only.
    `name` must be the same on both and unique among this generation's groups. (`backend`:
    torch's "fake" one in tests, where the peer is not a process.)"""
    members = sorted(ranks)
    rank = dist.get_rank()
    if len(set(members)) != 2 or rank not in members:
        raise ValueError(f"rank {rank} cannot make the two-rank group {members}")
    default = c10d._get_default_group()
    _, default_store = c10d._world.pg_map[default]
    group, _ = c10d._new_process_group_helper(
        2, members.index(rank), members, dist.Backend(backend), default_store,
        c10d.GroupName(name) if hasattr(c10d, "GroupName") else name, timeout=timeout,
        group_desc=group_desc)
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(members)}
    return group
