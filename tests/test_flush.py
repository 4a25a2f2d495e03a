"""Flush instead of discard: when hot-swap is impossible, or the job is stopped, the newest
in-memory snapshots go to --save, and the job resumes from them bit-exact."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from conftest import GPT_3D_ARGS
from deadpool_megatron.metrics.timeline import load_events
from deadpool_megatron.snapshot import flush
from deadpool_megatron.snapshot.buffers import Slot, checksum
from deadpool_megatron.testing.disk import damage_flushed_shard
from deadpool_megatron.testing.jobs import JobResult, run_job, run_launched
from deadpool_megatron.testing.signals import sigterm_the_launcher, signal_worker_when

ITERS = 8
ENV = {"DEADPOOL_CONTROL_TIMEOUT_S": "90"}
LOADED = re.compile(r"loaded the snapshot of iteration (\d+) flushed to")
FLUSHED = re.compile(r"flushed the snapshot of iteration (\d+) to")
ITERATION = re.compile(r"iteration +(\d+)/ *\d+ \|")


def _slot(iteration: int, fill: int) -> Slot:
    flat = torch.full((1000,), fill, dtype=torch.uint8)
    objects = b"small state"
    return Slot(flat=flat, iteration=iteration, objects=objects, crc=checksum(flat, objects))


def test_only_a_complete_iteration_is_committed_and_read_back_whole(tmp_path: Path) -> None:
    save = str(tmp_path)
    for rank in range(3):
        flush.write_shard(save, rank, _slot(4, rank))
    flush.write_shard(save, 0, _slot(5, 9))  # iteration 5: rank 0 only, so incomplete
    assert flush.complete_iterations(save, world=3) == [4]
    assert flush.latest(save) is None  # nothing is marked before the commit
    assert flush.commit(save, world=3) == 4 and flush.latest(save) == 4
    assert not os.path.exists(flush.iteration_dir(save, 5))  # the incomplete one is dropped
    back = flush.read_shard(save, 4, 2)
    assert back.verify() and torch.equal(back.flat, _slot(4, 2).flat)


def test_a_buddys_stand_in_copy_counts_where_the_ranks_own_file_is_missing(
        tmp_path: Path) -> None:
    """A stand-in copy (a buddy's, written when the flush came during a recovery) completes
    an iteration whose rank wrote nothing, and is read back; where the rank wrote its own
    too, its own is read."""
    save = str(tmp_path)
    flush.write_shard(save, 0, _slot(4, 0))
    flush.write_shard(save, 1, _slot(4, 7), copy=True)
    assert flush.complete_iterations(save, world=2) == [4]
    assert int(flush.read_shard(save, 4, 1).flat[0]) == 7
    flush.write_shard(save, 1, _slot(4, 1))
    assert int(flush.read_shard(save, 4, 1).flat[0]) == 1
    flush.write_shard(save, 0, _slot(5, 0), copy=True)  # a copy alone is not rank 1's
    assert flush.complete_iterations(save, world=2) == [4]


def test_a_damaged_flushed_shard_is_refused(tmp_path: Path) -> None:
    save = str(tmp_path)
    flush.write_shard(save, 0, _slot(4, 1))
    data = Path(flush.iteration_dir(save, 4)) / "rank_00000.bin"
    blob = bytearray(data.read_bytes())
    blob[10] ^= 0xFF
    data.write_bytes(bytes(blob))
    assert not flush.read_shard(save, 4, 0).verify()  # the restore refuses it (checksum)
    data.write_bytes(bytes(blob[:-1]))
    with pytest.raises(flush.FlushError, match="unreadable"):
        flush.read_shard(save, 4, 0)
    (Path(save) / flush.ROOT / flush.LATEST).write_text("x")
    with pytest.raises(flush.FlushError, match="corrupt"):
        flush.latest(save)


def test_a_flush_set_aside_is_never_loaded_again_and_an_older_one_commits_after_it(
        tmp_path: Path) -> None:
    """A committed flush that a load found damaged is unmarked and kept aside: no start
    loads it again, and a later flush of an older iteration (the job went back to its
    checkpoint) commits, where the old marker would have kept it out and pruned it."""
    save = str(tmp_path)
    for rank in range(2):
        flush.write_shard(save, rank, _slot(6, rank))
    assert flush.commit(save, world=2) == 6
    aside = flush.set_aside(save, 6)
    assert flush.latest(save) is None and flush.complete_iterations(save, world=2) == []
    assert os.path.basename(aside) == "refused_iter_0000006"
    assert sorted(os.listdir(aside)) == [f"rank_0000{r}.{x}" for r in (0, 1)
                                         for x in ("bin", "json")]
    for rank in range(2):
        flush.write_shard(save, rank, _slot(4, rank))
    assert flush.commit(save, world=2) == 4 and flush.latest(save) == 4
    assert os.path.isdir(aside), "the set-aside flush was pruned"
    # A marker left without its directory (a crash between the two steps) is unmarked too.
    (Path(save) / flush.ROOT / flush.LATEST).write_text("9")
    flush.set_aside(save, 9)
    assert flush.latest(save) is None


def _partial_copy(whole: Slot, split: int, chunk: int) -> Slot:
    """What a buddy holds of `whole` when its replicated region flat[:split] stays with a
    data-parallel peer: the unique bytes, the region's chunk table, the unique checksum."""
    from deadpool_megatron.snapshot.buffers import chunk_table, unique_checksum

    table = chunk_table(whole.flat, split, chunk)
    flat = whole.flat.clone()
    flat[:split] = 0  # never received
    crc = unique_checksum(whole.flat, split, table, whole.objects)
    slot = Slot(flat=flat, iteration=whole.iteration, objects=whole.objects, crc=crc)
    slot.seal_regions(split, table, crc, partial=True, chunk=chunk)
    return slot


def test_a_partial_copy_is_flushed_and_read_back_with_its_sources_region(
        tmp_path: Path) -> None:
    """A lost rank whose buddy held only its unique bytes: the buddy flushes those, the
    data-parallel source flushes its own whole shard, and the read joins them, checking
    every chunk of the region against the table; nothing else is accepted."""
    save = str(tmp_path)
    region = torch.arange(600, dtype=torch.int64).to(torch.uint8)  # replicated on 0 and 1
    shards = []
    for rank in range(2):
        flat = torch.cat([region, torch.full((400,), 7 + rank, dtype=torch.uint8)])
        objects = f"rank {rank}".encode()
        shards.append(Slot(flat=flat, iteration=4, objects=objects,
                           crc=checksum(flat, objects)))
    flush.write_shard(save, 0, shards[0])  # the source, alive, writes its own
    assert flush.complete_iterations(save, world=2) == []
    flush.write_shard(save, 1, _partial_copy(shards[1], split=600, chunk=256), source=0)
    assert flush.complete_iterations(save, world=2) == [4]
    data = Path(flush.iteration_dir(save, 4)) / "rank_00001.bin"
    assert data.stat().st_size == 400 + len(b"rank 1")  # the region is not written twice
    back = flush.read_shard(save, 4, 1)
    assert not back.partial and back.verify()
    assert torch.equal(back.flat, shards[1].flat) and back.objects == b"rank 1"
    # The source's region differs from the table: refused, naming what to do.
    source = Path(flush.iteration_dir(save, 4)) / "rank_00000.bin"
    blob = bytearray(source.read_bytes())
    blob[300] ^= 0xFF
    source.write_bytes(bytes(blob))
    with pytest.raises(flush.FlushError, match="could not be taken from rank 0"):
        flush.read_shard(save, 4, 1)
    # A damaged unique part is refused too.
    source.write_bytes(bytes(blob[:300] + bytearray([blob[300] ^ 0xFF]) + blob[301:]))
    blob = bytearray(data.read_bytes())
    blob[5] ^= 0xFF
    data.write_bytes(bytes(blob))
    with pytest.raises(flush.FlushError, match="does not match its checksum"):
        flush.read_shard(save, 4, 1)


def test_a_partial_copy_with_no_unique_tensor_bytes_is_read_back(tmp_path: Path) -> None:
    """A plain optimizer: every tensor byte of the shard is replicated, so a buddy's copy
    holds only the small objects (RNG, data position). Chaos soak seed 301 (--layout
    tp2-dp4): the restart from such a flush failed reading it ('both buffer length (0) and
    count (-1) must not be 0'), on rank 0 and then on its spare, and the job ended."""
    save = str(tmp_path)
    region = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    shards = [Slot(flat=region.clone(), iteration=4, objects=f"rank {r}".encode(),
                   crc=checksum(region, f"rank {r}".encode())) for r in range(2)]
    flush.write_shard(save, 0, shards[0])
    flush.write_shard(save, 1, _partial_copy(shards[1], split=1000, chunk=256), source=0)
    assert flush.complete_iterations(save, world=2) == [4]
    back = flush.read_shard(save, 4, 1)
    assert not back.partial and back.verify()
    assert torch.equal(back.flat, region) and back.objects == b"rank 1"

def test_two_partial_copies_that_name_each_other_are_never_complete(tmp_path: Path) -> None:
    """Both replicas lost with only unique bytes left: no shard holds the region."""
    save = str(tmp_path)
    for rank in range(2):
        flat = torch.full((1000,), rank, dtype=torch.uint8)
        whole = Slot(flat=flat, iteration=4, objects=b"x", crc=checksum(flat, b"x"))
        flush.write_shard(save, rank, _partial_copy(whole, 500, 256), source=1 - rank)
    assert flush.complete_iterations(save, world=2) == []
    with pytest.raises(flush.FlushError, match="does not hold the region whole"):
        flush.read_shard(save, 4, 0)


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer", [
    "distributed", pytest.param("plain", marks=pytest.mark.fault_matrix)])
