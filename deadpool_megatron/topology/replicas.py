"""Data-parallel replica placement: which ranks can give back the bytes of a rank's shard
that every data-parallel replica holds identically (parameters; with a plain optimizer, the
whole optimizer state), so those bytes need no buddy copy.

The *source* of rank ``r`` is the first data-parallel peer after it (cyclically, along the
dp coordinate) that lives on another node: losing ``r``'s whole node never loses its source
too. Taking the *next* peer makes the map a permutation whenever no two data-parallel peers
share a node (each rank serves exactly one other), so a recovery's reads are spread evenly.
``None`` when every data-parallel peer shares ``r``'s node (or there is none): the buddy
then keeps the whole shard.

Every other data-parallel peer holds the same bytes, so a recovery whose source died too
takes them from the next *holder* instead (``replica_holders_of``: the source first, then
the next peers on other nodes, then those on ``r``'s node). Only the first few are named,
so that a job of 100,000 ranks publishes a short list per rank: losing a rank together with
all of them is the one case left to the buddy's whole copy (``--deadpool-send-replicated``)
or to the durable state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

from deadpool_megatron.topology.coords import ParallelSizes, coord_of
from deadpool_megatron.topology.nodes import node_of

__all__ = ["HOLDERS", "replica_holders", "replica_holders_of", "replica_source_of",
           "replicas_lost"]

HOLDERS = 3  # data-parallel peers named per rank as holders of its replicated bytes


def _peers(rank: int, sizes: ParallelSizes) -> Iterator[int]:
    """The data-parallel peers of ``rank``, cyclically after it along the dp coordinate."""
    coord = coord_of(rank, sizes)
    stride = sizes.stride("dp")
    base = rank - coord.dp * stride
    for step in range(1, sizes.dp):
        yield base + ((coord.dp + step) % sizes.dp) * stride


def replica_holders_of(rank: int, sizes: ParallelSizes, ranks_per_node: int,
                       count: int = HOLDERS) -> tuple[int, ...]:
    """Up to ``count`` data-parallel peers holding ``rank``'s replicated bytes, in the order
    a recovery asks them: its source first. Empty where it has no source (the buddy keeps
    its whole shard)."""
    node = node_of(rank, ranks_per_node)
    away = list(islice((p for p in _peers(rank, sizes) if node_of(p, ranks_per_node) != node),
                       count))
    if not away or len(away) == count:
        return tuple(away)
    near = (p for p in _peers(rank, sizes) if node_of(p, ranks_per_node) == node)
    return tuple(away) + tuple(islice(near, count - len(away)))


def replica_source_of(rank: int, sizes: ParallelSizes, ranks_per_node: int) -> int | None:
    """The data-parallel peer of ``rank`` on another node that holds its replicated bytes."""
    holders = replica_holders_of(rank, sizes, ranks_per_node, count=1)
    return holders[0] if holders else None


def replica_holders(sizes: ParallelSizes, ranks_per_node: int) -> list[tuple[int, ...]]:
    """``replica_holders(...)[r] == replica_holders_of(r, ...)`` for every rank."""
    return [replica_holders_of(r, sizes, ranks_per_node) for r in range(sizes.world_size)]


def replicas_lost(failed: Iterable[int], holders: Sequence[Sequence[int]]) -> set[int]:
    """Failed ranks whose replicated bytes are gone with them: every named holder failed
    too (or they have none, and so rely on the buddy's whole copy: not counted here)."""
    dead = set(failed)
    return {r for r in dead if holders[r] and all(h in dead for h in holders[r])}
