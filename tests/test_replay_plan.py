"""The recovery plan (replay/plan.py) without processes: which snapshot, who restores what,
which micro-batches are recomputed where; up to 100,000 simulated ranks."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from deadpool_megatron.control.policy import RecoveryImpossible
from deadpool_megatron.replay.plan import (FRESH_START, KEEP, OWN_MICROBATCHES, SPARE_REPORT,
                                           RankReport, plan_recovery)
from deadpool_megatron.topology import ParallelSizes, buddy_map, coord_of

N = 4  # micro-batches per replica and iteration
SIZES = ParallelSizes(tp=2, pp=2, dp=2)  # ranks 0,1,4,5: replica 0; 2,3,6,7: replica 1
REPLICA = [coord_of(r, SIZES).dp for r in range(8)]
BUDDY = buddy_map(8, 4)


def survivor(live: int | None = 4, intact: bool = False, own: tuple = (4, 3),
             ward: tuple = (4, 3), reached: int | None = None) -> RankReport:
    reached = reached if reached is not None else (live or 4) + 1
    return RankReport(own=own, ward=ward, live=live, grads_intact=intact, reached=reached)


def killed_in_backward_of_5() -> list[RankReport]:
    """Rank 5 died in iteration 5's backward: replica 1 had accumulated all of iteration 5
    and stopped before the reduction; replica 0's survivors were mid-way."""
    reports = [survivor(intact=REPLICA[r] == 1) for r in range(8)]
    reports[5] = SPARE_REPORT
    return reports


def test_only_the_replica_that_lost_a_rank_recomputes() -> None:
    plan = plan_recovery(killed_in_backward_of_5(), {5}, BUDDY, REPLICA, N)
    assert plan.target == 4 and plan.last_iteration == 5
    assert plan.restore == ("none",) * 5 + ("buddy",) + ("none",) * 2
    for r in range(8):
        assert plan.work[r] == {5: KEEP if REPLICA[r] == 1 else OWN_MICROBATCHES}
        assert plan.recomputed(r) == (0 if REPLICA[r] == 1 else N)
    assert plan.whole_iteration_replay() == N
    # The survivors of replica 0 draw iteration 5's dropout masks again from snapshot 4.
    assert [plan.rewinds_rng(r) for r in range(8)] == [REPLICA[r] == 0 and r != 5
                                                       for r in range(8)]
    assert plan.refill_ward[5] and sum(plan.refill_ward) == 1  # rank 1 holds rank 5's ward


def test_a_torn_buddy_copy_rolls_everyone_back_one_snapshot() -> None:
    reports = killed_in_backward_of_5()
    reports[BUDDY[5]] = survivor(intact=False, ward=(3,))  # snapshot 4 never arrived whole
    plan = plan_recovery(reports, {5}, BUDDY, REPLICA, N)
    assert plan.target == 3 and plan.last_iteration == 5
    assert plan.restore == ("own",) * 5 + ("buddy",) + ("own",) * 2
    assert all(plan.work[r] == {4: OWN_MICROBATCHES, 5: OWN_MICROBATCHES} for r in range(8))
    assert plan.recomputed(0) == 2 * N == plan.whole_iteration_replay()


def test_a_begun_reduction_or_step_is_never_trusted() -> None:
    reports = killed_in_backward_of_5()
    reports[2] = survivor(intact=False)  # replica 1: rank 2's reduction had begun
    reports[7] = survivor(live=None)  # rank 7 was inside its optimizer step
    plan = plan_recovery(reports, {5}, BUDDY, REPLICA, N)
    assert plan.target == 4
    assert plan.restore[7] == "own" and plan.restore[2] == "none"
    assert all(plan.work[r][5] == OWN_MICROBATCHES for r in range(8))


def test_a_survivor_whose_local_copy_was_unfinished_stands_on_its_live_state() -> None:
    reports = killed_in_backward_of_5()
    reports[3] = survivor(intact=True, own=(3,))  # copy of 4 still running in the background
    plan = plan_recovery(reports, {5}, BUDDY, REPLICA, N)
    assert plan.target == 4 and plan.restore[3] == "none" and plan.work[3][5] == KEEP


def test_a_spare_cut_short_is_fed_from_its_buddy_again() -> None:
    reports = killed_in_backward_of_5()  # rank 5's spare never finished; now rank 2 dies
    reports[2] = SPARE_REPORT
    plan = plan_recovery(reports, {2}, BUDDY, REPLICA, N)
    assert plan.restore[5] == plan.restore[2] == "buddy"
    assert all(plan.work[r][5] == OWN_MICROBATCHES for r in range(8))  # both replicas lost


def test_spread_deals_each_lost_microbatch_to_exactly_one_replica() -> None:
    sizes = ParallelSizes(tp=2, pp=1, dp=4)
    replica = [coord_of(r, sizes).dp for r in range(8)]
    reports = [survivor(intact=replica[r] != 1) for r in range(8)]
    reports[3] = SPARE_REPORT  # replica 1 lost rank 3
    plan = plan_recovery(reports, {3}, BUDDY, replica, N, mode="spread")
    per_replica = {replica[r]: plan.work[r][5] for r in range(8)}
    assert all(plan.work[r][5] == per_replica[replica[r]] for r in range(8))
    dealt = Counter(mb for w in per_replica.values() for mb in w.microbatches)
    assert dealt == Counter((1, i) for i in range(N))  # replica 1's four, once each
    assert [len(per_replica[d].microbatches) for d in range(4)] == [1, 1, 1, 1]
    assert [per_replica[d].keep_grads for d in range(4)] == [True, False, True, True]
    assert sum(plan.recomputed(r) for r in range(8)) == N * 2  # 2 tensor-parallel ranks each


