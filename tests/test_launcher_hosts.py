"""deadpool-launch across hosts, one launcher per simulated host on this machine (as under
Slurm), with a stand-in worker that trains nothing, so the control plane is tested fast."""

from __future__ import annotations

import contextlib
import re
import threading
from pathlib import Path
from typing import Iterator

import pytest

from deadpool_megatron.launch.config import LaunchConfig, LaunchError
from deadpool_megatron.testing.jobs import REPO, JobResult, job_token_file, run_hosts

pytestmark = pytest.mark.multiproc
WORKER = REPO / "deadpool_megatron" / "testing" / "control_worker.py"
HB = ["--heartbeat-timeout", "3"]


def _hosts(tmp: Path, name: str, spares: list[int], worker_args: list[str],
           **kw) -> JobResult:
    hosts = [["--nproc-per-node", "2", "--spares", str(n), *HB] for n in spares]
    return run_hosts(hosts, ["--deadpool", *worker_args], tmp / name, timeout_s=120,
                     script=WORKER, **kw)


@contextlib.contextmanager
def _cue_when(log: Path, text: str, cue: Path) -> Iterator[None]:
    """Create `cue` (control_worker.py --cue) once `text` appears in `log`."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            if log.exists() and text in log.read_text(errors="replace"):
                cue.touch()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(10)


def _declarations(run: JobResult) -> list[str]:
    return re.findall(r"generation \d+: ranks .* take their places", run.logs[0])


def test_two_hosts_run_and_end_together(tmp_path: Path) -> None:
    run = _hosts(tmp_path, "ok", [1, 1], ["--seconds", "2"])
    assert run.returncodes == [0, 0] and not run.timed_out, run.describe()
    for host, ranks in ((0, (0, 1)), (1, (2, 3))):
        for rank in ranks:
            assert f"worker w{rank} done" in run.logs[host], run.describe()
    assert not _declarations(run)


def test_exit_on_another_host_is_reported_and_replaced_away_from_its_buddy(
        tmp_path: Path) -> None:
    # World 4 on 2 hosts: rank 3's buddy and ward are rank 1, on host 0, so the spare taking
    # rank 3 must be host 1's, though host 0's spare comes first in launch order.
    run = _hosts(tmp_path, "exit", [1, 1], ["--seconds", "6", "--fail-rank", "3"])
    assert run.returncodes == [0, 0] and not run.timed_out, run.describe()
    assert "rank 3 (worker w3 on host 1) exited with 1" in run.logs[0], run.describe()
    assert _declarations(run) == ["generation 1: ranks [3] failed; spares {3: 's1.0'} take "
                                  "their places"], run.describe()
    assert "worker s1.0 took rank 3 in generation 1" in run.logs[1]


def test_lost_host_is_declared_once_and_replaced_by_the_other_hosts_spares(
        tmp_path: Path) -> None:
    """Host 1's launcher and workers are SIGKILLed together: only its silence tells."""
    run = _hosts(tmp_path, "lost", [2, 0], ["--seconds", "9"],
                 kill_host=(1, "is rank 3", 1.0))
    assert run.returncodes[0] == 0 and run.returncodes[1] == -9, run.describe()
    assert "was lost with its host" in run.logs[0], run.describe()
    (declared,) = _declarations(run)
    assert declared.startswith("generation 1: ranks [2, 3] failed"), run.describe()
    assert "worker w0 done" in run.logs[0] and "worker w1 done" in run.logs[0]


def test_a_standby_host_runs_spares_only_and_takes_a_lost_hosts_ranks(tmp_path: Path) -> None:
    """--standby-hosts 1 of 3: host 2 trains nothing (world 4 on hosts 0 and 1); when host 1
    is SIGKILLed with its launcher, host 2's spares take its ranks on their own devices."""
    standby = ["--standby-hosts", "1", *HB]
    hosts = [["--nproc-per-node", "2", "--spares", "0", *standby],
             ["--nproc-per-node", "2", "--spares", "0", *standby],
             ["--nproc-per-node", "2", "--spares", "2", *standby]]
    run = run_hosts(hosts, ["--deadpool", "--seconds", "9"], tmp_path, timeout_s=120,
                    script=WORKER, kill_host=(1, "is rank 3", 1.0))
    assert run.returncodes[0] == 0 and run.returncodes[1] == -9, run.describe()
    assert run.returncodes[2] == 0 and not run.timed_out, run.describe()
    assert "4 workers on 2 host(s) (2 per host, 2 failure domains of 2 ranks) and 1 " \
           "standby host(s)" in run.logs[0], run.describe()
    assert "host 2, epoch 0: a standby host: no rank and 2 warm spares started" in run.logs[2]
    assert _declarations(run) == ["generation 1: ranks [2, 3] failed; spares {2: 's2.0', 3: "
                                  "'s2.1'} take their places"], run.describe()
    for spare, rank, slot in (("s2.0", 2, 0), ("s2.1", 3, 1)):
        assert f"worker {spare} took rank {rank} in generation 1" in run.logs[2]
        assert f"worker {spare} device slot {slot}" in run.logs[2], run.describe()
    assert "worker w0 done" in run.logs[0] and "worker w1 done" in run.logs[0]


