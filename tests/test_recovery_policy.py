"""Recovery policies without processes, up to 100,000 simulated ranks."""

from __future__ import annotations

import time

import pytest

from deadpool_megatron.control.policy import (
    alike_before_built,
    RecoveryImpossible,
    assign_spares,
    check_recoverable,
)
from deadpool_megatron.metrics.timeline import timelines
from deadpool_megatron.topology import buddy_map


def test_spares_take_failed_ranks_in_order() -> None:
    current = {r: f"w{r}" for r in range(8)}
    plan = assign_spares(0, current, {5, 2}, ["s0", "s1", "s2"])
    assert plan.generation == 1 and plan.replaced == {2: "s0", 5: "s1"}
    assert plan.rank_to_worker[2] == "s0" and plan.rank_to_worker[0] == "w0"


def test_no_spare_left_names_ranks_and_generation() -> None:
    with pytest.raises(RecoveryImpossible, match=r"generation 4: ranks \[1, 2\] failed but "
                                                 r"only 1 spare"):
        assign_spares(4, {r: f"w{r}" for r in range(4)}, {1, 2}, ["s0"])


def test_spare_avoids_the_hosts_of_the_ranks_buddy_and_ward() -> None:
    """A spare on the host that holds rank 3's copy would put shard and copy together."""
    current = {r: f"w{r}" for r in range(8)}
    spare_host = {"s0.0": 0, "s0.1": 0, "s1.0": 1}
    plan = assign_spares(0, current, {3}, ["s0.0", "s0.1", "s1.0"], {3: {0}}, spare_host)
    assert plan.replaced == {3: "s1.0"}
    # Lowest rank first; when no spare is safe, the first free one is still used.
    plan = assign_spares(0, current, {2, 3}, ["s0.0", "s1.0"], {2: {0}, 3: {0}}, spare_host)
    assert plan.replaced == {2: "s1.0", 3: "s0.0"}


def test_shard_and_copy_lost_together_is_refused() -> None:
    check_recoverable(0, {4, 5, 6, 7}, 8, 4, False)  # a whole node: copies live on node 0
    with pytest.raises(RecoveryImpossible, match=r"ranks \[1, 5\] are lost"):
        check_recoverable(0, {1, 5}, 8, 4, False)


def test_workers_failing_alike_before_the_build_name_their_error() -> None:
    """Two or more workers' own errors, alike but for numbers (a rank's, a port's): the
    configuration's, which a spare would meet too. One, or different ones: none."""
    missing = "ModuleNotFoundError: A compatible `nvidia-resiliency-ext` installation " \
              "is required"
    assert alike_before_built({"w3": missing + "\n  File x, line 3", "w5": missing}) == \
        missing
    assert alike_before_built({"w1": "InjectedFault: injected fault on rank 1: raise",
                               "s0.0": "InjectedFault: injected fault on rank 6: raise"}) \
        == "InjectedFault: injected fault on rank 6: raise"
    assert alike_before_built({"w2": missing}) is None
    assert alike_before_built({"w2": missing, "w4": "RuntimeError: CUDA error: out of "
                                                    "memory"}) is None
    assert alike_before_built({"w2": missing, "w4": ""}) is None


def test_policies_at_100k_ranks() -> None:
    world, rpn = 100_000, 8
    t0 = time.perf_counter()
    buddy = buddy_map(world, rpn)
    failed = set(range(8 * 777, 8 * 778))  # one whole node
    check_recoverable(0, failed, world, rpn, False)
    spares = [f"s{h}.{i}" for h in range(0, 12_500, 500) for i in range(2)]
    avoid = {r: {r // rpn + 1, r // rpn - 1} for r in failed}  # the neighbouring hosts
    plan = assign_spares(0, {r: f"w{r}" for r in range(world)}, failed, spares, avoid,
                         {s: int(s[1:].split(".")[0]) for s in spares})
    assert len(buddy) == world
    print(f"[scale] 100k ranks: buddy map, node-loss check and spare plan "
          f"in {1e3 * (time.perf_counter() - t0):.0f} ms")
    assert len(plan.replaced) == 8
    assert not any(int(s[1:].split(".")[0]) in avoid[r] for r, s in plan.replaced.items())


def test_timeline_from_events() -> None:
    t = 1000.0
    ev = [
        {"t": t, "rank": 3, "event": "fault_injected", "iteration": 5},
        {"t": t + 0.09, "rank": -1, "event": "failure_detected"},
        {"t": t + 0.15, "rank": -1, "event": "generation_declared", "generation": 1,
         "failed_ranks": [3]},
        {"t": t + 0.3, "rank": 0, "event": "abort", "generation": 0},
        {"t": t + 0.4, "rank": 0, "event": "left_generation", "generation": 0, "next": 1},
        {"t": t + 1.0, "rank": 0, "event": "recovered", "generation": 1, "groups_s": 0.2,
         "total_s": 0.5, "from_buddy": False},
        {"t": t + 1.5, "rank": 0, "event": "step_completed", "iteration": 5},
    ]
    (line,) = timelines(ev)
    assert [round(ms) for _, ms in line.rows()] == [90, 150, 300, 400, 700, 1000, 1500]
