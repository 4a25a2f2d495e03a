"""Issue 4's acceptance: hot-swap recovery under deadpool-launch ends with the fingerprint
of the failure-free run, for every fault case; impossible cases end cleanly and say why."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import GPT_3D_ARGS
from deadpool_megatron.testing.jobs import JobResult, run_hosts, run_launched

pytestmark = pytest.mark.multiproc
ITERS = 8
ENV = {"DEADPOOL_CONTROL_TIMEOUT_S": "90"}


def _launch(tmp: Path, name: str, faults: list[str], spares: int = 2,
            extra: list[str] = (), window: float = 0.05,
            heartbeat_timeout: float = 10.0,
            launch_extra: list[str] = ()) -> tuple[JobResult, Path]:
    events = tmp / name / "events"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool",
            "--deadpool-events", str(events), *extra]
    for fault in faults:
        args += ["--deadpool-inject", fault]
    launch = ["--nproc-per-node", "8", "--spares", str(spares), "--logical-nodes", "2",
              "--heartbeat-timeout", str(heartbeat_timeout), "--failure-window", str(window),
              *launch_extra]
    return run_launched(launch, args, tmp / name, timeout_s=400, env=ENV), events


def _events(prefix: Path) -> list[dict]:
    out = []
    for path in prefix.parent.glob(prefix.name + ".rank*"):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(out, key=lambda e: e["t"])


@pytest.fixture(scope="module")
def failure_free(failure_free_8: JobResult) -> str:
    """The same job without DeadPool and without faults."""
    assert ITERS == 8
    return failure_free_8.fingerprint


def _assert_recovered(run: JobResult, fingerprint: str, recoveries: int = 1) -> None:
    assert run.ok, run.describe()
    assert run.fingerprint == fingerprint, run.describe()
    assert run.output.count("recovery: generation") == recoveries, run.describe()


def test_gold_rank_killed_mid_iteration(tmp_path: Path, failure_free: str) -> None:
    run, events = _launch(tmp_path, "gold", ["kill rank=5 iter=4 phase=backward"],
                          extra=["--deadpool-audit-groups"])
    _assert_recovered(run, failure_free)
    audits = [l for l in run.output.splitlines() if "group audit on rank" in l]
    assert len(audits) == 8, run.describe()
    assert all(", 0 of them from an old generation" in l for l in audits), audits
    assert all(int(l.split(": ")[1].split()[0]) > 0 for l in audits)  # the check sees groups
    ev = _events(events)
    names = [e["event"] for e in ev]
    for phase in ("fault_injected", "failure_detected", "generation_declared", "abort",
                  "left_generation", "recovered", "step_completed"):
        assert phase in names, names
    spare = [e for e in ev if e["event"] == "recovered" and e["from_buddy"]]
    assert len(spare) == 1 and spare[0]["rank"] == 5 and spare[0]["restored"] == 3


@pytest.mark.fault_matrix
@pytest.mark.parametrize("name, faults, formed", [
    # Two failures in sequence, each a case of its own: rank 0 (a first pipeline stage) in
    # forward, then rank 6 (a last stage) inside the optimizer step.
    ("rank0_forward_then_last_stage_in_optimizer",
     ["kill rank=0 iter=3 phase=forward", "kill rank=6 iter=5 phase=optimizer"], 2),
    # A hung rank (SIGSTOP, found by its stalled progress) and, in the same forward, a
    # raised exception in the other replica: the first recovery starts before the hang is
    # found, and the hung rank's replica waits for its iteration longer than the progress
    # timeout. Only the hung rank is hung: CI once declared the ranks waiting on it hung
    # too (the monitor watched their main threads, waiting for their training threads,
    # not the training threads, waiting in collectives). Generation 1 never forms (the
    # hung rank is one of its members): the job recovers once, into generation 2.
    ("raised_while_another_hung", ["raise rank=1 iter=3 phase=forward",
                                   "hang rank=2 iter=3 phase=forward"], 1),
])
def test_failures_in_sequence(tmp_path: Path, failure_free: str, name: str,
                              faults: list[str], formed: int) -> None:
    # Only the hung rank needs a short progress timeout (the default is 10 iterations, at
    # least 20 s).
    extra = ["--deadpool-progress-timeout", "3"] if "hung" in name else []
    run, events = _launch(tmp_path, name, faults, extra=extra)
    _assert_recovered(run, failure_free, recoveries=formed)
    detected = [(e["rank"], e["how"]) for e in _events(events)
                if e["event"] == "failure_detected"]
    first, second = (int(f.split("rank=")[1].split()[0]) for f in faults)
    assert detected == [(first, "exit"), (second, "hang" if "hung" in name else "exit")], \
        detected
    assert f"generation 1: ranks [{first}] failed" in run.output, run.describe()
    assert f"generation 2: ranks [{second}] failed" in run.output, run.describe()


@pytest.mark.fault_matrix
def test_whole_host_of_two(tmp_path: Path, failure_free: str) -> None:
    """Two launchers, as on two hosts: every rank of host 1 dies at once; host 0's spares
    take all four places, and the job still ends bit-exact."""
    events = tmp_path / "host" / "events"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--deadpool-events",
            str(events), "--deadpool-inject", "kill node=1 iter=4 phase=forward"]
    common = ["--nproc-per-node", "4"]
    run = run_hosts([[*common, "--spares", "4"], [*common, "--spares", "0"]], args,
                    tmp_path / "host", timeout_s=400, env=ENV)
    assert run.returncodes == [0, 0] and not run.timed_out, run.describe()
    assert run.fingerprint == failure_free, run.describe()
    # The injected kills fire as each rank reaches iteration 4, so they may arrive over a
    # few hundred ms and be declared in more than one generation; all four are replaced.
    failed = {int(r) for ranks in re.findall(r"generation \d+: ranks \[([\d, ]+)\] failed",
                                              run.logs[0]) for r in ranks.split(", ")}
    assert failed == {4, 5, 6, 7}, run.describe()
    spares = {e["rank"] for e in _events(events)
              if e["event"] == "recovered" and e["from_buddy"]}
    assert spares == {4, 5, 6, 7}


@pytest.mark.fault_matrix
def test_a_host_restarted_after_its_loss_brings_the_spares_that_take_its_ranks(
        tmp_path: Path, failure_free: str) -> None:
    """No spare anywhere at the start. Host 1's launcher is SIGKILLed with its workers at
    iteration 3 and started again (as a supervisor restarts it): the new launcher's return
    tells the loss (the heartbeat timeout, 120 s, never runs out), it starts spares only,
    late in the job, and they take ranks 4-7 from their buddies' copies; bit-exact."""
    events = tmp_path / "events"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--deadpool-events",
            str(events)]
    run = run_hosts([["--nproc-per-node", "4", "--spares", "0", "--heartbeat-timeout", "120"],
                     ["--nproc-per-node", "4", "--spares", "0"]], args, tmp_path,
                    timeout_s=400, env=ENV, kill_host=(1, "iteration        3/", 0.0),
                    restart_host=["--nproc-per-node", "4", "--spares", "4"])
    assert run.returncodes == [0, 0] and not run.timed_out, run.describe()
    assert run.fingerprint == failure_free, run.describe()
    assert "host 1 rejoined (its launcher's start 1)" in run.logs[0], run.describe()
    (declared,) = re.findall(r"generation \d+: ranks .* take their places", run.logs[0])
    assert declared == ("generation 1: ranks [4, 5, 6, 7] failed; spares {4: 's1.r1.0', 5: "
                        "'s1.r1.1', 6: 's1.r1.2', 7: 's1.r1.3'} take their places"), run.describe()
    spares = {e["rank"] for e in _events(events) if e["event"] == "recovered" and e["from_buddy"]}
    assert spares == {4, 5, 6, 7}, run.describe()


