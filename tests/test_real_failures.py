"""Failures as they really come (issue 9's acceptance), most of them raised inside
Megatron-Core by a test-only patch (deadpool_megatron/faults/megatron_faults.py), not by our
injector: a rank's own exception, a training thread blocked forever, a durable save holding
the GIL, a rank dying while the next generation creates its groups, a host frozen until it
is declared lost, a launcher killed, a job without --deadpool."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GPT_3D_ARGS
from deadpool_megatron.reconstruct.groups import REBUILD_TIMEOUT_S
from deadpool_megatron.testing.jobs import REPO, JobResult, run_hosts, run_launched
from deadpool_megatron.testing.signals import signal_worker_when
from deadpool_megatron.faults.megatron_faults import CUDA_ERROR, ENV as MEGATRON_FAULT

pytestmark = pytest.mark.multiproc
ITERS = 8
ENV = {"DEADPOOL_CONTROL_TIMEOUT_S": "90"}
# TP2 x PP2 x DP2, 2 layers: each pipeline stage has one transformer layer, four linear
# layers (qkv, proj, fc1, fc2) and four micro-batches per iteration.
FORWARD_CALLS_PER_ITERATION = 4
LINEAR_BACKWARDS_PER_MICROBATCH = 4


def _launch(tmp: Path, extra: list[str] = (), env: dict[str, str] | None = None,
            spares: int = 2) -> tuple[JobResult, list[dict]]:
    events = tmp / "events"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--deadpool-events",
            str(events), *extra]
    run = run_launched(["--nproc-per-node", "8", "--spares", str(spares), "--logical-nodes",
                        "2"], args, tmp, timeout_s=400, env={**ENV, **(env or {})})
    return run, _events(events)


def _events(prefix: Path) -> list[dict]:
    out = []
    for path in prefix.parent.glob(prefix.name + ".rank*"):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(out, key=lambda e: e["t"])


def _declared(events: list[dict]) -> list[list[int]]:
    return [e["failed_ranks"] for e in events if e["event"] == "generation_declared"]


def test_own_exception_inside_megatron_replaces_that_rank_alone(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """RuntimeError("CUDA error: ...") from rank 2's TransformerLayer.forward in iteration 4:
    rank 2 leaves at once with its traceback; its peers, which see only the consequences,
    stay; a spare takes rank 2; the run ends bit-exact."""
    call = 3 * FORWARD_CALLS_PER_ITERATION + 1
    run, events = _launch(tmp_path, env={MEGATRON_FAULT: f"raise rank=2 at=forward call={call}"})
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert _declared(events) == [[2]], run.describe()
    (detected,) = [e for e in events if e["event"] == "failure_detected"]
    assert detected["how"] == "exit" and CUDA_ERROR in detected["reason"], detected
    assert "Traceback (most recent call last)" in run.output  # the rank's own, in the log


@pytest.mark.fault_matrix
@pytest.mark.parametrize("name, rank, call", [
    # Rank 3's first backward of iteration 4: its process and threads otherwise healthy.
    ("blocked_in_backward", 3, 3 * 4 * LINEAR_BACKWARDS_PER_MICROBATCH + 1),
    # Rank 2's last micro-batch of iteration 3: the other replica has finished and waits for
    # it in the data-parallel gradient reduction, its own stage-1 peers too.
    ("blocked_while_peers_reduce", 2, 2 * 4 * LINEAR_BACKWARDS_PER_MICROBATCH
     + 3 * LINEAR_BACKWARDS_PER_MICROBATCH + 1),
])
def test_a_blocked_training_thread_is_found_and_only_it_replaced(
        tmp_path: Path, failure_free_8: JobResult, name: str, rank: int, call: int) -> None:
    run, events = _launch(tmp_path / name, ["--deadpool-progress-timeout", "3"],
                          env={MEGATRON_FAULT: f"block rank={rank} at=backward call={call}"})
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert _declared(events) == [[rank]], run.describe()
    (verdict,) = [e for e in events if e["event"] == "hang_localized"]
    assert verdict["culprits"] == [f"w{rank}"] and verdict["certain"], verdict
    # Its peers waited for it in a collective, and were not replaced (stalled too or not yet:
    # whoever stamped first crosses the timeout first, and the culprit is certain at once).
    assert set(verdict["waiting"]) - {f"w{rank}"}, verdict
    assert "megatron_faults.py" in run.output  # its stacks, dumped before it was killed


@pytest.mark.fault_matrix
def test_a_snapshot_worker_gloo_never_frees_is_given_up_and_its_rank_goes_on(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 3's snapshot worker blocks forever in snapshot 3's acknowledgement (as gloo
    leaves a send or receive whose bytes had begun to move when its connection broke), and
    rank 5 is killed in iteration 4. Rank 3 gives up its worker, waiting on its buddy, 1 s
    after the cut and goes on with a new one: only rank 5 is replaced, and the run ends
    bit-exact (before, rank 3 left the job too, a spare spent on a healthy rank; then it
    waited 5 s for a worker waiting on a peer)."""
    run, events = _launch(tmp_path, ["--deadpool-inject", "kill rank=5 iter=4 phase=backward"],
                          env={MEGATRON_FAULT: "block rank=3 at=ack call=4"})
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert _declared(events) == [[5]], run.describe()
    assert "rank 3: the snapshot worker did not stop within 1 s of its connections being " \
           "cut; going on without it" in run.output, run.describe()
    assert "megatron_faults.py" in run.output  # where it was held, in the warning


