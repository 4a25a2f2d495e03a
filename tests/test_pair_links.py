"""Per-pair snapshot transport: every rank creates a two-rank group with its buddy and one
with its ward, never a world-sized one, in an order that cannot deadlock around the ring."""

from __future__ import annotations

import pytest

from deadpool_megatron.faults.injector import FaultInjector
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.config import TrainConfig
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.snapshot import engine as engine_mod


def _creations(monkeypatch: pytest.MonkeyPatch, world: int, rpn: int) -> dict[int, list]:
    """The groups each rank's `connect` creates, in order, and the links it ends with."""
    calls: dict[int, list] = {}
    for rank in range(world):
        made: list = []
        monkeypatch.setattr(engine_mod.dist, "get_rank", lambda r=rank: r)
        monkeypatch.setattr(engine_mod.dist, "get_world_size", lambda: world)
        monkeypatch.setattr(engine_mod.dist, "new_group",
                            lambda ranks, **kw: made.append((tuple(ranks), kw)) or tuple(ranks))
        eng = engine_mod.SnapshotEngine(
            TrainConfig(distributed_backend="gloo"),
            DeadPoolConfig(deadpool=True, deadpool_ranks_per_node=rpn),
            FaultInjector([], rank), EventLog(None, rank))
        eng.connect()
        assert set(eng.links) == {eng.buddy, eng.ward}
        assert all(rank in g and peer in g for peer, g in eng.links.items())
        calls[rank] = made
    return calls


def _completes(order: dict[int, list[tuple[int, ...]]]) -> bool:
    """A group forms once each member's next creation is it; True if all of them form."""
    pos = {r: 0 for r in order}
    progress = True
    while progress:
        progress = False
        for r, seq in order.items():
            if pos[r] < len(seq):
                g = seq[pos[r]]
                if all(pos[m] < len(order[m]) and order[m][pos[m]] == g for m in g):
                    for m in g:
                        pos[m] += 1
                    progress = True
    return all(pos[r] == len(seq) for r, seq in order.items())


@pytest.mark.parametrize("world, rpn", [(2, 1), (8, 4), (12, 4), (16, 2), (9, 3)])
def test_only_pair_groups_made_alike_on_every_rank(monkeypatch: pytest.MonkeyPatch,
                                                    world: int, rpn: int) -> None:
    """Every rank makes the same two-rank gloo groups in the same order (torch then names
    them alike on every rank, whatever groups each rank had before), each rank is in one or
    two of them, and the members' part of that order completes."""
    calls = _creations(monkeypatch, world, rpn)
    first = calls[0]
    for rank, made in calls.items():
        assert made == first, rank
        assert 1 <= sum(rank in ranks for ranks, _ in made) <= 2
    for ranks, kw in first:
        assert len(ranks) == 2 and kw["backend"] == "gloo"
        assert not kw.get("use_local_synchronization"), "named by each member's group count"
    assert len(first) <= world
    member = {r: [g for g, _ in made if r in g] for r, made in calls.items()}
    assert _completes(member)


def test_ward_first_would_deadlock() -> None:
    """The order matters: creating the ward's group first, around a ring of 3 or more
    nodes, leaves every rank waiting on a ward that waits on its own ward."""
    world, shift = 12, 4
    order = {r: [tuple(sorted((r, (r - shift) % world))), tuple(sorted((r, (r + shift) % world)))]
             for r in range(world)}
    assert not _completes(order)