def test_spares_exhausted_restart_from_the_flushed_snapshot(
        tmp_path: Path, failure_free_8: JobResult, optimizer: str) -> None:
    """One spare, two failures, a --save-interval longer than the run (so no checkpoint):
    the second failure (iteration 6) flushes snapshot 5, held by survivors and, for the
    lost rank 1, by its buddy (the spare that took rank 3, refilled at its recovery); the job
    restarts from it, redoes iteration 6 only, and ends bit-exact. Four logical nodes of two
    ranks put rank 1's data-parallel peer 3 on another node: rank 3 is both its buddy and
    its replica source, so the buddy holds (and flushes) only rank 1's unique bytes and the
    load takes the replicated region from rank 3's own flushed shard. With a plain
    optimizer every tensor byte of a shard is replicated: the buddy's copy holds none."""
    model = GPT_3D_ARGS if optimizer == "distributed" else \
        [a for a in GPT_3D_ARGS if a != "--use-distributed-optimizer"]
    reference = failure_free_8 if optimizer == "distributed" else run_job(
        8, [*model, "--train-iters", str(ITERS)], tmp_path / "reference", timeout_s=300)
    assert reference.ok, reference.describe()
    save, events = tmp_path / "ckpt", tmp_path / "events"
    args = [*model, "--train-iters", str(ITERS), "--deadpool", "--deadpool-events",
            str(events), "--save", str(save), "--save-interval", "100",
            "--deadpool-inject", "kill rank=3 iter=3 phase=backward",
            "--deadpool-inject", "kill rank=1 iter=6 phase=backward wait=commit"]
    run = run_launched(["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "4"],
                       args, tmp_path, timeout_s=500, env=ENV)
    out = run.logs[0]
    assert run.returncodes == [0] and not run.timed_out, run.describe()
    assert run.fingerprint == reference.fingerprint, run.describe()
    assert "hot-swap impossible" in out, run.describe()
    assert [int(i) for i in FLUSHED.findall(out)] == [5], run.describe()
    assert [int(i) for i in LOADED.findall(out)] == [5], run.describe()
    assert "restarting all 8 workers" in out, run.describe()
    restart = "".join(p.read_text() for p in (tmp_path / "workers" / "epoch1").glob("*.log"))
    assert min(int(i) for i in ITERATION.findall(restart)) == 6, "redid an iteration before 6"
    assert not os.path.exists(save / "latest_checkpointed_iteration.txt")
    flushed = [e for e in load_events(events) if e["event"] == "flushed"]
    assert [e["rank"] for e in flushed if "1" in e["written"]] == [3], \
        "the lost rank's shard was not written by its buddy (rank 3) alone"
    # Its buddy held only its unique bytes: the region came from its DP source's shard.
    meta = json.loads((Path(flush.iteration_dir(str(save), 5)) / "rank_00001.json").read_text())
    assert meta["partial"]["source"] == 3, meta
    assert (meta["partial"]["split"] == meta["flat_bytes"]) == (optimizer == "plain"), meta


def _resumes_from_the_flush(launch: list[str], args: list[str], save: Path, log_dir: Path,
                            flushed: int, reference: JobResult) -> None:
    """A relaunch with --load `save` loads the snapshot of iteration `flushed`, redoes no
    iteration before it and ends with the failure-free fingerprint."""
    second = run_launched(launch, [*args, "--load", str(save)], log_dir, timeout_s=400,
                          env=ENV)
    assert second.ok, second.describe()
    assert [int(i) for i in LOADED.findall(second.logs[0])] == [flushed], second.describe()
    assert min(int(i) for i in ITERATION.findall(second.logs[0])) == flushed + 1
    assert second.fingerprint == reference.fingerprint, second.describe()


@pytest.mark.multiproc
@pytest.mark.fault_matrix
def test_sigterm_flushes_and_a_relaunch_resumes_bit_exact(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """SIGTERM to the launcher and its workers (as a scheduler's time limit sends it) at
    iteration 4: the newest snapshot is written to --save, the job exits with 143 and says
    how to resume; relaunched with --load it resumes there and ends bit-exact.

    The same flush with one byte of rank 5's shard changed on disk: every rank finds out
    before any loads, the flush is set aside, and every rank loads Megatron's checkpoint of
    iteration 3 instead, redoes the iterations since and ends bit-exact (before: the start
    ended with "unreadable ... delete latest.txt", and --max-restarts met it again)."""
    save = tmp_path / "ckpt"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--save", str(save),
            "--save-interval", "3"]
    launch = ["--nproc-per-node", "8", "--logical-nodes", "2"]
    first = run_launched(launch, args, tmp_path / "first", timeout_s=400, env=ENV,
                         term_at="iteration        4/")
    out = first.logs[0]
    assert first.returncodes == [143] and not first.timed_out, first.describe()
    flushed = [int(i) for i in FLUSHED.findall(out)]
    assert len(flushed) == 1 and flushed[0] >= 4, first.describe()
    assert f"relaunch with --load {save}" in out
    damaged = tmp_path / "damaged"
    shutil.copytree(save, damaged)
    _resumes_from_the_flush(launch, args, save, tmp_path / "second", flushed[0],
                            failure_free_8)
    damage_flushed_shard(damaged, flushed[0], rank=5)
    args[args.index(str(save))] = str(damaged)
    third = run_launched(launch, [*args, "--load", str(damaged)], tmp_path / "third",
                         timeout_s=400, env=ENV)
    _fell_back_to_the_checkpoint(third, damaged, flushed[0], 3, failure_free_8)


def _fell_back_to_the_checkpoint(run: JobResult, save: Path, flushed: int, checkpoint: int,
                                 reference: JobResult) -> None:
    """A start over a damaged flush: it is set aside, nothing of it is loaded, the job
    redoes every iteration since the checkpoint and ends with `reference`'s fingerprint."""
    assert run.ok, run.describe()
    out = run.logs[0]
    assert re.search(rf"the snapshot of iteration {flushed} flushed to \S+ cannot be loaded: "
                     rf"rank 5: snapshot of iteration {flushed} fails its checksum", out), \
        run.describe()
    assert "cannot be loaded" in out and not LOADED.findall(out), run.describe()
    assert f"checkpoint of iteration {checkpoint} instead" in out, run.describe()
    assert min(int(i) for i in ITERATION.findall(out)) == checkpoint + 1, run.describe()
    assert run.fingerprint == reference.fingerprint, run.describe()
    assert (save / flush.ROOT / f"refused_iter_{flushed:07d}").is_dir()
    assert not (save / flush.ROOT / flush.LATEST).exists()


@pytest.mark.multiproc
@pytest.mark.parametrize("term_at, joined", [("epoch 0: 8 workers", False),
                                             ("Unable to save MockGPTDataset", True)])
def test_a_sigterm_while_the_workers_build_ends_the_job_at_once(tmp_path: Path, term_at: str,
                                                                joined: bool) -> None:
    """SIGTERM to the launcher and its workers as soon as they are started, or while they
    build their datasets, before any snapshot: no worker dies of it (a worker starts with
    SIGTERM ignored, and installs its handler as soon as it joins), every worker reports an
    empty flush, and the launcher says why nothing was written. Before, the workers' flush
    failed on a snapshot pipeline not set up yet, each took that for a peer's failure and
    tried again, and the launcher waited out the flush timeout for reports that never
    came; and a worker not yet joined died of the signal, its missing report taken for
    missing shards."""
    save = tmp_path / "ckpt"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--save", str(save),
            "--save-interval", "100"]
    run = run_launched(["--nproc-per-node", "8", "--logical-nodes", "2"], args, tmp_path,
                       timeout_s=200, env=ENV, term_at=term_at)
    out = run.logs[0]
    assert run.returncodes == [143] and not run.timed_out, run.describe()
    if joined:  # its handler says so; a worker still starting ignores the signal
        assert "SIGTERM: left to deadpool-launch" in out, run.describe()
    assert "exited with -15" not in out and "Traceback" not in out, run.describe()
    assert "no worker holds snapshots to flush (the job stopped before its first snapshot: " \
           "relaunch it as it was)" in out, run.describe()
    assert out.count("flushed {} (host 0's launcher was asked to stop") == 8, run.describe()
    assert not ITERATION.search(out), run.describe()


