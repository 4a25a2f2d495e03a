"""Tests for deadpool_megatron.topology: exhaustive small configs, a cross-check
against Megatron-Core's RankGenerator, error messages, and 100k-rank scale runs."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, List, Optional

import pytest

from deadpool_megatron.topology import (
    DIMS,
    MEGATRON_ORDER,
    Coord,
    ParallelSizes,
    SameNodeBuddyError,
    buddy_map,
    buddy_of,
    coord_of,
    group_members,
    lost_shards,
    node_of,
    num_nodes,
    rank_of,
    ranks_on_node,
    ward_of,
)

# Small grids: asymmetric sizes (3s) catch swapped strides that powers of 2 could hide.
SMALL_SIZES: list[tuple[int, int, int, int]] = [
    (tp, cp, pp, dp)
    for tp, cp, pp, dp in itertools.product((1, 2, 3), (1, 2), (1, 2, 3), (1, 2, 4))
]

# (world_size, ranks_per_node) layouts with at least 2 nodes.
MULTI_NODE_LAYOUTS: list[tuple[int, int]] = [
    (ws, rpn) for ws in range(2, 49) for rpn in range(1, ws) if ws % rpn == 0
]


# --------------------------------------------------------------------------- #
# Megatron-Core RankGenerator, loaded without importing megatron.core
# --------------------------------------------------------------------------- #


def _load_rank_generator() -> Callable[..., Any]:
    """Extract RankGenerator's source from the installed megatron-core.

    Importing ``megatron.core`` pulls in torch, triton, etc. (~8 s on CPU, and it
    fails outright in a CPU-only venv without triton), while RankGenerator and
    its helper are pure Python. Executing exactly their installed source keeps
    the cross-check faithful to the real code without those side effects.
    """
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    for location in spec.submodule_search_locations:
        path = Path(location) / "core" / "parallel_state.py"
        if path.is_file():
            break
    else:
        pytest.skip("megatron/core/parallel_state.py not found")
    tree = ast.parse(path.read_text(), filename=str(path))
    wanted = {"RankGenerator", "generate_masked_orthogonal_rank_groups"}
    body = [
        node
        for node in tree.body
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in wanted
    ]
    assert {node.name for node in body} == wanted, "megatron-core layout changed"
    namespace: dict[str, Any] = {"List": List, "Optional": Optional, "__name__": "mcore_extract"}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["RankGenerator"]


@pytest.fixture(scope="module")
def rank_generator() -> Callable[..., Any]:
    """Megatron-Core's RankGenerator class (loaded once per module)."""
    return _load_rank_generator()


@pytest.mark.parametrize(("tp", "cp", "pp", "dp"), SMALL_SIZES)
def test_matches_megatron_rank_generator(
    rank_generator: Callable[..., Any], tp: int, cp: int, pp: int, dp: int
) -> None:
    """Each Megatron group varies exactly one coord, in order, and equals group_members."""
    sizes = ParallelSizes(tp=tp, pp=pp, dp=dp, cp=cp)
    gen = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=MEGATRON_ORDER)
    assert gen.world_size == sizes.world_size
    for dim in DIMS:
        groups = gen.get_ranks(dim)
        assert len(groups) == sizes.world_size // sizes.size(dim)
        assert sorted(r for g in groups for r in g) == list(range(sizes.world_size))
        for group in groups:
            coords = [coord_of(r, sizes) for r in group]
            # Position i in Megatron's group has coordinate i along dim.
            assert [getattr(c, dim) for c in coords] == list(range(sizes.size(dim)))
            for other in DIMS:
                if other != dim:
                    assert len({getattr(c, other) for c in coords}) == 1, (dim, other, group)
            for r in group:
                assert group_members(r, sizes, dim) == group


