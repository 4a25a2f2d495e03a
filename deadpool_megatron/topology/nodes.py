"""Failure domains: which node (the unit that dies together) hosts a rank.

Ranks are assumed to be laid out node-contiguously, as torchrun does
(``rank = node_rank * nproc_per_node + local_rank``). A "node" here may also be
a logical node (a smaller group of ranks declared via
``--deadpool-ranks-per-node``) when the physical topology is a single host.
"""

from __future__ import annotations

__all__ = ["node_of", "num_nodes", "ranks_on_node"]

_FLAG = "--deadpool-ranks-per-node"


def _check_ranks_per_node(ranks_per_node: int) -> None:
    """A non-positive node size makes every node computation meaningless."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node <= 0:
        raise ValueError(f"{_FLAG} must be a positive integer, got {ranks_per_node!r}")


def num_nodes(world_size: int, ranks_per_node: int) -> int:
    """Number of failure domains; nodes must be equally sized so buddy shifts line up."""
    _check_ranks_per_node(ranks_per_node)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if world_size % ranks_per_node != 0:
        raise ValueError(
            f"{_FLAG} ({ranks_per_node}) must divide the world size ({world_size}); "
            f"every node must host the same number of ranks"
        )
    return world_size // ranks_per_node


def node_of(rank: int, ranks_per_node: int) -> int:
    """Node index hosting ``rank`` under node-contiguous placement."""
    _check_ranks_per_node(ranks_per_node)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
    return rank // ranks_per_node


def ranks_on_node(node: int, world_size: int, ranks_per_node: int) -> range:
    """All ranks that die together when ``node`` is lost."""
    n = num_nodes(world_size, ranks_per_node)
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < n:
        raise ValueError(f"node {node!r} out of range [0, {n})")
    return range(node * ranks_per_node, (node + 1) * ranks_per_node)