@pytest.mark.multiproc
@pytest.mark.fault_matrix
def test_a_sigterm_during_a_recovery_flushes_the_spares_rank_from_its_buddy(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 1 is killed in iteration 3 and the scheduler's SIGTERM comes as the spare is
    declared in its place, before it has restored anything: the spare holds no snapshot of
    rank 1, so rank 1's buddy (rank 5) writes its copy as a stand-in, the flush is complete
    and the relaunch resumes from it bit-exact. Before, the buddy wrote only a lost rank's
    copy, rank 1 was not lost (its spare was alive), and the flush had no complete
    iteration: everything since the last checkpoint (here: the whole run) was lost."""
    save = tmp_path / "ckpt"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--save", str(save),
            "--save-interval", "100"]
    launch = ["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "2"]
    first = run_launched(launch, [*args, "--deadpool-inject", "kill rank=1 iter=3 phase=backward"],
                         tmp_path / "first", timeout_s=400, env=ENV,
                         term_at="ranks [1] failed; spares")
    out = first.logs[0]
    assert first.returncodes == [143] and not first.timed_out, first.describe()
    flushed = [int(i) for i in FLUSHED.findall(out)]
    assert len(flushed) == 1 and flushed[0] >= 2, first.describe()
    assert "'1 (copy)': [" in out, first.describe()
    assert (Path(flush.iteration_dir(str(save), flushed[0])) / "rank_00001.copy.json").exists()
    _resumes_from_the_flush(launch, args, save, tmp_path / "second", flushed[0],
                            failure_free_8)
    # The same flush loaded by another model: refused, saying what to change.
    other = [a if a != "64" else "32" for a in args]  # --hidden-size
    third = run_launched(launch, [*other, "--load", str(save)], tmp_path / "third",
                         timeout_s=200, env=ENV)
    assert third.returncodes != [0] and not third.timed_out, third.describe()
    assert "was taken from a different model or optimizer layout" in third.logs[0]
    assert "relaunch with the parallel layout and model it was flushed with, or delete " \
           f"{save}/deadpool_flush/latest.txt" in third.logs[0], third.describe()


@pytest.mark.multiproc
@pytest.mark.fault_matrix
def test_a_spare_that_finds_a_flush_for_its_assignment_reports_to_it(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """The only spare (s0.0) is slow to start (stopped by a signal, no record yet: nothing
    to judge). Rank 5 is killed in iteration 3 and s0.0 is assigned its place; rank 6 dies
    as that is declared, no spare is left, and host 0 declares a flush. Only then does s0.0
    go on: the newest declaration, the flush, names it rank 5. It reports holding nothing,
    rank 5's buddy writes its copy, and the restart resumes from the flush bit-exact.
    Before (chaos soak seed 321), the spare took the flush for its assignment, built and
    waited in the flush generation's rendezvous, which nobody forms: the flush waited
    --flush-timeout for its report and had no complete snapshot."""
    save, job = tmp_path / "ckpt", tmp_path / "job"
    log = job / "launcher.log"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--save", str(save),
            "--save-interval", "100", "--deadpool-inject", "kill rank=5 iter=3 phase=backward"]
    launch = ["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "2",
              "--flush-timeout", "20"]
    with signal_worker_when(log, "epoch 0: 8 workers", "s0.0", signal.SIGSTOP) as stopped, \
            signal_worker_when(log, "ranks [5] failed; spares", "w6") as killed, \
            signal_worker_when(log, "hot-swap impossible", "s0.0", signal.SIGCONT) as resumed:
        run = run_launched(launch, args, job, timeout_s=400, env=ENV)
    out = run.logs[0]
    assert stopped and killed and resumed, run.describe()
    assert run.ok and run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert "did not report at the flush" not in out, run.describe()
    spare = (job / "workers" / "epoch0" / "s0.0.log").read_text()
    assert "rank 5: flushed {} (" in spare, spare[-3000:]  # reported, holding nothing
    flushed = [int(i) for i in FLUSHED.findall(out)]
    assert len(flushed) == 1 and flushed[0] >= 2, run.describe()
    assert [int(i) for i in LOADED.findall(out)] == flushed, run.describe()
    assert "'5 (copy)': [" in out, run.describe()


@pytest.mark.multiproc
@pytest.mark.fault_matrix
def test_a_sigterm_while_a_rank_is_frozen_flushes_its_copy_from_its_buddy(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Rank 3 is stopped by a signal (SIGSTOP: a debugger, a cgroup freeze) in iteration 3,
    and the scheduler's SIGTERM comes before its hang is found. It cannot write its shard:
    host 0 counts it lost, its buddy (rank 7) writes its copy, the flush is complete at
    once, the stopped worker is killed without waiting out --shutdown-timeout, and the
    relaunch resumes bit-exact. Before, the flush waited --flush-timeout for its report and
    had no complete iteration, and the stop waited out the shutdown timeout for it."""
    save = tmp_path / "ckpt"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--save", str(save),
            "--save-interval", "100", "--deadpool-events", str(tmp_path / "events")]
    launch = ["--nproc-per-node", "8", "--logical-nodes", "2"]
    workers = tmp_path / "first" / "workers"
    # Rank 4 logs the iterations. 1.5 s after the freeze its host has reported it stopped.
    with signal_worker_when(workers / "epoch0" / "w4.log", "iteration        3/", "w3",
                            signal.SIGSTOP, then=sigterm_the_launcher(workers),
                            then_after_s=1.5) as frozen:
        first = run_launched(launch, args, tmp_path / "first", timeout_s=400, env=ENV)
    out = first.logs[0]
    assert frozen and first.returncodes == [143] and not first.timed_out, first.describe()
    assert "ranks [3] are stopped by a signal (['w3'])" in out, first.describe()
    assert "killing worker w3: stopped by a signal" in out, first.describe()
    flushed = [int(i) for i in FLUSHED.findall(out)]
    assert len(flushed) == 1 and flushed[0] >= 2, first.describe()
    written = [e for e in load_events(tmp_path / "events") if e["event"] == "flushed"]
    assert [e["rank"] for e in written if "3" in e["written"]] == [7], first.describe()
    _resumes_from_the_flush(launch, args, save, tmp_path / "second", flushed[0],
                            failure_free_8)