def test_a_lost_hosts_launcher_started_again_rejoins_with_spares(tmp_path: Path) -> None:
    """Host 1 is SIGKILLed with its launcher and started again at once (a supervisor's
    restart, a repaired machine): the new launcher's return is the old one's loss (the
    heartbeat timeout, 60 s, never runs out), its spare joins the pool before the
    declaration and takes rank 2 (rank 2's buddy copy is on host 0), a spare of host 0
    rank 3; rank 0 then fails (cued once host 0 logged the rejoin) and takes the last."""
    cue = tmp_path / "cue"
    with _cue_when(tmp_path / "host0.log", "host 1 rejoined", cue):
        # Heartbeats would tell the loss only after 60 s: the restart must tell it.
        hosts = [["--nproc-per-node", "2", "--spares", "2", "--heartbeat-timeout", "60"],
                 ["--nproc-per-node", "2", "--spares", "0"]]
        run = run_hosts(hosts, ["--deadpool", "--seconds", "3", "--fail-rank", "0",
                                "--fail-after", "0.5", "--cue", str(cue)], tmp_path,
                        timeout_s=120, script=WORKER, kill_host=(1, "is rank 3", 0.5),
                        restart_host=["--nproc-per-node", "2", "--spares", "1"])
    assert run.returncodes == [0, 0] and not run.timed_out, run.describe()
    assert "host 1 rejoined (its launcher's start 1): spares ['s1.r1.0'] join the pool" \
        in run.logs[0], run.describe()
    assert "rejoined a running epoch as a standby host (spares hold its ranks) and 1 warm " \
           "spares started" in run.logs[1], run.describe()
    assert "rank 2 (worker w2 on host 1) was lost with its host: its launcher was started " \
           "again (start 1)" in run.logs[0], run.describe()
    assert _declarations(run) == [
        "generation 1: ranks [2, 3] failed; spares {2: 's1.r1.0', 3: 's0.0'} take their places",
        "generation 2: ranks [0] failed; spares {0: 's0.1'} take their places"], run.describe()
    assert "worker s1.r1.0 took rank 2 in generation 1" in run.logs[1], run.describe()


def test_a_failed_workers_device_slot_gets_a_new_spare(tmp_path: Path) -> None:
    """--spare-respawns 1: rank 0 fails and takes the only spare; once that is declared its
    slot (0) gets a new spare, which host 0 adds to the pool; rank 1 then fails (cued by
    that) and takes it. The budget spent, rank 1's slot gets none."""
    cue = tmp_path / "cue"
    with _cue_when(tmp_path / "launcher.log", "started new spares ['s0.1']", cue):
        run = run_hosts([["--nproc-per-node", "2", "--logical-nodes", "2", "--spares", "1",
                          "--spare-respawns", "1", *HB]],
                        ["--deadpool", "--seconds", "60", "--fail-rank", "0", "--fail-after",
                         "0.5", "--cue", str(cue), "--cue-rank", "1"], tmp_path,
                        timeout_s=120, script=WORKER)
    assert run.returncodes == [0] and not run.timed_out, run.describe()
    out = run.logs[0]
    assert _declarations(run) == [
        "generation 1: ranks [0] failed; spares {0: 's0.0'} take their places",
        "generation 2: ranks [1] failed; spares {1: 's0.1'} take their places"], run.describe()
    assert "new spare s0.1 started in device slot 0, the slot of failed worker w0" in out
    assert "worker s0.1 device slot 0" in out and "worker s0.1 took rank 1 in generation 2" \
        in out, run.describe()
    assert "s0.2" not in out, run.describe()


def test_without_deadpool_a_restarted_host_waits_for_the_next_epoch(tmp_path: Path) -> None:
    """Without --deadpool no spare can be started: host 1's launcher, started again after
    its loss, waits; the lost host restarts the job from --save (epoch 1), where it runs
    its ranks again."""
    hosts = [["--nproc-per-node", "2", "--spares", "0", *HB],
             ["--nproc-per-node", "2", "--spares", "0"]]
    run = run_hosts(hosts, ["--seconds", "4", "--save", str(tmp_path / "ckpt")], tmp_path,
                    timeout_s=120, script=WORKER, kill_host=(1, "is rank 3", 0.5),
                    restart_host=["--nproc-per-node", "2", "--spares", "0"])
    assert run.returncodes == [0, 0] and not run.timed_out, run.describe()
    assert "host 1 rejoins epoch 0, which cannot take it back without --deadpool" \
        in run.logs[1], run.describe()
    for rank in (2, 3):
        assert f"worker w{rank} is rank {rank} in epoch 1" in run.logs[1], run.describe()