@pytest.mark.fault_matrix
def test_a_respawned_spare_takes_the_second_failure(tmp_path: Path, failure_free: str) -> None:
    """One spare and --spare-respawns 1: rank 2 hangs (SIGSTOP) at iteration 3, is found
    hung, killed, and takes the spare; its device slot gets a new one once the hung process
    is gone, which takes rank 5, killed at iteration 6 (without it the second kill would
    find the pool empty); bit-exact."""
    run, events = _launch(tmp_path, "respawn", ["hang rank=2 iter=3 phase=backward",
                                                "kill rank=5 iter=6 phase=forward"],
                          spares=1, launch_extra=["--spare-respawns", "1"],
                          extra=["--deadpool-progress-timeout", "3"])
    assert run.ok, run.describe()
    assert run.fingerprint == failure_free, run.describe()
    assert "new spare s0.1 started in device slot 2, the slot of failed worker w2" \
        in run.output, run.describe()
    assert "generation 1: ranks [2] failed; spares {2: 's0.0'}" in run.output
    assert "generation 2: ranks [5] failed; spares {5: 's0.1'}" in run.output, run.describe()
    detected = [(e["rank"], e["how"]) for e in _events(events) if e["event"] == "failure_detected"]
    assert detected == [(2, "hang"), (5, "exit")], detected
    spares = {e["rank"] for e in _events(events) if e["event"] == "recovered" and e["from_buddy"]}
    assert spares == {2, 5}, run.describe()