# --------------------------------------------------------------------------- #
# coords
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(("tp", "cp", "pp", "dp"), SMALL_SIZES)
def test_coord_round_trip_exhaustive(tp: int, cp: int, pp: int, dp: int) -> None:
    """coord_of is a bijection onto the grid and rank_of is its inverse."""
    sizes = ParallelSizes(tp=tp, pp=pp, dp=dp, cp=cp)
    coords = [coord_of(r, sizes) for r in range(sizes.world_size)]
    assert len(set(coords)) == sizes.world_size
    for r, c in enumerate(coords):
        assert rank_of(c, sizes) == r
        assert 0 <= c.tp < tp and 0 <= c.cp < cp and 0 <= c.pp < pp and 0 <= c.dp < dp
    for t, c_, p, d in itertools.product(range(tp), range(cp), range(pp), range(dp)):
        assert coord_of(rank_of(Coord(tp=t, cp=c_, pp=p, dp=d), sizes), sizes) == Coord(t, c_, p, d)


def test_rank_order_is_tp_cp_dp_pp() -> None:
    """tp fastest, then cp, then dp, then pp (Megatron's tp-cp-ep-dp-pp)."""
    sizes = ParallelSizes(tp=2, pp=2, dp=2, cp=2)
    assert coord_of(1, sizes) == Coord(tp=1, cp=0, pp=0, dp=0)
    assert coord_of(2, sizes) == Coord(tp=0, cp=1, pp=0, dp=0)
    assert coord_of(4, sizes) == Coord(tp=0, cp=0, pp=0, dp=1)
    assert coord_of(8, sizes) == Coord(tp=0, cp=0, pp=1, dp=0)
    assert [sizes.stride(d) for d in DIMS] == [1, 2, 4, 8]


def test_group_members_examples() -> None:
    sizes = ParallelSizes.from_world(16, tp=2, pp=2)
    assert sizes == ParallelSizes(tp=2, pp=2, dp=4, cp=1)
    assert group_members(5, sizes, "tp") == [4, 5]
    assert group_members(5, sizes, "dp") == [1, 3, 5, 7]
    assert group_members(5, sizes, "pp") == [5, 13]
    assert group_members(5, sizes, "cp") == [5]


def test_parallel_sizes_world_and_frozen() -> None:
    sizes = ParallelSizes(tp=8, pp=10, dp=1250)
    assert sizes.world_size == 100_000
    assert sizes.cp == 1
    with pytest.raises(AttributeError):
        sizes.tp = 4  # type: ignore[misc]
    assert hash(sizes) == hash(ParallelSizes(tp=8, pp=10, dp=1250, cp=1))


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"tp": 0, "pp": 1, "dp": 1}, "--tensor-model-parallel-size"),
        ({"tp": 1, "pp": -2, "dp": 1}, "--pipeline-model-parallel-size"),
        ({"tp": 1, "pp": 1, "dp": 1, "cp": 0}, "--context-parallel-size"),
        ({"tp": 1, "pp": 1, "dp": 0}, "data-parallel size"),
        ({"tp": True, "pp": 1, "dp": 1}, "--tensor-model-parallel-size"),
    ],
)
def test_parallel_sizes_rejects_non_positive(kwargs: dict[str, int], flag: str) -> None:
    with pytest.raises(ValueError, match="must be a positive integer") as info:
        ParallelSizes(**kwargs)
    assert flag in str(info.value)


def test_from_world_not_divisible_names_flags() -> None:
    with pytest.raises(ValueError) as info:
        ParallelSizes.from_world(12, tp=4, pp=2, cp=1)
    msg = str(info.value)
    for flag in (
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
    ):
        assert flag in msg
    assert "12" in msg and "8" in msg


def test_from_world_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="--context-parallel-size"):
        ParallelSizes.from_world(8, tp=2, pp=2, cp=0)
    with pytest.raises(ValueError, match="world size"):
        ParallelSizes.from_world(0, tp=1, pp=1)


def test_coord_errors() -> None:
    sizes = ParallelSizes(tp=2, pp=2, dp=2)
    with pytest.raises(ValueError, match="out of range"):
        coord_of(8, sizes)
    with pytest.raises(ValueError, match="out of range"):
        coord_of(-1, sizes)
    with pytest.raises(ValueError, match="pp=2"):
        rank_of(Coord(tp=0, cp=0, pp=2, dp=0), sizes)
    with pytest.raises(ValueError, match="unknown parallel dimension"):
        group_members(0, sizes, "ep")