# Rank 3's thread blocks forever (cutting its connections does not free it), and the
# scheduler's SIGTERM comes then: its training thread in its first backward of iteration 4
# (a hung kernel; four micro-batches of four linear layers' backwards per iteration), or its
# snapshot worker in the acknowledgement of snapshot 3 (a snapshot in flight, as CI found:
# one rank's worker still in it 5 s after the cut, and nothing was flushed). What is
# flushed: (fault, thread named stuck, iteration).
BLOCKED = {  # the fault, the thread it holds, the flushed iteration, the seconds waited
    "training": (f"block rank=3 at=backward call={3 * 4 * 4 + 1}", "the training thread", 3,
                 5),
    "snapshot": ("block rank=3 at=ack call=4", "the snapshot worker", 3, 1),
}


@pytest.mark.multiproc
@pytest.mark.fault_matrix
@pytest.mark.parametrize("thread", sorted(BLOCKED))
def test_sigterm_while_a_thread_is_blocked_still_flushes_every_shard(
        tmp_path: Path, failure_free_8: JobResult, thread: str) -> None:
    """A flush needs only the snapshots held complete in host memory, not the blocked
    thread: rank 3 writes its shard too, the flush is complete, and the relaunch resumes
    there and ends bit-exact (before, rank 3 left without writing and the flush was lost)."""
    from deadpool_megatron.faults.megatron_faults import ENV as MEGATRON_FAULT

    fault, stuck, iteration, waited = BLOCKED[thread]
    save = tmp_path / "ckpt"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--save", str(save),
            "--save-interval", "100"]
    launch = ["--nproc-per-node", "8", "--logical-nodes", "2"]
    first = run_launched(launch, args, tmp_path / "first", timeout_s=400,
                         env={**ENV, MEGATRON_FAULT: fault}, term_at="test fault: block in")
    out = first.logs[0]
    assert first.returncodes == [143] and not first.timed_out, first.describe()
    assert f"rank 3: {stuck} did not stop within {waited} s of its connections being cut; " \
           f"flushing this rank's snapshots without it" in first.output, first.describe()
    assert [int(i) for i in FLUSHED.findall(out)] == [iteration], first.describe()
    _resumes_from_the_flush(launch, args, save, tmp_path / "second", iteration,
                            failure_free_8)


