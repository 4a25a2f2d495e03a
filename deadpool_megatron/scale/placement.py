"""The pure parts of a recovery at N ranks, timed, and the snapshot pair links one rank
takes part in, counted by running the real SnapshotEngine.connect against a stand-in for
torch.distributed (no process group is made)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator
from unittest import mock

from deadpool_megatron.control.policy import assign_spares, check_recoverable
from deadpool_megatron.replay.plan import SPARE_REPORT, RankReport, plan_recovery
from deadpool_megatron.topology import ParallelSizes, buddy_map, coord_of
from deadpool_megatron.topology.replicas import replica_holders, replica_holders_of


def pair_groups(world: int, ranks_per_node: int) -> int:
    """Snapshot pair groups per rank: one with the buddy, one with the ward (one when they
    are the same rank, on a ring of two nodes)."""
    return 1 if world // ranks_per_node == 2 else 2


@contextlib.contextmanager
def counted_group_creations(rank: int, world: int) -> Iterator[list[tuple]]:
    """torch.distributed as SnapshotEngine.connect sees it at `rank` of `world`, every
    group creation recorded (ranks, how) and answered with a placeholder."""
    from deadpool_megatron.snapshot import engine as engine_mod

    made: list[tuple] = []
    patches = [mock.patch.object(engine_mod.dist, "get_rank", lambda: rank),
               mock.patch.object(engine_mod.dist, "get_world_size", lambda: world),
               mock.patch.object(engine_mod.dist, "new_group",
                                 lambda ranks, **kw: made.append((tuple(ranks), "new_group"))
                                 or tuple(ranks))]
    pair_group = getattr(engine_mod, "pair_group", None)
    if pair_group is not None:
        patches.append(mock.patch.object(
            engine_mod, "pair_group",
            lambda ranks, name, **kw: made.append((tuple(ranks), "pair_group"))
            or tuple(ranks)))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield made


def pair_new_group_calls(world: int, ranks_per_node: int, rank: int = 0) -> int:
    """Group creations `rank`'s SnapshotEngine.connect makes (a member-made group counts
    one, as torch's new_group does, member or not)."""
    from deadpool_megatron.config import TrainConfig
    from deadpool_megatron.faults.injector import FaultInjector
    from deadpool_megatron.ft_config import DeadPoolConfig
    from deadpool_megatron.metrics.events import EventLog
    from deadpool_megatron.snapshot.engine import SnapshotEngine

    with counted_group_creations(rank, world) as made:
        engine = SnapshotEngine(TrainConfig(distributed_backend="gloo"),
                                DeadPoolConfig(deadpool=True,
                                               deadpool_ranks_per_node=ranks_per_node),
                                FaultInjector([], rank), EventLog(None, rank))
        engine.connect()
    return len(made)


def _ms(fn: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def timings(world: int, ranks_per_node: int, tp: int, pp: int) -> dict[str, float]:
    """Milliseconds, best of three: the plan (every rank computes it from the gathered
    reports), host 0's spare assignment with its checks, and one rank's placements (its
    buddy, ward and replica holders)."""
    sizes = ParallelSizes.from_world(world, tp, pp)
    victim = world // 2 + 1
    buddies = buddy_map(world, ranks_per_node)
    holders = replica_holders(sizes, ranks_per_node)
    replica_of = [coord_of(r, sizes).dp for r in range(world)]
    held = RankReport(own=(5, 6, 7), ward=(5, 6, 7), live=7, grads_intact=False, reached=8)
    reports = [SPARE_REPORT if r == victim else held for r in range(world)]
    current = {r: f"w{r}" for r in range(world)}
    spares = [f"s{h}.0" for h in range(1, 9)]
    spare_host = {s: int(s[1:].split(".")[0]) for s in spares}

    def plan() -> None:
        plan_recovery(reports, {victim}, buddies, replica_of, 8, "local", holders)

    def assign() -> None:
        check_recoverable(0, {victim}, world, ranks_per_node, False, holders)
        assign_spares(0, current, {victim}, spares, {victim: {0}}, spare_host)

    def place() -> None:
        from deadpool_megatron.topology import buddy_of, ward_of

        buddy_of(victim, world, ranks_per_node)
        ward_of(victim, world, ranks_per_node)
        replica_holders_of(victim, sizes, ranks_per_node)

    def holders_all() -> None:
        replica_holders(sizes, ranks_per_node)

    return {"plan": _ms(plan), "assign": _ms(assign), "placement": _ms(place),
            "replica_holders": _ms(holders_all)}