# --------------------------------------------------------------------------- #
# nodes
# --------------------------------------------------------------------------- #


def test_nodes_basic() -> None:
    assert num_nodes(16, 8) == 2
    assert [node_of(r, 4) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert list(ranks_on_node(1, 8, 4)) == [4, 5, 6, 7]


@pytest.mark.parametrize("rpn", [0, -4])
def test_nodes_reject_non_positive(rpn: int) -> None:
    with pytest.raises(ValueError, match="--deadpool-ranks-per-node"):
        num_nodes(8, rpn)
    with pytest.raises(ValueError, match="--deadpool-ranks-per-node"):
        node_of(0, rpn)


@pytest.mark.parametrize(("ws", "rpn"), [(10, 4), (8, 16), (7, 2)])
def test_nodes_reject_non_dividing(ws: int, rpn: int) -> None:
    with pytest.raises(ValueError, match="--deadpool-ranks-per-node.*must divide"):
        num_nodes(ws, rpn)
    with pytest.raises(ValueError, match="--deadpool-ranks-per-node"):
        buddy_map(ws, rpn)


# --------------------------------------------------------------------------- #
# buddy placement
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(("ws", "rpn"), MULTI_NODE_LAYOUTS)
def test_buddy_properties_exhaustive(ws: int, rpn: int) -> None:
    """Cross-node, permutation, inverse, map agreement, and same local slot."""
    bmap = buddy_map(ws, rpn)
    assert sorted(bmap) == list(range(ws))
    for r in range(ws):
        b = buddy_of(r, ws, rpn)
        assert b == bmap[r]
        assert node_of(b, rpn) != node_of(r, rpn)
        assert b % rpn == r % rpn
        assert ward_of(b, ws, rpn) == r
        assert buddy_of(ward_of(r, ws, rpn), ws, rpn) == r
        # allow_same_node changes nothing when >= 2 nodes exist.
        assert buddy_of(r, ws, rpn, allow_same_node=True) == b


@pytest.mark.parametrize(("ws", "rpn"), MULTI_NODE_LAYOUTS)
def test_losing_any_one_node_loses_nothing(ws: int, rpn: int) -> None:
    """The core guarantee: a whole-node failure is always recoverable from memory."""
    for node in range(num_nodes(ws, rpn)):
        assert lost_shards(ranks_on_node(node, ws, rpn), ws, rpn) == set()


@pytest.mark.parametrize(("ws", "rpn"), MULTI_NODE_LAYOUTS)
def test_lost_shards_matches_definition_for_pairs(ws: int, rpn: int) -> None:
    """Any two failed ranks: lost iff one is the other's buddy."""
    for a, b in itertools.combinations(range(ws), 2):
        expected = {r for r in (a, b) if buddy_of(r, ws, rpn) in (a, b)}
        assert lost_shards([a, b], ws, rpn) == expected


def test_losing_adjacent_nodes_is_documented_limitation() -> None:
    """Two neighbouring nodes in the ring do lose the first node's shards."""
    failed = list(ranks_on_node(0, 32, 8)) + list(ranks_on_node(1, 32, 8))
    assert lost_shards(failed, 32, 8) == set(range(8))
    # Non-adjacent double failure is still fine.
    failed = list(ranks_on_node(0, 32, 8)) + list(ranks_on_node(2, 32, 8))
    assert lost_shards(failed, 32, 8) == set()


def test_lost_shards_edge_cases() -> None:
    assert lost_shards([], 16, 4) == set()
    assert lost_shards(iter([0, 4]), 16, 4) == {0}
    with pytest.raises(ValueError, match="out of range"):
        lost_shards([16], 16, 4)


@pytest.mark.parametrize("ws", [2, 3, 4, 8])
def test_single_node_requires_opt_in(ws: int) -> None:
    for call in (
        lambda: buddy_of(0, ws, ws),
        lambda: ward_of(0, ws, ws),
        lambda: buddy_map(ws, ws),
        lambda: lost_shards([0], ws, ws),
    ):
        with pytest.raises(SameNodeBuddyError) as info:
            call()
        msg = str(info.value)
        assert isinstance(info.value, ValueError)
        assert "single failure domain cannot protect against node loss" in msg
        assert "--deadpool-ranks-per-node" in msg
        assert "smaller than the world size" in msg
        assert "--deadpool-allow-same-node-buddy" in msg


@pytest.mark.parametrize("ws", [2, 3, 4, 8])
def test_single_node_opt_in_uses_next_rank(ws: int) -> None:
    bmap = buddy_map(ws, ws, allow_same_node=True)
    assert bmap == [(r + 1) % ws for r in range(ws)]
    for r in range(ws):
        assert bmap[r] != r
        assert buddy_of(r, ws, ws, allow_same_node=True) == bmap[r]
        assert ward_of(bmap[r], ws, ws, allow_same_node=True) == r
    # A single-process failure loses nothing; the whole node loses everything.
    assert lost_shards([0], ws, ws, allow_same_node=True) == set()
    assert lost_shards(range(ws), ws, ws, allow_same_node=True) == set(range(ws))


@pytest.mark.parametrize("allow", [False, True])
def test_world_size_one_has_no_buddy(allow: bool) -> None:
    with pytest.raises(ValueError, match="no buddy") as info:
        buddy_of(0, 1, 1, allow_same_node=allow)
    assert not isinstance(info.value, SameNodeBuddyError)
    with pytest.raises(ValueError, match="no buddy"):
        buddy_map(1, 1, allow_same_node=allow)


def test_buddy_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="out of range"):
        buddy_of(16, 16, 4)
    with pytest.raises(ValueError, match="out of range"):
        ward_of(-1, 16, 4)