def test_a_batch_size_schedule_counts_each_iteration_with_its_own_batch() -> None:
    """Under a batch-size schedule the micro-batches per replica differ from iteration to
    iteration: the plan counts each replayed iteration with its own."""
    def ramp(iteration: int) -> int:
        return 1 if iteration <= 4 else 2

    reports = killed_in_backward_of_5()
    reports[BUDDY[5]] = survivor(intact=False, ward=(3,))  # back to snapshot 3
    plan = plan_recovery(reports, {5}, BUDDY, REPLICA, ramp)
    assert plan.target == 3 and plan.num_microbatches == 1 and plan.count(5) == 2
    assert plan.recomputed(0) == 1 + 2 == plan.whole_iteration_replay()
    spread = plan_recovery(killed_in_backward_of_5(), {5}, BUDDY, REPLICA, ramp,
                           mode="spread")
    assert sorted(mb for r in (0, 2) for mb in spread.work[r][5].microbatches) == \
        [(0, 0), (0, 1)]  # replica 0's two micro-batches of iteration 5, one each


def test_before_the_start_snapshot_committed_the_start_is_rebuilt() -> None:
    start = RankReport(own=(0,), ward=(), live=0, grads_intact=False, reached=0, at_start=True)
    reports = [start] * 8
    reports[5] = SPARE_REPORT
    plan = plan_recovery(reports, {5}, BUDDY, REPLICA, N)
    assert plan.target == FRESH_START and set(plan.restore) == {"fresh"}
    reports[3] = RankReport(own=(0,), ward=(), live=0, grads_intact=False, reached=1)
    with pytest.raises(RecoveryImpossible):  # rank 3 had begun iteration 1: no rebuild
        plan_recovery(reports, {5}, BUDDY, REPLICA, N)


def test_spares_whose_generation_broke_before_they_restored_take_part_in_a_fresh_start() -> None:
    """A restarted job (loaded at iteration 12) loses its whole first node before its
    first snapshot: spares take ranks 2 (generation 1), then 0, 1 and 3 (generation 2).
    Rank 2's spare built its objects alone for generation 1, which broke before it
    restored anything: it holds no snapshot and no usable state, as a fresh spare does,
    and every other rank is at the job's start, so every rank builds afresh. Before, its
    report (built, so not the bare spare's) ended hot-swap: 'no snapshot iteration is held
    by every survivor' (chaos soak seed 215)."""
    start = RankReport(own=(), ward=(), live=12, grads_intact=False, reached=12, at_start=True)
    built_alone = RankReport(own=(), ward=(), live=None, grads_intact=False, reached=12)
    reports = [SPARE_REPORT, SPARE_REPORT, built_alone, SPARE_REPORT, *[start] * 4]
    plan = plan_recovery(reports, {0, 1, 3}, BUDDY, REPLICA, N)
    assert plan.target == FRESH_START and set(plan.restore) == {"fresh"}
    reports[2] = RankReport(own=(), ward=(11,), live=None, grads_intact=False, reached=12)
    with pytest.raises(RecoveryImpossible):  # it holds a copy: not nothing, and no common one
        plan_recovery(reports, {0, 1, 3}, BUDDY, REPLICA, N)


def test_no_common_snapshot_is_refused_with_what_each_rank_holds() -> None:
    reports = killed_in_backward_of_5()
    reports[BUDDY[5]] = survivor(ward=())
    with pytest.raises(RecoveryImpossible, match=r"buddies of ranks \[5\]"):
        plan_recovery(reports, {5}, BUDDY, REPLICA, N)
    with pytest.raises(ValueError, match="replay mode"):
        plan_recovery(killed_in_backward_of_5(), {5}, BUDDY, REPLICA, N, mode="both")


def test_plan_at_100k_ranks() -> None:
    world, rpn = 100_000, 8
    sizes = ParallelSizes.from_world(world, tp=8, pp=5)  # dp = 2,500
    replica = [coord_of(r, sizes).dp for r in range(world)]
    buddy = buddy_map(world, rpn)
    lost = set(range(8 * 777, 8 * 778))  # one whole node
    reports = [SPARE_REPORT if r in lost else survivor(intact=True) for r in range(world)]
    t0 = time.perf_counter()
    plan = plan_recovery(reports, lost, buddy, replica, 16)
    elapsed = time.perf_counter() - t0
    print(f"[scale] 100k ranks: recovery plan in {1e3 * elapsed:.0f} ms")
    broken = {replica[r] for r in lost}
    assert plan.target == 4 and plan.restore.count("buddy") == 8
    assert sum(plan.recomputed(r) for r in range(world)) == 16 * 8 * 5 * len(broken)
    assert all((plan.work[r][5] == KEEP) == (replica[r] not in broken) for r in range(world))
