"""Issue 11, no redundant bytes: a rank whose replicated bytes (parameters; with a plain
optimizer its state too) a data-parallel peer on another node holds sends its buddy only
its unique bytes; after it dies, its spare takes the unique region from the buddy and the
replicated one from that peer, checked against the buddy's CRC table, bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import GPT_3D_ARGS
from deadpool_megatron.snapshot import flush
from deadpool_megatron.testing.jobs import JobResult, run_launched
from deadpool_megatron.metrics.timeline import load_events

pytestmark = pytest.mark.multiproc
ITERS = 8
ENV = {"DEADPOOL_CONTROL_TIMEOUT_S": "90"}


@pytest.mark.fault_matrix
def test_spare_takes_replicated_region_from_dp_peer(tmp_path: Path,
                                                    failure_free_8: JobResult) -> None:
    """8 logical nodes of one rank (TP2 x PP2 x DP2, distributed optimizer): rank 5's buddy
    is rank 6, its data-parallel source rank 7. Rank 5 dies in iteration 4; its spare gets
    the optimizer shard (unique) from rank 6 and the parameters from rank 7."""
    events = tmp_path / "events"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--deadpool-events",
            str(events), "--deadpool-inject", "kill rank=5 iter=4 phase=backward"]
    launch = ["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "8",
              "--heartbeat-timeout", "10", "--failure-window", "0.05"]
    run = run_launched(launch, args, tmp_path / "job", timeout_s=400, env=ENV)
    assert run.ok, run.describe()
    assert run.fingerprint == failure_free_8.fingerprint, run.describe()
    ev = load_events(events)
    setup = {e["rank"]: e for e in ev if e["event"] == "snapshot_setup"}
    assert setup[5]["replica_source"] == 7 and setup[5]["buddy"] == 6
    assert setup[5]["skips_replicated"] and 0 < setup[5]["sent_bytes"] < setup[5]["shard_bytes"]
    assert setup[5]["sent_bytes"] == setup[5]["shard_bytes"] - \
        setup[5]["replicated_region_bytes"]
    moved = [e for e in ev if e["event"] == "replicated_region_moved"]
    assert {(e["rank"], e["role"], e["source"], e["to"]) for e in moved} == \
        {(7, "source", 7, 5), (5, "spare", 7, 5)}, moved
    spare = [e for e in ev if e["event"] == "recovered" and e["from_buddy"]]
    assert len(spare) == 1 and spare[0]["rank"] == 5 and spare[0]["replica_from"] == 7
    assert "taken from data-parallel peer 7, every chunk matching" in run.output


@pytest.mark.fault_matrix
def test_rank_and_its_source_lost_together_fall_back_cleanly(tmp_path: Path,
                                                             failure_free_8: JobResult) -> None:
    """Rank 5 and rank 7, its data-parallel source, die together: rank 5's parameters are
    on no live rank (its buddy, rank 6, holds only its unique bytes). Host 0 refuses the
    hot swap; the buddies flush only the unique bytes of ranks 5 and 7, each one's
    replicated region to be taken from the other's shard, so no flushed snapshot is
    complete, and the restart takes the newest checkpoint (iteration 2): bit-exact, never
    a silently wrong state."""
    ckpt, events = tmp_path / "ckpt", tmp_path / "events"
    args = [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool",
            "--deadpool-events", str(events), "--save", str(ckpt), "--save-interval", "2",
            "--deadpool-inject", "kill rank=5 iter=4 phase=optimizer",
            "--deadpool-inject", "kill rank=7 iter=4 phase=optimizer"]
    launch = ["--nproc-per-node", "8", "--spares", "2", "--logical-nodes", "8",
              "--heartbeat-timeout", "10", "--failure-window", "2.0"]
    run = run_launched(launch, args, tmp_path / "job", timeout_s=400, env=ENV)
    assert "the replicated bytes of ranks [5, 7] are lost" in run.output, run.describe()
    assert "the flush wrote no complete snapshot" in run.output, run.describe()
    assert "(shards missing)" in run.output, run.describe()
    # Their buddies (6 and 0) wrote what they held; the commit then pruned it, incomplete.
    flushed = [e for e in load_events(events) if e["event"] == "flushed"]
    for rank, buddy in ((5, 6), (7, 0)):
        assert [e["rank"] for e in flushed if str(rank) in e["written"]] == [buddy], flushed
    assert not list((ckpt / flush.ROOT).glob("iter_*")), "an incomplete flush was kept"
    assert "loaded checkpoint of iteration 2" in run.output, run.describe()
    assert run.ok, run.describe()
    assert run.fingerprint == failure_free_8.fingerprint


@pytest.mark.fault_matrix
def test_restore_check_with_plain_optimizer_and_replicated_bytes_at_home(
        tmp_path: Path) -> None:
    """Plain optimizer, one rank per node: every optimizer byte is replicated too, so the
    buddies hold little more than RNG, data position and CRC tables. The restore check
    at iteration 5 rebuilds every rank from its buddy's partial copy completed from the
    rank's own slot (checked against the table); a corrupted transfer at iteration 3 is
    still never committed; the run ends bit-identical to one without DeadPool."""
    from deadpool_megatron.testing.jobs import run_job

    plain = [a for a in GPT_3D_ARGS if a != "--use-distributed-optimizer"]
    args = [*plain, "--train-iters", str(ITERS)]
    base = run_job(8, args, tmp_path / "base", timeout_s=300)
    assert base.ok, base.describe()
    events = tmp_path / "events"
    run = run_job(8, [*args, "--deadpool", "--deadpool-ranks-per-node", "1",
                      "--deadpool-verify-restore-at", "5",
                      "--deadpool-inject", "corrupt rank=2 iter=3 phase=snapshot",
                      "--deadpool-events", str(events)], tmp_path / "deadpool", timeout_s=300)
    assert run.ok, run.describe()
    assert "restore check: every rank now runs on a fresh model" in run.output
    assert run.fingerprint == base.fingerprint
    ev = load_events(events)
    setup = [e for e in ev if e["event"] == "snapshot_setup"]
    assert len(setup) >= 8 and all(e["skips_replicated"] for e in setup)
    assert all(e["sent_bytes"] < e["shard_bytes"] // 10 for e in setup), setup
    torn = [e for e in ev if e["event"] == "snapshot_not_committed"]
    assert {(e["rank"], e["iteration"]) for e in torn} == {(2, 3), (3, 3)}, torn