@pytest.mark.fault_matrix
def test_failures_during_recovery(tmp_path: Path, failure_free: str) -> None:
    """Rank 7 dies while the job recovers from rank 2's death: generation 2 replaces it and
    still gives rank 2's spare, which never finished restoring, its shard. Then rank 1
    stops (SIGSTOP) while recovering into generation 2, its groups made: the others wait
    for it in the restore's collectives, stamping no progress either, and only it is hung
    (CI once declared such waiting survivors hung with it: the monitor watched their parked
    training threads, not their main threads, which recover)."""
    run, events = _launch(tmp_path, "during", ["kill rank=2 iter=4 phase=backward",
                                               "kill rank=7 iter=1 phase=recovery",
                                               "hang rank=1 iter=2 phase=recovery"],
                          spares=3, extra=["--deadpool-progress-timeout", "3"])
    assert run.ok, run.describe()
    assert run.fingerprint == failure_free
    assert "generation 2: ranks [7] failed" in run.output
    assert "generation 3: ranks [1] failed" in run.output
    detected = [(e["rank"], e["how"], e["reason"]) for e in _events(events)
                if e["event"] == "failure_detected"]
    assert detected == [(2, "exit", ""), (7, "exit", ""), (1, "hang", "stopped by a signal")], \
        detected


@pytest.mark.fault_matrix
def test_spare_exhaustion_ends_cleanly(tmp_path: Path) -> None:
    run, _ = _launch(tmp_path, "exhausted", ["kill rank=1 iter=3 phase=forward",
                                             "kill rank=2 iter=5 phase=forward"], spares=1)
    assert not run.timed_out and run.returncodes == [3], run.describe()
    assert "ranks [2] failed but only 0 spare(s) remain" in run.output
    assert "state fingerprint" not in run.output


@pytest.mark.fault_matrix
def test_shard_and_buddy_lost_together_ends_cleanly(tmp_path: Path) -> None:
    # tp=1,dp=0 is rank 1 (first stage) and rank 5, its buddy (last stage); a 2 s failure
    # window gathers both deaths into one declaration.
    run, _ = _launch(tmp_path, "buddy_lost", ["kill tp=1,dp=0 iter=3 phase=optimizer"],
                     window=2.0, spares=0)
    assert not run.timed_out and run.returncodes == [3], run.describe()
    assert "the in-memory shards of ranks [1, 5] are lost" in run.output
    assert "generation 0" in run.output


@pytest.mark.fault_matrix
def test_no_complete_flush_falls_back_to_durable_checkpoint(tmp_path: Path,
                                                           failure_free: str) -> None:
    """Rank 1 and its buddy (rank 5) die together: the flush cannot write rank 1's shard,
    so nothing is committed and the restart loads the newest checkpoint (iteration 2)."""
    ckpt = tmp_path / "ckpt"
    run, _ = _launch(tmp_path, "fallback", ["kill tp=1,dp=0 iter=4 phase=optimizer"],
                     window=2.0, spares=0, extra=["--save", str(ckpt), "--save-interval", "2"])
    assert "the in-memory shards of ranks [1, 5] are lost" in run.output, run.describe()
    assert "the flush wrote no complete snapshot" in run.output, run.describe()
    assert "falling back to the newest durable state" in run.output
    assert "loaded checkpoint of iteration 2" in run.output
    assert run.ok, run.describe()
    assert run.fingerprint == failure_free