def test_standby_hosts_hold_no_rank() -> None:
    cfg = LaunchConfig(nproc_per_node=4, nnodes=4, standby_hosts=2, node_rank=3, spares=3,
                       master_port=1, job_token_file="t")
    cfg.validate()
    assert cfg.world_size == 8 and cfg.standby and list(cfg.local_ranks()) == []
    assert list(cfg.training_hosts) == [0, 1] and list(cfg.worker_hosts) == [0, 1, 2, 3]
    assert cfg.host_of("w7") == 1 and cfg.host_of("s3.2") == 3
    cfg.check_devices("nccl", 3)  # three spares, three GPUs: no training rank needs one
    with pytest.raises(LaunchError, match=re.escape("use --spares 2")):
        cfg.check_devices("nccl", 2)


def test_checkpoint_fallback_restarts_every_host(tmp_path: Path) -> None:
    run = _hosts(tmp_path, "fallback", [0, 0],
                 ["--seconds", "3", "--fail-rank", "2", "--save", str(tmp_path / "ckpt")])
    assert run.returncodes == [0, 0] and not run.timed_out, run.describe()
    assert "ranks [2] failed but only 0 spare(s) remain" in run.logs[0], run.describe()
    assert "falling back to the newest durable state" in run.logs[0]
    for rank in (2, 3):
        assert f"worker w{rank} is rank {rank} in epoch 1" in run.logs[1], run.describe()


def test_a_host_that_never_joins_ends_the_job_with_its_name(tmp_path: Path) -> None:
    (tmp_path / "alone").mkdir()
    token = str(job_token_file(tmp_path / "alone"))
    hosts = [["--nproc-per-node", "2", "--nnodes", "2", "--join-timeout", "3",
              "--job-token-file", token, *HB]]
    run = run_hosts(hosts, ["--deadpool", "--seconds", "30"], tmp_path / "alone",
                    timeout_s=120, script=WORKER)
    assert run.returncodes == [1] and not run.timed_out, run.describe()
    assert "ending the job: hosts [1] never joined within --join-timeout 3 s" in run.logs[0]


@pytest.mark.parametrize("kw, expected", [
    ({"node_rank": 1, "nnodes": 2}, "--node-rank > 0 needs the --master-port of host 0"),
    ({"node_rank": 2, "nnodes": 2, "master_port": 29500}, "--node-rank 2 must be in"),
    ({"nproc_per_node": 6, "logical_nodes": 4}, "--logical-nodes 4 must divide"),
    ({"spares": -1}, "--spares must be non-negative"),
    ({"nnodes": 2}, "--nnodes 2 needs --job-token-file"),
    ({"standby_hosts": -1}, "--standby-hosts must be non-negative"),
    ({"spare_respawns": -1}, "--spare-respawns must be non-negative"),
    ({"nnodes": 2, "standby_hosts": 2, "job_token_file": "t"},
     "--standby-hosts 2 leaves no training host of --nnodes 2: at most 1 standby host(s)"),
    ({"nnodes": 3, "standby_hosts": 1, "node_rank": 2, "master_port": 1, "job_token_file": "t"},
     "host 2 is a standby host (--standby-hosts 1: the last 1 of --nnodes 3) and runs spares "
     "only: give it --spares 1 or more"),
])
def test_bad_launch_flags_say_what_to_change(kw: dict, expected: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(expected)):
        LaunchConfig(**kw).validate()


def test_bad_launch_flag_exits_2_with_the_message(capsys: pytest.CaptureFixture) -> None:
    from deadpool_megatron.launch.launcher import main

    with pytest.raises(SystemExit) as end:
        main(["--nnodes", "2", "--node-rank", "1", "train.py"])
    assert end.value.code == 2
    assert "--node-rank > 0 needs the --master-port of host 0" in capsys.readouterr().err


def test_an_unresolvable_master_addr_is_refused_naming_the_flag(
        capsys: pytest.CaptureFixture) -> None:
    """A name the resolver does not know failed inside torch's store with the resolver's
    words only; the launcher now says which flag to change before it starts anything."""
    from deadpool_megatron.launch.launcher import main

    with pytest.raises(SystemExit) as end:
        main(["--master-addr", "no-such-host.invalid", "train.py"])
    assert end.value.code == 2
    assert "--master-addr 'no-such-host.invalid' does not resolve on this host" in \
        capsys.readouterr().err


def test_a_worker_told_an_unresolvable_master_addr_names_it() -> None:
    from deadpool_megatron.control.client import ControlClient

    with pytest.raises(RuntimeError, match="MASTER_ADDR 'no-such-host.invalid' does not "
                                           "resolve on this host"):
        ControlClient("no-such-host.invalid", 1, "w0", 1.0, "token")
