"""Recovery policies without processes, up to 100,000 simulated ranks."""

from __future__ import annotations

import time

import pytest

from deadpool_megatron.control.alike import (Failure, alike_before_built, alike_in_training,
                                             error_kind)
from deadpool_megatron.control.policy import (
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


def _own(worker: str, rank: int, report: str, iteration: int | None = None,
         generation: int = 0, host: str = "") -> Failure:
    return Failure(worker, rank, generation, error_kind(report, host), iteration,
                   report.splitlines()[0] if report else "")


def test_workers_failing_alike_before_the_build_name_their_error() -> None:
    """Two or more workers' own errors, alike but for numbers (a rank's, a port's): the
    configuration's, which a spare would meet too. One, or different ones: none."""
    missing = "ModuleNotFoundError: A compatible `nvidia-resiliency-ext` installation " \
              "is required"
    found = alike_before_built([_own("w3", 3, missing + "\n  File x, line 3"),
                                _own("w5", 5, missing)])
    assert found is not None and found.text == missing
    found = alike_before_built([_own("w1", 1, "InjectedFault: injected fault on rank 1: raise"),
                                _own("s0.0", 6, "InjectedFault: injected fault on rank 6: raise")])
    assert found is not None and found.text == "InjectedFault: injected fault on rank 6: raise"
    assert alike_before_built([_own("w2", 2, missing)]) is None
    assert alike_before_built([_own("w2", 2, missing),
                               _own("w4", 4, "RuntimeError: CUDA error: out of memory")]) is None
    assert alike_before_built([_own("w2", 2, missing), _own("w4", 4, "")]) is None


NAN = ("RuntimeError: Rank {r}, node {host}, device 0, iteration 6: Unexpected result nan "
       "(message='found NaN in local grad norm for bucket #0 in backward pass')")


def test_an_error_alike_in_two_failure_domains_is_the_works_not_a_machines() -> None:
    """Megatron's NaN check raising on ranks 2, 3 (node 0) and 6, 7 (node 1) in iteration 5,
    each naming its rank and its host: alike, in two domains: a spare would meet it too.
    The same on one node's ranks only: maybe that machine's; replaced as usual."""
    nan = [_own(f"w{r}", r, NAN.format(r=r, host=f"gpu-{r // 4}x"), 5, generation=r // 6,
                host=f"gpu-{r // 4}x") for r in (7, 6, 3, 2)]
    assert {f.kind for f in nan} == {f.kind for f in nan[:1]}  # host names masked
    assert alike_in_training(nan, ranks_per_node=4) == \
        [nan[0], nan[1], nan[2], nan[3]]
    assert alike_in_training(nan[:2], ranks_per_node=4) == []  # ranks 6, 7: node 1 only
    assert alike_in_training(nan, ranks_per_node=8) == []  # all on one node
    other_iteration = [*nan[:2], *(_own(f.worker, f.rank, NAN.format(r=f.rank, host="h"), 9)
                                   for f in nan[2:])]
    assert alike_in_training(other_iteration, ranks_per_node=4) == []
    # A kill in the same generations: the alike errors may be its consequences.
    assert alike_in_training([Failure("w0", 0, 0), *nan], ranks_per_node=4) == []
    # ... but not a kill of an earlier generation, recovered from.
    earlier = [Failure("w0", 0, 0), *(Failure(f.worker, f.rank, f.generation + 1, f.kind,
                                              f.iteration, f.text) for f in nan)]
    assert alike_in_training(earlier, ranks_per_node=4) == earlier[1:]
    assert alike_in_training([_own("w1", 1, "RuntimeError: bad sample", 5),
                              _own("w5", 5, "ValueError: bad sample", 5)], 4) == []
    assert alike_in_training([_own("w1", 1, "RuntimeError: x"), _own("w5", 5,
                                                                     "RuntimeError: x")], 4) == []


def test_an_error_alike_between_iterations_is_compared_there() -> None:
    """A full file system fails every rank's save after iteration 4, in two domains: the
    job's storage, which a spare would meet too. The same error in iteration 5's step on
    other ranks is another place, not alike to it."""
    full = "OSError: [Errno 28] No space left on device: '/ckpt/iter_0000004/__{r}_0.distcp'"
    saves = [Failure(f"w{r}", r, 0, error_kind(full.format(r=r)), 4, full.format(r=r),
                     after=True) for r in (1, 6)]
    assert alike_in_training(saves, ranks_per_node=4) == saves
    assert saves[0].when == "after iteration 4, outside its training step"
    in_step = Failure("w6", 6, 0, saves[1].kind, 4, saves[1].text)
    assert alike_in_training([saves[0], in_step], ranks_per_node=4) == []


def test_a_gpus_hardware_error_is_never_alike() -> None:
    """An uncorrectable ECC error on rank 1 (node 0) and on rank 6 (node 1) in one save, or
    on one rank and again on its spare: two GPUs' faults, each cured by a spare. The same
    two ranks failing alike of an illegal address (sometimes the work's): the work's."""
    ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    two = [Failure(f"w{r}", r, 0, error_kind(ecc), 2, ecc, after=True) for r in (1, 6)]
    assert alike_in_training(two, ranks_per_node=4) == []
    again = [_own("w3", 3, ecc, 5), _own("s0.0", 3, ecc, 5, generation=1)]
    assert alike_in_training(again, ranks_per_node=4) == []
    assert alike_before_built([_own("w1", 1, ecc), _own("w6", 6, ecc)]) is None
    assert alike_before_built([_own("w1", 1, ecc), _own("w6", 6, "OSError: no"),
                               _own("w7", 7, "OSError: no")]).worker == "w6"
    nvlink = "RuntimeError: CUDA error: uncorrectable NVLink error was detected during the " \
             "execution"
    assert alike_in_training([_own(f"w{r}", r, nvlink, 4) for r in (1, 6)], 4) == []
    illegal = "RuntimeError: CUDA error: an illegal memory access was encountered"
    work = [_own(f"w{r}", r, illegal, 4) for r in (1, 6)]
    assert alike_in_training(work, ranks_per_node=4) == work


def test_an_error_the_spare_meets_again_is_the_works() -> None:
    """Rank 3's error in iteration 5, then the same on the spare that redid rank 3's work:
    whatever the domain, a spare would meet it too. Another iteration: a new failure."""
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.{n} GiB"
    first = _own("w3", 3, oom.format(n=1), 5, generation=0)
    again = _own("s0.0", 3, oom.format(n=7), 5, generation=1)
    assert alike_in_training([first, again], ranks_per_node=4) == [first, again]
    later = _own("s0.0", 3, oom.format(n=7), 8, generation=1)
    assert alike_in_training([first, later], ranks_per_node=4) == []


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
