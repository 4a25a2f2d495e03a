"""The pure helpers of tools/bench_recovery.py --vs-checkpoint (no processes)."""

from __future__ import annotations

import math

import pytest

from deadpool_megatron.metrics import vs_checkpoint as vs


def _line(second: float, text: str, rank: int = 4) -> str:
    ms = round(second * 1000)
    return f"[2026-12-01 03:00:{ms // 1000:02d},{ms % 1000:03d} rank{rank}] {text}"


def test_young_daly_interval_and_its_iterations() -> None:
    yd = vs.YoungDaly(save_s=0.25, mtbf_s=60.0, iteration_s=0.5)
    assert yd.interval_s == pytest.approx(math.sqrt(2 * 0.25 * 60))  # 5.48 s
    assert yd.interval_iterations == 11
    assert "sqrt(2 x save cost 0.250 s x MTBF 60 s)" in yd.describe()
    # A save costlier than the iteration still checkpoints at least every iteration.
    assert vs.YoungDaly(save_s=1e-4, mtbf_s=1.0, iteration_s=10.0).interval_iterations == 1


def test_young_daly_refuses_what_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="positive mtbf_s"):
        vs.YoungDaly(save_s=0.2, mtbf_s=0.0, iteration_s=0.5)


@pytest.mark.parametrize("interval,kill,checkpoint", [(1, 2, 1), (4, 6, 4), (5, 8, 5),
                                                      (12, 18, 12)])
def test_the_kill_falls_half_an_interval_after_the_first_checkpoint(
        interval: int, kill: int, checkpoint: int) -> None:
    plan = vs.KillPlan.for_interval(interval, tail=3, least=10)
    assert (plan.kill_iteration, plan.newest_checkpoint) == (kill, checkpoint)
    assert plan.iterations == max(kill + 3, 10)


def test_backward_call_is_the_first_of_the_kill_iteration() -> None:
    # One layer a stage, 4 micro-batches: 16 linear backwards an iteration (FAULTS' call 65).
    assert vs.backward_call(5, layers_per_stage=1, microbatches=4) == 65
    assert vs.backward_call(1, layers_per_stage=2, microbatches=4) == 1


def test_times_from_the_log_count_the_restart_and_leave_start_up_out() -> None:
    log = "\n".join([
        _line(0.0, "training GPT: world 8"),
        _line(10.0, "iteration        1/       4 | lm loss: 1"),
        _line(11.0, "iteration        2/       4 | lm loss: 1"),
        _line(11.25, "saved checkpoint at iteration 2 to /c/iter_0000002", rank=0),
        _line(12.5, "iteration        3/       4 | lm loss: 1"),
        "test fault: kill in backward (call 49) at 1796094012.600",
        _line(20.0, "iteration        3/       4 | lm loss: 1"),  # again, after a restart
        _line(21.0, "iteration        4/       4 | lm loss: 1"),
    ])
    assert vs.training_span(log, 4) == pytest.approx(11.0)
    assert vs.iteration_times(log)[3] - vs.iteration_times(log)[1] == pytest.approx(10.0)
    assert vs.save_seconds(log) == {2: pytest.approx(0.25)}
    # Gaps 1->2: 1.0; 2's save ->3: 1.25; 3->4 (its last doing): 1.0.
    assert vs.iteration_seconds(log) == pytest.approx(1.0)
    assert vs.kill_time(log) == pytest.approx(1796094012.6)
    with pytest.raises(ValueError, match="iteration 1 or 5"):
        vs.training_span(log, 5)


def test_steady_save_leaves_the_first_out() -> None:
    assert vs.steady_save_s({1: 1.0, 2: 0.3, 3: 0.2, 4: 0.25}) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="two saves"):
        vs.steady_save_s({1: 1.0})


def test_restart_recomputes_every_iteration_since_the_checkpoint_on_every_rank() -> None:
    assert vs.restart_recomputed(world=8, microbatches=4, kill_iteration=18,
                                 checkpoint=12) == 8 * 4 * 6


def test_overhead_is_slower_iterations_plus_saves() -> None:
    log = "\n".join([
        _line(10.0, "iteration        1/       3 | lm loss: 1"),
        _line(11.5, "iteration        2/       3 | lm loss: 1"),
        _line(11.75, "saved checkpoint at iteration 2 to /c/iter_0000002", rank=0),
        _line(13.25, "iteration        3/       3 | lm loss: 1"),
    ])
    # Iterations of 1.5 s against 1.0 s failure-free, over the 2 in the training time,
    # plus the 0.25 s save.
    assert vs.overhead_s(log, 3, failure_free_iteration_s=1.0) == pytest.approx(1.25)


def test_table_and_ratio() -> None:
    ways = [vs.Way("failure-free", 40.0, 10.0, 0, None, "f"),
            vs.Way("DeadPool hot swap", 45.0, 12.0, 4, 1.5, "f", overhead_s=1.0),
            vs.Way("checkpoint-restart", 70.0, 30.0, 192, 17.0, "g", overhead_s=0.5)]
    text = vs.table(ways, "failure-free")
    lines = text.splitlines()
    assert len(lines) == 4
    assert "|   2.00 |       1.00 |      1.00 |" in lines[2] and "= failure-free" in lines[2]
    assert "|  20.00 |       0.50 |     19.50 |" in lines[3] and "DIFFERS" in lines[3]
    assert vs.lost_ratio(ways, "failure-free", "checkpoint-restart",
                         "DeadPool hot swap") == "10.0x"
    assert vs.lost_ratio(ways, "failure-free", "checkpoint-restart", "DeadPool hot swap",
                         failure_only=True) == "19.5x"
    assert vs.ratio(1.0, 0.0).startswith("n/a")


def test_async_save_is_refused_saying_what_to_use() -> None:
    from deadpool_megatron.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="--ckpt-assume-constant-structure"):
        TrainConfig(mock_data=True, async_save=True).validate(1)


def test_the_kill_test_fault_parses() -> None:
    from deadpool_megatron.faults.megatron_faults import MegatronFault

    fault = MegatronFault.parse("kill rank=1 at=backward call=65")
    assert (fault.action, fault.ranks, fault.at, fault.call) == ("kill", (1,), "backward", 65)
    ecc = MegatronFault.parse("raise rank=1,6 at=save error=ecc")
    assert ecc.names(6) and not ecc.names(2) and ecc.error == "ecc"
    with pytest.raises(ValueError, match="unknown error='xid'"):
        MegatronFault.parse("raise rank=1 at=save error=xid")


def test_restart_phases_after_the_kill() -> None:
    log = "\n".join([
        _line(10.0, "iteration        1/       2 | lm loss: 1"),
        _line(30.0, "deadpool-launch: epoch 1: 8 workers on 1 host(s)").replace("rank4", "launcher"),
        _line(40.0, "loaded checkpoint of iteration 0 from /c", rank=0),
        _line(41.0, "iteration        1/       2 | lm loss: 1"),
    ])
    killed = vs._stamp("2026-12-01 03:00:11,000")
    assert vs.restart_phases(log, killed, 1) == {
        "relaunched": pytest.approx(19.0), "loaded": pytest.approx(29.0),
        "redone": pytest.approx(30.0)}