# --------------------------------------------------------------------------- #
# scale: 100,000 simulated ranks
# --------------------------------------------------------------------------- #

SCALE = SimpleNamespace(tp=8, pp=10, dp=1250, ranks_per_node=8)


def test_scale_100k_buddy_map() -> None:
    sizes = ParallelSizes(tp=SCALE.tp, pp=SCALE.pp, dp=SCALE.dp)
    ws, rpn = sizes.world_size, SCALE.ranks_per_node
    assert ws == 100_000

    start = time.perf_counter()
    bmap = buddy_map(ws, rpn)
    built = time.perf_counter() - start

    assert len(bmap) == ws
    assert len(set(bmap)) == ws and min(bmap) == 0 and max(bmap) == ws - 1  # permutation
    assert all(b // rpn != r // rpn for r, b in enumerate(bmap))  # buddy on another node
    assert all(buddy_of(r, ws, rpn) == b for r, b in enumerate(bmap))
    assert all(ward_of(b, ws, rpn) == r for r, b in enumerate(bmap))
    for node in (0, 1, num_nodes(ws, rpn) // 2, num_nodes(ws, rpn) - 1):
        assert lost_shards(ranks_on_node(node, ws, rpn), ws, rpn) == set()
    total = time.perf_counter() - start
    print(
        f"\n[scale] buddy_map({ws:,} ranks, {num_nodes(ws, rpn):,} nodes): "
        f"build {built * 1e3:.1f} ms; build+checks {total * 1e3:.1f} ms"
    )


def test_scale_100k_coords() -> None:
    sizes = ParallelSizes(tp=SCALE.tp, pp=SCALE.pp, dp=SCALE.dp)
    ws = sizes.world_size

    start = time.perf_counter()
    coords = [coord_of(r, sizes) for r in range(ws)]
    built = time.perf_counter() - start

    assert len(set(coords)) == ws
    assert all(rank_of(c, sizes) == r for r, c in enumerate(coords))
    for r in (0, 1, 7, 8, 9_999, 10_000, 54_321, ws - 1):
        for dim in DIMS:
            members = group_members(r, sizes, dim)
            assert len(members) == sizes.size(dim) and r in members
            assert all(
                getattr(coord_of(m, sizes), o) == getattr(coords[r], o)
                for m in members
                for o in DIMS
                if o != dim
            )
    total = time.perf_counter() - start
    print(
        f"\n[scale] coord_of over {ws:,} ranks (tp={sizes.tp}, pp={sizes.pp}, dp={sizes.dp}): "
        f"build {built * 1e3:.1f} ms; build+round-trip+groups {total * 1e3:.1f} ms"
    )


# -- data-parallel replica placement (topology/replicas.py) ---------------------------------
from deadpool_megatron.topology.replicas import (  # noqa: E402
    HOLDERS,
    replica_holders,
    replica_source_of,
    replicas_lost,
)


def test_replica_source_is_a_dp_peer_on_another_node_at_100k_ranks() -> None:
    from deadpool_megatron.topology import coord_of, node_of

    sizes = ParallelSizes.from_world(100_000, tp=8, pp=5)  # dp = 2500
    rpn = 8  # one tensor-parallel group per node: dp peers are on distinct nodes
    holders = replica_holders(sizes, rpn)
    sources = [h[0] for h in holders]
    for r, s in enumerate(sources):
        assert s is not None
        a, b = coord_of(r, sizes), coord_of(s, sizes)
        assert (a.tp, a.cp, a.pp) == (b.tp, b.cp, b.pp) and a.dp != b.dp
        assert node_of(s, rpn) != node_of(r, rpn)
    # A permutation: every rank serves exactly one other.
    assert sorted(sources) == list(range(100_000))
    # The holders: the source first, then further dp peers, a few per rank only.
    for r in (0, 1, 77_777, 99_999):
        a = coord_of(r, sizes)
        assert holders[r][0] == replica_source_of(r, sizes, rpn)
        assert len(set(holders[r])) == HOLDERS
        assert all((coord_of(h, sizes).tp, coord_of(h, sizes).pp) == (a.tp, a.pp)
                   and coord_of(h, sizes).dp != a.dp for h in holders[r])
    # Losing any whole node never loses a rank's replicated bytes with it.
    for node in (0, 1, 6_249, 12_499):
        assert not replicas_lost(range(node * rpn, (node + 1) * rpn), holders)


def test_no_replica_source_when_every_dp_peer_shares_the_node() -> None:
    sizes = ParallelSizes.from_world(16, tp=1, pp=2)  # dp = 8, dp peers are contiguous
    assert replica_source_of(0, sizes, ranks_per_node=8) is None  # dp peers 0..7: one node
    assert replica_source_of(0, sizes, ranks_per_node=4) == 4  # first peer on node 1
    assert replica_source_of(7, sizes, ranks_per_node=4) == 0  # cyclic
    assert replica_source_of(0, ParallelSizes.from_world(4, tp=4, pp=1), 1) is None  # dp=1


def test_replicas_lost_needs_every_holder_dead_too() -> None:
    holders = [(1,), (0,), (3,), (2,)]
    assert replicas_lost({0}, holders) == set()
    assert replicas_lost({0, 1}, holders) == {0, 1}
    assert replicas_lost({2}, [(), (), (), ()]) == set()
    three = [(1, 2), (2, 0), (0, 1)]  # dp = 3: two holders each
    assert replicas_lost({0, 1}, three) == set()  # 2 holds both
    assert replicas_lost({0, 1, 2}, three) == {0, 1, 2}


def test_holders_go_to_other_nodes_first_then_the_own_node() -> None:
    sizes = ParallelSizes.from_world(8, tp=2, pp=1)  # dp = 4: peers of 2 are 4, 6, 0
    assert replica_holders(sizes, 4)[2] == (4, 6, 0)  # 4, 6 on node 1; 0 shares node 0
    assert replica_holders(sizes, 4)[4] == (0, 2, 6)
    assert replica_holders(sizes, 8)[2] == ()  # one node: no source, the buddy keeps all
    assert replica_holders(ParallelSizes.from_world(2, tp=1, pp=1), 1) == [(1,), (0,)]