@pytest.mark.fault_matrix
def test_a_restore_transfer_no_cut_frees_is_left_behind_and_its_rank_goes_on(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 5 is killed in iteration 4; the spare that takes it blocks forever in its
    restore transfer (as gloo leaves a receive whose bytes had begun to move when its
    connection broke), and rank 6 is killed meanwhile. The newer declaration leaves the
    spare's transfer, and its buddy's, behind; both go on to the next generation, where the
    spare restores rank 5 after all: declared [[5], [6]], no hang, the run bit-exact
    (before, the spare stayed in the transfer until the hang analysis replaced it: a spare
    spent on a healthy process, and with none left, hot-swap ended)."""
    spare_log = tmp_path / "workers" / "epoch0" / "s0.0.log"
    with signal_worker_when(spare_log, "test fault: block in restore", "w6") as killed:
        run, events = _launch(tmp_path, ["--deadpool-inject",
                                         "kill rank=5 iter=4 phase=backward"],
                              env={MEGATRON_FAULT: "block worker=s0.0 at=restore"})
    assert killed and run.ok and run.fingerprint == failure_free_8.fingerprint, \
        run.describe()
    assert _declared(events) == [[5], [6]], run.describe()
    assert "spare s0.0 takes rank 5" in run.output, run.describe()
    assert re.search(r"generation 1 was superseded while making the restore transfers with "
                     r"buddy \d+ and ward \d+, still waiting in it", run.output), run.describe()
    assert not [e for e in events if e["event"] == "hang_localized"], run.describe()
    assert "hot-swap impossible" not in run.output, run.describe()


@pytest.mark.fault_matrix
def test_the_gil_held_for_20_s_in_a_durable_save_is_no_hang(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 2 holds the GIL for 20 s inside megatron.core.dist_checkpointing.save while
    every other rank waits for it; a 3 s progress timeout and a 3 s host timeout declare
    nothing: the save is a declared long operation, and liveness is read outside the worker
    (the previous, heartbeat-thread design declared rank 2 hung here)."""
    run, events = _launch(tmp_path, ["--deadpool-progress-timeout", "3", "--save",
                                     str(tmp_path / "ckpt"), "--save-interval", "4"],
                          env={MEGATRON_FAULT: "gil rank=2 at=save call=1 seconds=20"})
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert "test fault: gil in save" in run.output
    assert not [e for e in events if e["event"] in ("failure_detected", "hang_localized")]


@pytest.mark.fault_matrix
def test_a_rank_stopped_inside_a_durable_save_is_found_and_replaced(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 2 stops itself (SIGSTOP) inside megatron.core.dist_checkpointing.save while
    every other rank waits for it in the save's collectives: a save is a declared long
    operation (1,800 s), but a stopped process does no slow work, so rank 2 is found at
    the 3 s progress timeout, the one culprit, certain; the others leave the save, a spare
    takes rank 2, and the run ends bit-exact (before, its host left it out of every report
    and the job waited for the save's budget: chaos soak seed 108 with --save)."""
    run, events = _launch(tmp_path, ["--deadpool-progress-timeout", "3", "--save",
                                     str(tmp_path / "ckpt"), "--save-interval", "4"],
                          env={MEGATRON_FAULT: "stop rank=2 at=save call=1"})
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert "test fault: stop in save" in run.output
    assert _declared(events) == [[2]], run.describe()
    (verdict,) = [e for e in events if e["event"] == "hang_localized"]
    assert verdict["culprits"] == ["w2"] and verdict["certain"], verdict
    assert verdict["why"]["w2"] == "stopped by a signal", verdict


@pytest.mark.fault_matrix
def test_a_rank_killed_while_the_next_generation_creates_its_groups(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 3 dies between the default group and Megatron's groups of generation 1: its
    peers, waiting in the store for its address, are cut loose by the next declaration
    instead of waiting out a timeout."""
    run, events = _launch(tmp_path, ["--deadpool-inject", "kill rank=5 iter=3 phase=backward",
                                     "--deadpool-inject", "kill rank=3 iter=1 phase=groups"])
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert _declared(events) == [[5], [3]], run.describe()
    second = [e for e in events if e["event"] == "generation_declared"][1]
    formed = min(e["t"] for e in events if e["event"] == "recovered" and e["generation"] == 2)
    assert formed - second["t"] < REBUILD_TIMEOUT_S / 4, "waited on a group timeout"


@pytest.mark.fault_matrix
def test_a_rank_killed_inside_a_gloo_creation_leaves_its_peers_waiting_in_none(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 3 is killed inside generation 1's default group, after publishing its address
    and before connecting: every peer, the side that waits to be connected, waits in gloo
    five times the 60 s creation timeout, and no cut ends that wait. The next declaration
    leaves each creation behind (reconstruct/forming.py): no peer is taken for hung and
    replaced (before: each was, the one rank never reaching the next rendezvous, costing
    more spares than the job had), and the run ends bit-exact with two ranks replaced."""
    run, events = _launch(tmp_path, ["--deadpool-inject", "kill rank=5 iter=3 phase=backward"],
                          env={MEGATRON_FAULT: "kill rank=3 at=gloo call=2",
                               "GLOO_SOCKET_IFNAME": "lo"})
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert "test fault: kill in gloo (call 2)" in run.output
    assert _declared(events) == [[5], [3]], run.describe()
    left = [e for e in events if e["event"] == "forming_abandoned"]
    assert left and all(e["generation"] == 1 for e in left), run.describe()
    assert any(e["left_waiting"] for e in left), left
    assert not [e for e in events if e["event"] == "hang_localized"], run.describe()


@pytest.mark.fault_matrix
def test_a_rank_killed_inside_its_snapshot_pair_creation_leaves_its_buddy_waiting_in_none(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """As above, inside generation 1's snapshot pair group: rank 3 publishes its address
    for its pair with rank 7 and is killed; rank 7 waits in gloo to be connected, which
    no cut ends. The pair groups are made like the generation's others now, so the next
    declaration leaves that creation behind: rank 7 is not taken for hung (before: it was
    made on the main thread, stayed there, was replaced as the rank never reaching the
    next rendezvous, and with its buddy rank 3 lost too, hot-swap ended; a flush declared
    meanwhile waited --flush-timeout for it and wrote nothing). Two ranks replaced, the
    run bit-exact."""
    run, events = _launch(tmp_path, ["--deadpool-inject", "kill rank=5 iter=3 phase=backward"],
                          env={MEGATRON_FAULT: "kill rank=3 at=pair call=2",
                               "GLOO_SOCKET_IFNAME": "lo"})
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert "test fault: kill in a snapshot pair (call 2)" in run.output, run.describe()
    assert _declared(events) == [[5], [3]], run.describe()
    left = [e for e in events if e["event"] == "forming_abandoned"]
    assert any("snapshot pair" in e["what"] and e["left_waiting"] for e in left), left
    assert not [e for e in events if e["event"] == "hang_localized"], run.describe()


@pytest.mark.fault_matrix
def test_ranks_failing_alike_before_the_build_end_the_job_with_their_error(
        tmp_path: Path) -> None:
    """A configuration error every rank meets: GLOO_SOCKET_IFNAME names no interface, so each
    rank's gloo fails to create generation 0's default group. A spare would fail so too, so
    none is taken and the job ends at once with that error (before: each rank was replaced,
    and the job ended 'the in-memory shards of ranks [0..7] are lost', the error itself only
    in the workers' logs)."""
    run, events = _launch(tmp_path, env={"GLOO_SOCKET_IFNAME": "nonexistent0"})
    assert run.returncodes == [4] and not run.timed_out, run.describe()
    assert "failed alike before the job built its state (RuntimeError: [enforce fail at " \
           in run.output and "Unable to find address for: nonexistent0)" in run.output, \
        run.describe()
    assert not _declared(events), run.describe()


@pytest.mark.fault_matrix
def test_a_rank_killed_while_the_first_generation_creates_its_groups(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 3 dies while generation 0 creates its groups, before any rank has built its
    model: the others, cut loose, hold no objects to rebind; generation 1 starts fresh
    (the spare among them) and the run ends bit-exact."""
    run, events = _launch(tmp_path, ["--deadpool-inject", "kill rank=3 iter=0 phase=groups"])
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert _declared(events) == [[3]], run.describe()
    recovered = [e for e in events if e["event"] == "recovered"]
    assert {e["rank"] for e in recovered} == set(range(8)), run.describe()
    assert all(e["generation"] == 1 for e in recovered)


@pytest.mark.fault_matrix
def test_a_rank_stopped_while_the_job_starts_is_found_and_replaced(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 0 is stopped (SIGSTOP) while it builds its datasets, before its first progress
    stamp: its host reports it stopped all the same (its record is stamped when made), it
    is found at the 3 s progress timeout, a spare takes it, every rank builds afresh and
    the run ends bit-exact. Before, a worker without a stamp had no view: every peer
    waited out the 120 s rendezvous of generation 0 for it and the job ended (chaos soak
    seed 201, in a restarted epoch)."""
    with signal_worker_when(tmp_path / "workers" / "epoch0" / "w0.log",
                            "Unable to save MockGPTDataset", "w0", signal.SIGSTOP) as stopped:
        run, events = _launch(tmp_path, ["--deadpool-progress-timeout", "3"], spares=1)
    assert stopped and run.ok and run.fingerprint == failure_free_8.fingerprint, \
        run.describe()
    assert _declared(events) == [[0]], run.describe()
    (verdict,) = [e for e in events if e["event"] == "hang_localized"]
    assert verdict["culprits"] == ["w0"] and verdict["certain"], verdict
    assert verdict["why"]["w0"] == "stopped by a signal", verdict


@pytest.mark.fault_matrix
def test_a_rank_stopped_as_its_epoch_starts_is_found_with_the_default_timeout(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 0 is stopped (SIGSTOP) the moment its launcher has started the epoch's workers,
    before it has made its progress record, and the job runs with the default progress
    timeout: its host reports it stopped since its start, and host 0 finds it at the
    floor of 20 s, not the 300 s a slow start-up is allowed, before generation 0's 120 s
    rendezvous runs out. A spare takes it and the run ends bit-exact. Before, it went
    unseen (no record) or was given 300 s: the rendezvous timed out on rank 0's peers,
    spares were guessed hung one after another, and the epoch was lost (chaos soak seed
    208, a worker stopped 0.2 s into a restarted epoch)."""
    with signal_worker_when(tmp_path / "launcher.log", "epoch 0: 8 workers", "w0",
                            signal.SIGSTOP) as stopped:
        run, events = _launch(tmp_path, spares=1)
    assert stopped and run.ok and run.fingerprint == failure_free_8.fingerprint, \
        run.describe()
    assert "rendezvous of generation 0 incomplete" not in run.output, run.describe()
    assert _declared(events) == [[0]], run.describe()
    (verdict,) = [e for e in events if e["event"] == "hang_localized"]
    assert verdict["culprits"] == ["w0"] and verdict["certain"], verdict
    assert verdict["why"]["w0"] == "stopped by a signal", verdict


@pytest.mark.fault_matrix
def test_a_node_lost_while_the_job_builds_is_rebuilt_with_a_spare_that_built_alone(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 2 is killed while the job builds (before any snapshot): its spare builds rank
    2 alone for generation 1. The rest of its node (ranks 0, 1, 3) is killed as that
    generation is declared, so it breaks before the spare restored anything. The spare
    holds no snapshot and no usable state, every other rank is at the start: every rank
    builds afresh and the run ends bit-exact, hot-swapped. Before, the spare's report
    (built, not a bare spare's) made the plan 'no snapshot iteration is held by every
    survivor', every rank left with it, and the job ended as if its configuration failed
    (chaos soak seed 215: a node lost as a restarted epoch began)."""
    # Rank 0 logs its datasets' build (the other ranks log nothing yet).
    launcher, w0_log = tmp_path / "launcher.log", tmp_path / "workers" / "epoch0" / "w0.log"
    with signal_worker_when(w0_log, "Unable to save MockGPTDataset", "w2") as first, \
            signal_worker_when(launcher, "ranks [2] failed; spares", "w0") as w0, \
            signal_worker_when(launcher, "ranks [2] failed; spares", "w1") as w1, \
            signal_worker_when(launcher, "ranks [2] failed; spares", "w3") as w3:
        run, events = _launch(tmp_path, spares=4)
    assert first and w0 and w1 and w3, run.describe()
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert "no snapshot iteration is held" not in run.output, run.describe()
    assert "restarting all" not in run.output, run.describe()
    declared = _declared(events)
    assert declared[0] == [2] and sorted(r for d in declared[1:] for r in d) == [0, 1, 3], \
        run.describe()
    built = [e for e in events if e["event"] == "recovered"]
    assert built and {e["how"] for e in built} == {"fresh"}, built


@pytest.mark.fault_matrix
def test_a_spare_frozen_while_it_builds_alone_is_found_and_replaced(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """As test_megatron_lm_run's test_a_spare_frozen_while_it_builds_is_found_and_replaced,
    in our loop: rank 1 is killed in iteration 2 and the spare taking it is stopped
    (SIGSTOP) as its assignment is declared, while it builds alone. It is found frozen at
    the 3 s progress timeout and replaced by the second spare; no survivor waiting for it
    is taken for hung, and the run ends bit-exact."""
    with signal_worker_when(tmp_path / "launcher.log", "spares {1: 's0.0'}", "s0.0",
                            signal.SIGSTOP) as stopped:
        run, events = _launch(tmp_path, ["--deadpool-inject", "kill rank=1 iter=2 phase=backward",
                                         "--deadpool-progress-timeout", "3"])
    assert stopped and run.ok and run.fingerprint == failure_free_8.fingerprint, \
        run.describe()
    verdicts = [(e["culprits"], e["certain"], e["why"]) for e in events
                if e["event"] == "hang_localized"]
    assert verdicts == [(["s0.0"], True, {"s0.0": "stopped by a signal"})], run.describe()
    assert _declared(events) == [[1], [1]], run.describe()


@pytest.mark.fault_matrix
def test_a_spare_hung_while_it_builds_alone_is_found_at_the_startup_timeout(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 1 is killed in iteration 2; the spare taking it, s0.0, blocks forever in
    GPTModel's constructor as it builds rank 1 alone (a hang, not a stop: its process runs
    and its monitor answers). With --deadpool-startup-timeout 10 its build is found hung
    after 10 s, not the 300 s start-up allowance: the second spare takes rank 1, no
    survivor waiting for it is taken for hung, and the run ends bit-exact."""
    run, events = _launch(tmp_path, ["--deadpool-inject", "kill rank=1 iter=2 phase=backward",
                                     "--deadpool-startup-timeout", "10"],
                          env={MEGATRON_FAULT: "block worker=s0.0 at=build"})
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert "test fault: block in build" in run.output, run.describe()
    verdicts = [(e["culprits"], e["certain"]) for e in events
                if e["event"] == "hang_localized"]
    assert verdicts == [(["s0.0"], True)], run.describe()
    assert _declared(events) == [[1], [1]], run.describe()


@pytest.mark.fault_matrix
def test_a_rank_hung_in_its_first_build_is_found_at_the_startup_timeout(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 2 blocks forever in GPTModel's constructor as the job builds (no iteration, no
    snapshot yet); its peers, built, wait for it in the first iteration's collectives. At
    --deadpool-startup-timeout it is found blocked outside any collective (the peers are
    its victims, not guessed), a spare takes rank 2, every rank builds afresh and the run
    ends bit-exact."""
    run, events = _launch(tmp_path, ["--deadpool-startup-timeout", "10"], spares=1,
                          env={MEGATRON_FAULT: "block rank=2 at=build"})
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert "test fault: block in build" in run.output, run.describe()
    verdicts = [(e["culprits"], e["certain"], e["why"]) for e in events
                if e["event"] == "hang_localized"]
    assert verdicts == [(["w2"], True, {"w2": "blocked outside any collective"})], \
        run.describe()
    assert _declared(events) == [[2]], run.describe()


@pytest.mark.fault_matrix
def test_a_frozen_host_declared_lost_cannot_rejoin(tmp_path: Path,
                                                   failure_free_8: JobResult) -> None:
    """Host 1 (ranks 4-7, launcher included) is frozen mid-run, as by a partition; host 0
    declares it lost and its own spares take ranks 4-7. Thawed, host 1's workers find they
    are no members: none joins a later generation, and the job ends bit-exact."""
    events = tmp_path / "events"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--deadpool-events",
            str(events)]
    run = run_hosts([["--nproc-per-node", "4", "--spares", "4", "--heartbeat-timeout", "6"],
                     ["--nproc-per-node", "4", "--spares", "0", "--heartbeat-timeout", "6"]],
                    args, tmp_path, timeout_s=400, env=ENV,
                    freeze_host=(1, "iteration        3/", "recovery: generation 1 formed"))
    assert run.returncodes[0] == 0 and not run.timed_out, run.describe()
    assert run.fingerprint == failure_free_8.fingerprint, run.describe()
    ev = _events(events)
    assert _declared(ev) == [[4, 5, 6, 7]], run.describe()
    assert {e["how"] for e in ev if e["event"] == "failure_detected"} == {"host"}
    joined = {e["rank"] for e in ev if e["event"] == "recovered"}
    assert joined == set(range(8))
    assert all(e["from_buddy"] == (e["rank"] >= 4) for e in ev if e["event"] == "recovered")


def test_a_killed_launcher_leaves_no_worker(tmp_path: Path) -> None:
    script = REPO / "deadpool_megatron" / "testing" / "control_worker.py"
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", "2",
         "--spares", "1", str(script), "--deadpool", "--seconds", "120"],
        stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_workers_of(launcher.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)  # the preloader, 2 workers and a spare
        assert len(_workers_of(launcher.pid)) == 4, (tmp_path / "launcher.log").read_text()
        launcher.send_signal(signal.SIGKILL)  # the launcher alone, not its process group
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _workers_of(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _workers_of(launcher.pid) == []
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()


def _workers_of(launcher_pid: int) -> list[int]:
    """Live processes of that launcher's process group but the launcher: its preloader and
    the workers forked from it (launch/preload.py)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == launcher_pid:
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == launcher_pid and fields[0] != "Z":  # process group, state
            found.append(int(entry))
    return found


def test_a_job_without_deadpool_runs_as_under_torchrun(tmp_path: Path,
                                                        failure_free_8: JobResult) -> None:
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS)]
    run = run_launched(["--nproc-per-node", "8", "--spares", "0"], args, tmp_path / "plain",
                       timeout_s=300)
    assert run.returncodes == [0] and run.fingerprint == failure_free_8.fingerprint, \
        run.describe()
    refused = run_launched(["--nproc-per-node", "8", "--spares", "2"], args,
                           tmp_path / "spares", timeout_s=60)
    assert refused.returncodes == [2], refused.describe()
    assert "--spares 2 needs --deadpool" in refused.output