def test_a_flush_that_wrote_nothing_says_why(tmp_path: Path) -> None:
    """The launcher names why no snapshot was flushed: the job stopped before its first
    snapshot, or no worker was alive. Nothing is said while one report is missing or one
    worker wrote something (the commit speaks then)."""
    import torch.distributed as dist

    from deadpool_megatron.control import keys
    from deadpool_megatron.control.auth import SignedStore
    from deadpool_megatron.launch.config import LaunchConfig
    from deadpool_megatron.launch.coordinator import Coordinator
    from deadpool_megatron.metrics.events import EventLog

    store = dist.HashStore()
    signed = SignedStore(store, "k" * 32, keys.epoch_prefix(0))
    coordinator = Coordinator(LaunchConfig(nproc_per_node=2), signed, ranks_per_node=2,
                              allow_same_node=False,
                              events=EventLog(str(tmp_path / "events"), rank=-1))

    def report(worker: str, written: dict) -> None:
        signed.set(keys.flush_report(worker),
                   json.dumps({"rank": int(worker[1:]), "written": written}))

    report("w0", {})
    assert coordinator.why_nothing_flushed(["w0", "w1"]) is None  # w1 has not reported
    report("w1", {})
    assert "before its first snapshot" in coordinator.why_nothing_flushed(["w0", "w1"])
    report("w1", {"1": [4]})
    assert coordinator.why_nothing_flushed(["w0", "w1"]) is None
    assert "no live worker" in coordinator.why_nothing_flushed([])
