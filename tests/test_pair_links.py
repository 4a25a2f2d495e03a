"""Per-pair snapshot transport: every rank makes a two-rank group with its buddy and one
with its ward, never a world-sized one, with their members alone (a rank takes part only
in the groups it is in, whatever the world's size), in an order that cannot deadlock
around the ring and forms every group within three rounds."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

from deadpool_megatron.scale.placement import counted_group_creations
from deadpool_megatron.topology import pair_links, snapshot_pairs


def _connect(rank: int, world: int, rpn: int) -> tuple[list[tuple], dict]:
    """The group creations rank's real SnapshotEngine.connect makes, and its links."""
    from deadpool_megatron.config import TrainConfig
    from deadpool_megatron.faults.injector import FaultInjector
    from deadpool_megatron.ft_config import DeadPoolConfig
    from deadpool_megatron.metrics.events import EventLog
    from deadpool_megatron.snapshot.engine import SnapshotEngine

    with counted_group_creations(rank, world) as made:
        eng = SnapshotEngine(TrainConfig(distributed_backend="gloo"),
                             DeadPoolConfig(deadpool=True, deadpool_ranks_per_node=rpn),
                             FaultInjector([], rank), EventLog(None, rank))
        eng.connect()
    assert set(eng.links) == {eng.buddy, eng.ward}
    assert all(rank in g and peer in g for peer, g in eng.links.items())
    return made, eng.links


def _rounds(order: dict[int, list[tuple[int, ...]]]) -> int | None:
    """Rounds until every group formed (a group forms once each of its members' next
    creation is it); None if some never does (a deadlock)."""
    pos = {r: 0 for r in order}
    rounds = 0
    while any(pos[r] < len(seq) for r, seq in order.items()):
        ready = {seq[pos[r]] for r, seq in order.items() if pos[r] < len(seq)
                 and all(pos[m] < len(order[m]) and order[m][pos[m]] == seq[pos[r]]
                         for m in seq[pos[r]])}
        if not ready:
            return None
        for g in ready:
            for m in g:
                pos[m] += 1
        rounds += 1
    return rounds


@pytest.mark.parametrize("world, rpn", [(2, 1), (8, 4), (12, 4), (16, 2), (9, 3), (20, 4)])
def test_each_rank_makes_only_its_own_pair_groups(world: int, rpn: int) -> None:
    """A rank makes one or two groups, each of two ranks with itself in it; together they
    are every pair of the ring once; and the members' orders form them all, in at most
    three rounds."""
    order = {}
    for rank in range(world):
        made, _ = _connect(rank, world, rpn)
        assert all(how == "pair_group" and rank in ranks and len(ranks) == 2
                   for ranks, how in made), made
        assert 1 <= len(made) <= 2
        order[rank] = [ranks for ranks, _ in made]
    assert {g for seq in order.values() for g in seq} == set(snapshot_pairs(world, rpn))
    rounds = _rounds(order)
    assert rounds is not None and rounds <= 3, rounds


def test_new_group_calls_per_rank_at_16k_ranks() -> None:
    """At 16,384 ranks every rank's connect makes two group creations, itself in both
    (before: one new_group per pair of the world on every rank, 16,384)."""
    world, rpn = 16384, 8
    for rank in (0, 7, 8191, 16383):
        made, links = _connect(rank, world, rpn)
        assert len(made) == 2 and all(rank in ranks for ranks, _ in made), made
        assert set(links) == {(rank + rpn) % world, (rank - rpn) % world}


