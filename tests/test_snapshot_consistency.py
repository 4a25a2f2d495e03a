"""Issue 3's acceptance: committed buddy snapshots restore the exact state; torn or
corrupted copies are never committed and leave the previous generation usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import GPT_3D_ARGS
from deadpool_megatron.testing.jobs import JobResult, run_job

pytestmark = pytest.mark.multiproc
ITERS = 8
DEADPOOL = ["--deadpool", "--deadpool-ranks-per-node", "4"]


def _events(prefix: Path, rank: int) -> list[dict]:
    path = Path(f"{prefix}.rank{rank}")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _args(dist_opt: bool) -> list[str]:
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS)]
    return args if dist_opt else [a for a in args if a != "--use-distributed-optimizer"]


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distopt", "plain-optimizer"])
def test_buddy_copy_restores_exact_state(tmp_path: Path, dist_opt: bool,
                                         failure_free_8: JobResult) -> None:
    """At iteration 5 every rank replaces its live model/optimizer by fresh ones restored from
    its buddy's committed copy; the run must end bit-identical to one without DeadPool.
    A copy corrupted on the wire at iteration 3 must not commit, and training goes on.
    Commits are pairwise: only the pair of the corrupted copy (rank 2 and its buddy 6, each
    the other's buddy with 4 ranks per node) leaves snapshot 3 uncommitted."""
    base = failure_free_8 if dist_opt else run_job(8, _args(dist_opt), tmp_path / "base",
                                                   timeout_s=300)
    assert base.ok, base.describe()
    events = tmp_path / "events"
    run = run_job(8, [*_args(dist_opt), *DEADPOOL, "--deadpool-verify-restore-at", "5",
                      "--deadpool-inject", "corrupt rank=2 iter=3 phase=snapshot",
                      "--deadpool-events", str(events)], tmp_path / "deadpool", timeout_s=300)
    assert run.ok, run.describe()
    assert "restore check: every rank now runs on a fresh model" in run.output
    assert run.fingerprint == base.fingerprint
    assert run.losses == base.losses
    for rank in range(8):
        ev = _events(events, rank)
        committed = [e["iteration"] for e in ev if e["event"] == "snapshot_committed"]
        not_committed = [e for e in ev if e["event"] == "snapshot_not_committed"]
        # The starting state (iteration 0) is committed before the first iteration.
        if rank in (2, 6):
            assert committed == [i for i in range(0, ITERS + 1) if i != 3], (rank, committed)
            assert [e["iteration"] for e in not_committed] == [3]
            # Rank 2's own copy failed at its buddy; rank 6 refused its ward's copy.
            assert (not_committed[0]["own"], not_committed[0]["ward"]) == \
                ((False, True) if rank == 2 else (True, False))
        else:
            assert committed == list(range(0, ITERS + 1)), (rank, committed)
            assert not not_committed


def test_sender_killed_mid_transfer_leaves_previous_generation(tmp_path: Path) -> None:
    events = tmp_path / "events"
    run = run_job(8, [*_args(True), *DEADPOOL, "--deadpool-snapshot-chunk-mb", "0.02",
                      "--deadpool-inject", "kill rank=5 iter=4 phase=snapshot",
                      "--deadpool-events", str(events)], tmp_path / "job", timeout_s=300)
    assert not run.ok and run.returncodes[5] == -9, run.describe()
    receiver = 1  # rank 5's buddy with 4 ranks per logical node
    torn = [e for e in _events(events, receiver) if e["event"] == "snapshot_torn"]
    assert len(torn) == 1 and torn[0]["iteration"] == 4, run.describe()
    assert torn[0]["committed"] == 3 and torn[0]["committed_intact"] is True
    sender_gen3 = [e for e in _events(events, 5)
                   if e["event"] == "snapshot_committed" and e["iteration"] == 3]
    assert sender_gen3 and torn[0]["committed_crc"] == sender_gen3[0]["crc"]
    # Pairwise commits: the pair of the dead sender never commits 4; every survivor still
    # holds a committed snapshot (3 or newer) of its own shard and of its ward's.
    assert not any(e["event"] == "snapshot_committed" and e["iteration"] == 4
                   for r in (1, 5) for e in _events(events, r))
    for rank in (r for r in range(8) if r != 5):
        ev = _events(events, rank)
        last = max(e["iteration"] for e in ev if e["event"] == "snapshot_committed")
        assert last >= 3, (rank, last)
