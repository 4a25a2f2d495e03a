"""Pure topology arithmetic: parallel coordinates, failure domains, buddy placement.

No processes and no ``torch.distributed`` here, so recovery logic can reason
about a partially failed job from plain integers (and be tested at scale).
"""

from deadpool_megatron.topology.buddy import (
    SameNodeBuddyError,
    buddy_map,
    buddy_of,
    lost_shards,
    pair_links,
    snapshot_pairs,
    ward_of,
)
from deadpool_megatron.topology.coords import (
    DIMS,
    MEGATRON_ORDER,
    Coord,
    ParallelSizes,
    coord_of,
    group_members,
    rank_of,
)
from deadpool_megatron.topology.nodes import node_of, num_nodes, ranks_on_node

__all__ = [
    "DIMS",
    "MEGATRON_ORDER",
    "Coord",
    "ParallelSizes",
    "SameNodeBuddyError",
    "snapshot_pairs",
    "buddy_map",
    "buddy_of",
    "coord_of",
    "group_members",
    "lost_shards",
    "pair_links",
    "node_of",
    "num_nodes",
    "rank_of",
    "ranks_on_node",
    "ward_of",
]
