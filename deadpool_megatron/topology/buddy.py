"""Ring-buddy placement: which rank keeps the in-memory copy of whose snapshot.

Every rank keeps its own snapshot shard and one copy of exactly one other
rank's shard (its *ward*). The copy of rank ``r`` lives on its *buddy*::

    buddy_of(r) = (r + ranks_per_node) % world_size

Why a shift of exactly ``ranks_per_node``: ranks are node-contiguous
(``node = r // ranks_per_node``), so adding ``ranks_per_node`` moves to the
same local slot on the *next* node of the ring. With ``N >= 2`` nodes, node
``n``'s shards are copied to node ``(n + 1) % N != n``. Losing any one whole
node therefore destroys that node's shards (whose copies survive on node
``n + 1``) and the copies it held (of node ``n - 1``, whose originals survive):
never both a shard and its copy. The map is also a permutation, so each rank
stores exactly one extra shard (balanced memory), and buddies share a local
rank, i.e. the same GPU slot on their hosts. Limitation: losing two *adjacent*
nodes of the ring at once does lose the shards of the first one.
"""

from __future__ import annotations

from collections.abc import Iterable

from deadpool_megatron.topology.nodes import num_nodes

__all__ = ["SameNodeBuddyError", "buddy_of", "ward_of", "buddy_map", "lost_shards",
           "pair_links", "snapshot_pairs"]


class SameNodeBuddyError(ValueError):
    """Raised when every buddy would share the failure domain of its ward."""


def _shift(world_size: int, ranks_per_node: int, allow_same_node: bool) -> int:
    """Validate the layout once and return the ring shift (ranks_per_node, or 1 on one node)."""
    nodes = num_nodes(world_size, ranks_per_node)
    if world_size < 2:
        raise ValueError(
            f"world size {world_size} has no buddy: in-memory snapshot replication "
            f"needs at least 2 ranks"
        )
    if nodes >= 2:
        return ranks_per_node
    if not allow_same_node:
        raise SameNodeBuddyError(
            f"all {world_size} ranks are in a single failure domain "
            f"(--deadpool-ranks-per-node={ranks_per_node} equals the world size), so a "
            f"single failure domain cannot protect against node loss: every buddy copy "
            f"would die with its original. Set --deadpool-ranks-per-node smaller than the "
            f"world size (logical nodes) or pass --deadpool-allow-same-node-buddy to accept "
            f"same-node copies (protects only against single-process loss)."
        )
    return 1


def _check_rank(rank: int, world_size: int) -> None:
    """Out-of-range ranks would silently wrap around under modulo; reject them."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} out of range [0, {world_size})")


def buddy_of(rank: int, world_size: int, ranks_per_node: int, allow_same_node: bool = False) -> int:
    """Rank that stores ``rank``'s snapshot copy; on another node whenever >= 2 nodes exist.

    ``allow_same_node`` only matters on a single node (then buddy = rank + 1);
    with several nodes the cross-node buddy is always used.
    """
    shift = _shift(world_size, ranks_per_node, allow_same_node)
    _check_rank(rank, world_size)
    return (rank + shift) % world_size


def ward_of(rank: int, world_size: int, ranks_per_node: int, allow_same_node: bool = False) -> int:
    """Rank whose snapshot copy ``rank`` holds (inverse of :func:`buddy_of`)."""
    shift = _shift(world_size, ranks_per_node, allow_same_node)
    _check_rank(rank, world_size)
    return (rank - shift) % world_size


def buddy_map(world_size: int, ranks_per_node: int, allow_same_node: bool = False) -> list[int]:
    """``buddy_map(...)[r] == buddy_of(r, ...)`` for all ranks, computed in one pass."""
    shift = _shift(world_size, ranks_per_node, allow_same_node)
    return [(r + shift) % world_size for r in range(world_size)]


def snapshot_pairs(world_size: int, ranks_per_node: int,
                   allow_same_node: bool = False) -> list[tuple[int, int]]:
    """Every (rank, buddy) pair of the ring as (lower, higher), sorted, without repeats:
    the order in which every rank creates the two-rank snapshot groups (a rank with
    buddy == ward, as with two nodes, has one pair; a single rank has none)."""
    return sorted({(min(r, b), max(r, b))
                   for r, b in enumerate(buddy_map(world_size, ranks_per_node, allow_same_node))
                   if r != b})


def pair_links(rank: int, world_size: int, ranks_per_node: int,
               allow_same_node: bool = False) -> list[tuple[int, int]]:
    """The snapshot pairs `rank` is in, each as (lower, higher): with its buddy and with
    its ward (one pair when they are the same rank, on a ring of two; none alone), in the
    order `rank` makes their groups. O(1): a rank never looks at another's pairs.

    The order is a colouring of the ring's edges, the same for both members of a pair: the
    edge from ring position p to p + 1 gets colour p % 2, except the edge closing a ring of
    odd length, which gets colour 2. A rank's two edges have two colours, and it makes the
    lower one's group first. Every pair's group then forms: the pairs of colour 0 first
    (both members begin with them), then those of colour 1, then 2; at most three rounds,
    whatever the ring's length. (Taking pairs in a fixed order of their ranks also never
    deadlocks, but the group of each pair on the ring then waits for the one before it: a
    chain as long as the ring.)"""
    shift = _shift(world_size, ranks_per_node, allow_same_node)
    _check_rank(rank, world_size)
    buddy, ward = (rank + shift) % world_size, (rank - shift) % world_size
    if buddy == rank:
        return []
    if buddy == ward:
        return [(min(rank, buddy), max(rank, buddy))]
    length = world_size // shift  # ring length: shift divides the world (equal nodes)
    position = rank // shift

    def colour(p: int) -> int:  # of the edge from position p to p + 1
        return 2 if length % 2 and p == length - 1 else p % 2

    edges = [(colour(position), (min(rank, buddy), max(rank, buddy))),
             (colour((position - 1) % length), (min(ward, rank), max(ward, rank)))]
    return [pair for _, pair in sorted(edges)]


def lost_shards(
    failed_ranks: Iterable[int],
    world_size: int,
    ranks_per_node: int,
    allow_same_node: bool = False,
) -> set[int]:
    """Ranks whose shard AND its buddy copy both died, i.e. not recoverable from memory.

    A non-empty result means recovery must fall back to a persistent checkpoint.
    """
    shift = _shift(world_size, ranks_per_node, allow_same_node)
    failed = set(failed_ranks)
    for rank in failed:
        _check_rank(rank, world_size)
    return {r for r in failed if (r + shift) % world_size in failed}