def test_at_16k_ranks_a_rank_makes_its_two_groups_and_asks_the_world_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a world of 16,384 ranks (torch's fake backend, its store a counting one), the real
    connect: no new_group call, two real two-rank groups registered in torch's world (the
    pair groups made as on a GPU job, on the fake backend: no peer process here), and
    nothing asked of the store but what those two groups ask."""
    import functools

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from deadpool_megatron.config import TrainConfig
    from deadpool_megatron.faults.injector import FaultInjector
    from deadpool_megatron.ft_config import DeadPoolConfig
    from deadpool_megatron.metrics.events import EventLog
    from deadpool_megatron.reconstruct import pair_group as pair_mod
    from deadpool_megatron.reconstruct.spare import _register_local_backend
    from deadpool_megatron.scale.counting import CountingStore
    from deadpool_megatron.snapshot import engine as engine_mod

    world, rpn, rank = 16384, 8, 8195
    _register_local_backend()
    store = CountingStore(dist.HashStore())
    dist.init_process_group(dist.Backend.FAKE, store=store, rank=rank, world_size=world)
    try:
        before = dict(store.requests)
        monkeypatch.setattr(engine_mod.dist, "new_group", lambda *a, **k: pytest.fail(
            "new_group: every rank of the world would call it"))
        monkeypatch.setattr(engine_mod, "pair_group", functools.partial(
            pair_mod.pair_group, backend=dist.Backend.FAKE))
        eng = engine_mod.SnapshotEngine(
            TrainConfig(distributed_backend="gloo"),
            DeadPoolConfig(deadpool=True, deadpool_ranks_per_node=rpn),
            FaultInjector([], rank), EventLog(None, rank))
        eng.connect()
        groups = {id(g): g for g in eng.links.values()}.values()
        assert sorted(sorted(dist.get_process_group_ranks(g)) for g in groups) == \
            [[rank - rpn, rank], [rank, rank + rpn]]
        assert sorted(c10d._world.pg_names[g] for g in groups) == \
            [f"deadpool_snapshot_{rank - rpn}_{rank}", f"deadpool_snapshot_{rank}_{rank + rpn}"]
        assert dict(store.requests) == before  # the fake backend's groups ask nothing
    finally:
        dist.destroy_process_group()


def test_the_colouring_forms_every_ring_in_three_rounds() -> None:
    """pair_links alone (no engine), over rings of every length up to 40 and two node
    sizes: all pairs formed, at most three rounds; a fixed order of ranks would chain."""
    for rpn in (1, 4):
        for nodes in range(2, 41):
            world = nodes * rpn
            order = {r: pair_links(r, world, rpn, allow_same_node=True) for r in range(world)}
            assert _rounds(order) in ((1,) if nodes == 2 else (2, 3)), (world, rpn)
    world, shift = 40, 4
    by_ranks = {r: sorted({tuple(sorted((r, (r + shift) % world))),
                           tuple(sorted((r, (r - shift) % world)))}) for r in range(world)}
    assert _rounds(by_ranks) == world // shift - 1  # a chain around the ring


def test_ward_first_would_deadlock() -> None:
    """The order matters: creating the ward's group first, around a ring of 3 or more
    nodes, leaves every rank waiting on a ward that waits on its own ward."""
    world, shift = 12, 4
    order = {r: [tuple(sorted((r, (r - shift) % world))), tuple(sorted((r, (r + shift) % world)))]
             for r in range(world)}
    assert _rounds(order) is None


# -- real groups, made by their members alone ------------------------------------------------
def _member(rank: int, init: str, out: "mp.Queue") -> None:
    try:
        import torch
        import torch.distributed as dist

        from deadpool_megatron.reconstruct.pair_group import pair_group

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3,
                                timeout=timedelta(seconds=30))
        if rank == 1:  # unequal group counts, as Megatron-LM's initialisation leaves them
            dist.new_group([1], use_local_synchronization=True)
        result: dict = {}
        mine = [p for p in ((0, 1), (1, 2)) if rank in p]
        for a, b in mine:  # ranks 1: (0, 1) then (1, 2): colour order on a line
            group = pair_group((a, b), f"test_pair_{a}_{b}", timeout=timedelta(seconds=30),
                               group_desc="TEST_PAIR")
            peer = b if rank == a else a
            x = torch.tensor([float(rank + 1)])
            dist.all_reduce(x, group=group)
            box = torch.zeros(1)
            if rank < peer:
                dist.send(torch.tensor([10.0 * rank]), dst=peer, group=group)
                dist.recv(box, src=peer, group=group)
            else:
                dist.recv(box, src=peer, group=group)
                dist.send(torch.tensor([10.0 * rank]), dst=peer, group=group)
            result[f"{a}-{b}"] = (float(x), float(box), dist.get_process_group_ranks(group),
                                  group.group_desc)
        dist.barrier()
        out.put((rank, result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, {"error": traceback.format_exc()}))


@pytest.mark.multiproc
def test_a_pair_group_made_by_its_members_alone_carries_torchs_collectives(
        tmp_path: Path) -> None:
    """Three ranks; rank 1 holds one group more than the others. Pairs (0, 1) and (1, 2)
    are made by their members only (rank 2 never hears of (0, 1)): all_reduce, send and
    recv run on each, with group ranks translated as torch's own groups are."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rdzv'}"
    procs = [ctx.Process(target=_member, args=(r, init, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=90) for _ in procs)
    finally:
        deadline = time.monotonic() + 30
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    for rank in range(3):
        assert "error" not in results[rank], results[rank]["error"]
    assert results[0] == {"0-1": (3.0, 10.0, [0, 1], "TEST_PAIR")}
    assert results[1] == {"0-1": (3.0, 0.0, [0, 1], "TEST_PAIR"),
                          "1-2": (5.0, 20.0, [1, 2], "TEST_PAIR")}
    assert results[2] == {"1-2": (5.0, 10.0, [1, 2], "TEST_PAIR")}
