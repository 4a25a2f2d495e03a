"""The store requests of the process groups a member makes again in a recovery, counted as
torch makes them (the harness's members make no group; this is their share, computed).

Which groups: the generation's default group (the world), every Megatron-Core group the
rank is in (found by running Megatron's own `initialize_model_parallel` in a world of
torch's fake backend, for one rank: its `new_group` calls, the rank's own ones made, the
others only counted), and the two-rank gloo groups of its snapshot pairs.

What one group costs each of its members in store requests (torch 2.13; a `get` is two
requests, WAIT then GET, and so is a `multi_get`):
- NCCL (a GPU job), at the communicator's creation: group rank 0 sets the unique id (one
  SET), every other member gets it (two). A group larger than TORCH_NCCL_RANKS_PER_ROOT
  (128) is made by ncclCommInitRankScalable: one root per 128 ranks sets its id, every
  member gets them all in one multi_get (two requests, 128 bytes per root). torch's
  store-based barrier after a group's creation is off unless TORCH_DIST_INIT_BARRIER=1.
- gloo (the CPU rehearsal), measured with a counting store (tests/test_scale_harness.py):
  one SET of the member's address, then a wait and a get per member of the group, itself
  included: 1 + 3 * size requests: a full mesh, so O(size) per member.

With the groups no failure touched kept (reconstruct/keep.py: gloo today; NCCL would need a
per-communicator abort), a member makes again only the world, its snapshot pairs and the
Megatron groups the policy does not keep: those with the replaced rank and those within
its replica (and the reduction barrier of its data-parallel group). Their
share is averaged over every member, from every group Megatron makes (each rank names them
all). Keeping costs the survivors the groups' agreement on the control plane's store
(keep.agree): its requests are counted beside the groups'.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

RANKS_PER_ROOT = 128  # TORCH_NCCL_RANKS_PER_ROOT's default


def nccl_share(size: int) -> float:
    """One group's NCCL requests per member, averaged over its members."""
    if size > RANKS_PER_ROOT:
        roots = math.ceil(size / RANKS_PER_ROOT)
        return 2 + roots / size
    return (1 + 2 * (size - 1)) / size


def gloo_requests(size: int) -> int:
    """Store requests of one member at one gloo group's creation (a full mesh)."""
    return 1 + 3 * size


def agreement_requests(candidates: list[tuple[int, ...]]) -> float:
    """One member's store requests in the groups' agreement (keep.agree) over candidates of
    these ranks: per set of more than one rank, the reference's compare_set and the count's
    add, and the last member's "keep" on each of the set's k candidates, shared among its s
    members (k / s); then one done mark, one wait for the verdicts and their read (one
    request for one verdict, a multi_get's two for more). Counted for every member: the
    last member of all its sets waits for and reads none (rare with several sets); a wait
    that outlasts its slice adds checks."""
    sets = collections.Counter(ranks for ranks in candidates if len(ranks) > 1)
    shared = sum(sets.values())
    requests = sum(2 + k / len(ranks) for ranks, k in sets.items()) + 1
    return requests + (1 + (1 if shared == 1 else 2) if shared else 0)


@dataclass(frozen=True)
class GroupCost:
    groups: int  # groups a member makes again
    nccl: float  # their store requests per member, NCCL (the snapshot pairs: gloo)
    gloo: float  # the same groups all with gloo (the CPU rehearsal)
    largest: int  # the largest group's size


@dataclass(frozen=True)
class MegatronGroups:
    """Megatron-Core's groups, seen from one rank: the sizes of those it is in, and every
    group of the job (description, ranks), as every rank names them all."""

    mine: list[int]
    every: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)


def megatron_groups(world: int, tp: int, pp: int, rank: int = 0) -> MegatronGroups:
    """The Megatron-Core groups of a job (Megatron's own code decides)."""
    import torch.distributed as dist

    from deadpool_megatron.rehearsal.imports import prepare_megatron_import

    prepare_megatron_import(True)
    from megatron.core import parallel_state as ps

    from deadpool_megatron.reconstruct.spare import local_world

    found = MegatronGroups(mine=[])
    original = dist.new_group

    def new_group(ranks=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if ranks is not None:
            found.every.append((str(kwargs.get("group_desc") or ""), tuple(ranks)))
            if rank not in ranks:
                return dist.GroupMember.NON_GROUP_MEMBER  # torch: no store request either
        found.mine.append(world if ranks is None else len(ranks))
        return original(ranks, *args, **kwargs)

    with local_world(rank, world):
        dist.new_group = new_group
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                         pipeline_model_parallel_size=pp,
                                         create_gloo_process_groups=False)
        finally:
            dist.new_group = original
    return found


def recovery_groups(world: int, megatron_sizes: list[int], pair_groups: int) -> GroupCost:
    """A member's groups in a recovery: the world, Megatron's, its snapshot pairs."""
    sizes = [world, *megatron_sizes]
    nccl = sum(nccl_share(s) for s in sizes) + pair_groups * gloo_requests(2)
    gloo = sum(gloo_requests(s) for s in sizes) + pair_groups * gloo_requests(2)
    return GroupCost(groups=len(sizes) + pair_groups, nccl=nccl, gloo=gloo,
                     largest=max(sizes))


@dataclass(frozen=True)
class KeptCost:
    groups: float  # Megatron-Core groups a member makes again, averaged over the members
    builders: int  # ranks that make a group of 2 to N-1 ranks again (every rank makes the
    # world-sized ones again: the default group, Megatron's distributed-optimizer instance)
    nccl: float  # store requests per member, averaged over the members, NCCL
    gloo: float  # the same, gloo
    agreement: float  # the groups' agreement's control-plane requests, per member


def kept_recovery_groups(world: int, tp: int, pp: int, every: list[tuple[str, tuple[int, ...]]],
                         replaced: int, pair_groups: int) -> KeptCost:
    """A member's share of the groups made again when `replaced` is and the others are
    kept (keep.keepable), and of the survivors' agreement on keeping them."""
    from deadpool_megatron.reconstruct.keep import keepable
    from deadpool_megatron.topology import ParallelSizes, coord_of, group_members

    sizes = ParallelSizes.from_world(world, tp, pp)

    def replica_of(r: int) -> int:
        return coord_of(r, sizes).dp

    lost = {replica_of(replaced)}
    remade: list[tuple[int, ...]] = []
    named: dict[int, list[tuple[int, ...]]] = {r: [] for r in range(world) if r != replaced}
    for desc, ranks in every:
        if keepable((desc, ranks, 0), {replaced}, replica_of, lost):
            for r in ranks:  # a candidate each of its members names in the agreement
                named[r].append(ranks)
        else:
            remade.append(ranks)
    remade.append(tuple(group_members(replaced, sizes, "dp")))  # the reduction barrier's
    builders = set().union(*(set(r) for r in remade if 1 < len(r) < world))
    nccl = nccl_share(world) + pair_groups * gloo_requests(2) + \
        sum(len(r) * nccl_share(len(r)) for r in remade) / world
    gloo = gloo_requests(world) + pair_groups * gloo_requests(2) + \
        sum(len(r) * gloo_requests(len(r)) for r in remade) / world
    agreement = sum(agreement_requests(candidates) for candidates in named.values()) / world
    return KeptCost(groups=sum(len(r) for r in remade) / world, builders=len(builders),
                    nccl=nccl, gloo=gloo, agreement=agreement)
