"""A control plane off the training hosts: host 0 runs the store and the coordinator only
(deadpool-launch --control-only), so the first training host can be lost like any other."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import GPT_3D_ARGS
from deadpool_megatron.control import keys
from deadpool_megatron.launch.config import LaunchConfig
from deadpool_megatron.testing.jobs import PORT, JobResult, run_hosts

pytestmark = pytest.mark.multiproc


def test_ranks_live_on_the_training_hosts_only() -> None:
    cfg = LaunchConfig(nproc_per_node=4, nnodes=3, control_only=True, job_token_file="t")
    cfg.validate()
    assert cfg.world_size == 8 and list(cfg.ranks_of(0)) == []
    assert list(cfg.ranks_of(1)) == [0, 1, 2, 3] and list(cfg.ranks_of(2)) == [4, 5, 6, 7]
    assert cfg.host_of("w0") == 1 and cfg.host_of("w7") == 2 and cfg.host_of("s2.1") == 2


def _forge_heartbeats(log: Path, stop: threading.Event) -> None:
    """Unauthenticated reports of host 1, meant to keep it 'alive' after its death."""
    port = None
    while port is None and not stop.is_set():
        found = PORT.search(log.read_text(errors="replace")) if log.exists() else None
        port = int(found.group(1)) if found else None
        stop.wait(0.05)
    if port is None:
        return
    store = dist.PrefixStore(keys.epoch_prefix(0), dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)))
    seq = 10**6
    while not stop.is_set():
        seq += 1
        try:
            store.set(keys.host_report(1), json.dumps({"seq": seq, "workers": {}}))
        except dist.DistError:
            return
        stop.wait(0.3)


@pytest.mark.fault_matrix
def test_the_first_training_host_lost_as_a_whole_is_recovered(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """Host 0 control-only, host 3 a standby host (spares only); host 1 (ranks 0-3, rank 0
    included) SIGKILLed with its launcher at iteration 3 while a foreign process forges its
    heartbeats; host 3's spares take ranks 0-3 from their buddies' copies on host 2 and the
    run ends bit-exact."""
    events = tmp_path / "events"
    args = [*GPT_3D_ARGS, "--train-iters", "8", "--deadpool", "--deadpool-events",
            str(events)]
    common = ["--nproc-per-node", "4", "--standby-hosts", "1", "--heartbeat-timeout", "6"]
    stop = threading.Event()
    forger = threading.Thread(target=_forge_heartbeats, args=(tmp_path / "host0.log", stop),
                              daemon=True)
    forger.start()
    try:
        run = run_hosts([[*common, "--control-only"], [*common, "--spares", "0"],
                         [*common, "--spares", "0"], [*common, "--spares", "4"]], args,
                        tmp_path, timeout_s=500,
                        env={"DEADPOOL_CONTROL_TIMEOUT_S": "90"},
                        kill_host=(1, "iteration        3/", 0.0))
    finally:
        stop.set()
        forger.join(10)
    assert run.returncodes[0] == run.returncodes[2] == run.returncodes[3] == 0, run.describe()
    assert not run.timed_out, run.describe()
    assert run.fingerprint == failure_free_8.fingerprint, run.describe()
    out = run.logs[0]
    assert "and 1 standby host(s)" in out and "(control only)" in out
    assert "spares {0: 's3.0', 1: 's3.1', 2: 's3.2', 3: 's3.3'} take their places" in out, \
        run.describe()
    assert "ignored a write to ep0/dp/host/1 that does not carry the job token" in out
    found = [json.loads(line) for p in tmp_path.glob("events.rank*")
             for line in p.read_text().splitlines()]
    declared = [e["failed_ranks"] for e in found if e["event"] == "generation_declared"]
    assert declared == [[0, 1, 2, 3]], run.describe()
    assert {e["how"] for e in found if e["event"] == "failure_detected"} == {"host"}


@pytest.mark.fault_matrix
def test_losing_the_control_plane_flushes_and_a_relaunch_resumes(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    """The control-only host dies at iteration 4: no declaration can come, so the workers
    keep nothing running blind: they write their newest snapshots to --save, commit the
    complete one among themselves and exit; a relaunch with --load resumes bit-exact."""
    save = tmp_path / "ckpt"
    args = [*GPT_3D_ARGS, "--train-iters", "8", "--deadpool", "--save", str(save),
            "--save-interval", "100"]
    common = ["--nproc-per-node", "8", "--logical-nodes", "2", "--heartbeat-timeout", "30"]
    first = run_hosts([[*common, "--control-only"], common], args, tmp_path / "first",
                      timeout_s=400, env={"DEADPOOL_CONTROL_TIMEOUT_S": "90"},
                      kill_host=(0, "iteration        4/", 0.0))
    assert not first.timed_out and first.returncodes[1] != 0, first.describe()
    assert "lost the control plane" in first.logs[1], first.describe()
    from deadpool_megatron.snapshot import flush

    flushed = flush.latest(str(save))
    assert flushed is not None and flushed >= 4, first.describe()
    second = run_hosts([["--nproc-per-node", "8", "--logical-nodes", "2"]],
                       [*args, "--load", str(save)], tmp_path / "second", timeout_s=400,
                       env={"DEADPOOL_CONTROL_TIMEOUT_S": "90"})
    assert second.ok, second.describe()
    assert f"loaded the snapshot of iteration {flushed} flushed" in second.logs[0]
    assert second.fingerprint == failure_free_8.fingerprint, second.describe()
