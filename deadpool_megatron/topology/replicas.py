"""Data-parallel replica placement: which rank can give back the bytes of a rank's shard
that every data-parallel replica holds identically (parameters; with a plain optimizer, the
whole optimizer state), so those bytes need no buddy copy.

The source of rank ``r`` is the first data-parallel peer after it (cyclically, along the dp
coordinate) that lives on another node: losing ``r``'s whole node never loses its source
too. Taking the *next* peer makes the map a permutation whenever no two data-parallel peers
share a node (each rank serves exactly one other), so a recovery's reads are spread evenly.
``None`` when every data-parallel peer shares ``r``'s node (or there is none): the buddy
then keeps the whole shard.
"""

from __future__ import annotations

from collections.abc import Iterable

from deadpool_megatron.topology.coords import ParallelSizes, coord_of
from deadpool_megatron.topology.nodes import node_of

__all__ = ["replica_source_of", "replica_sources", "replicas_lost"]


def replica_source_of(rank: int, sizes: ParallelSizes, ranks_per_node: int) -> int | None:
    """The data-parallel peer of ``rank`` on another node that holds its replicated bytes."""
    coord = coord_of(rank, sizes)
    stride = sizes.stride("dp")
    base = rank - coord.dp * stride
    node = node_of(rank, ranks_per_node)
    for step in range(1, sizes.dp):
        peer = base + ((coord.dp + step) % sizes.dp) * stride
        if node_of(peer, ranks_per_node) != node:
            return peer
    return None


def replica_sources(sizes: ParallelSizes, ranks_per_node: int) -> list[int | None]:
    """``replica_sources(...)[r] == replica_source_of(r, ...)`` for every rank."""
    return [replica_source_of(r, sizes, ranks_per_node) for r in range(sizes.world_size)]


def replicas_lost(failed: Iterable[int], sources: list[int | None]) -> set[int]:
    """Failed ranks whose replicated bytes are gone with them: their source failed too (or
    they have none, and so rely on the buddy's whole copy: not counted here)."""
    dead = set(failed)
    return {r for r in dead if sources[r] is not None and sources[r] in dead}
