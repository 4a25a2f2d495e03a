"""The job token: a value that does not carry it changes nothing, on any side of the control
plane, and a malformed one crashes nobody."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import GPT_3D_ARGS
from deadpool_megatron.control import keys
from deadpool_megatron.control.auth import (SignedStore, TokenError, read_token_file, sign,
                                            verify)
from deadpool_megatron.launch.config import LaunchConfig
from deadpool_megatron.launch.coordinator import Coordinator
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.testing.jobs import MEGATRON_GPT, REPO, JobResult, run_launched

TOKEN = "k" * 32


def test_a_value_verifies_only_under_its_own_key_and_token() -> None:
    value = sign(TOKEN, "ep0/dp/exit/w1", b"0")
    assert verify(TOKEN, "ep0/dp/exit/w1", value) == b"0"
    assert verify(TOKEN, "ep0/dp/exit/w2", value) is None  # copied to another worker's key
    assert verify(TOKEN, "ep1/dp/exit/w1", value) is None  # replayed in the next epoch
    assert verify("x" * 32, "ep0/dp/exit/w1", value) is None
    assert verify(TOKEN, "ep0/dp/exit/w1", value[:-1] + b"1") is None
    for junk in (b"", b"0", b"." * 65, b"0" * 64 + b".0"):
        assert verify(TOKEN, "ep0/dp/exit/w1", junk) is None


def test_a_secret_key_name_is_computed_only_with_the_token() -> None:
    """The rendezvous' ready key carries a tag of the job token: another token, epoch or
    generation names another key, and the plain name is not it."""
    store = dist.HashStore()
    name = SignedStore(store, TOKEN, keys.epoch_prefix(0)).secret_name(keys.ready(1))
    assert name.startswith(keys.ready(1) + "/") and len(name) > len(keys.ready(1)) + 30
    assert name == SignedStore(store, TOKEN, keys.epoch_prefix(0)).secret_name(keys.ready(1))
    assert name != SignedStore(store, "x" * 32, keys.epoch_prefix(0)).secret_name(keys.ready(1))
    assert name != SignedStore(store, TOKEN, keys.epoch_prefix(1)).secret_name(keys.ready(1))
    assert name != SignedStore(store, TOKEN, keys.epoch_prefix(0)).secret_name(keys.ready(2))


def test_token_files_that_others_may_read_or_too_short_are_refused(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.write_text(TOKEN + "\n")
    good.chmod(0o600)
    assert read_token_file(str(good)) == TOKEN
    shared = tmp_path / "shared"
    shared.write_text(TOKEN)
    shared.chmod(0o644)
    with pytest.raises(TokenError, match="chmod 600"):
        read_token_file(str(shared))
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(TokenError, match="at least 16"):
        read_token_file(str(short))
    with pytest.raises(TokenError, match="cannot read"):
        read_token_file(str(tmp_path / "missing"))


def _coordinator(store: dist.Store, tmp_path: Path) -> Coordinator:
    cfg = LaunchConfig(nproc_per_node=4, spares=1, failure_window=0.0, heartbeat_timeout=5)
    signed = SignedStore(store, TOKEN, keys.epoch_prefix(0))
    coordinator = Coordinator(cfg, signed, ranks_per_node=2, allow_same_node=False,
                              events=EventLog(str(tmp_path / "events"), rank=-1))
    coordinator.open()
    signed.set(keys.node_spares(0), json.dumps(["s0.0"]))
    return coordinator


def test_the_coordinator_ignores_forged_and_malformed_reports(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Forged exit reports (unsigned, or signed under another key), malformed signed ones,
    a forged and a malformed host report, a malformed spare list: nothing is declared,
    nothing raises, each rejection is logged; a genuine exit report still declares."""
    store = dist.HashStore()
    coordinator = _coordinator(store, tmp_path)
    raw = dist.PrefixStore(keys.epoch_prefix(0), store)
    signed = SignedStore(store, TOKEN, keys.epoch_prefix(0))
    raw.set(keys.exit_report("w1"), "1")  # no token
    raw.set(keys.exit_report("w2"), sign(TOKEN, "ep0/" + keys.exit_report("w3"), b"1"))
    signed.set(keys.exit_report("w3"), "one")  # authentic but malformed
    raw.set(keys.host_report(0), '{"seq": 1, "workers": {}}')
    raw.set(keys.SHUTDOWN, "done")
    raw.set(keys.done("w0"), "1")
    raw.add(keys.EXITS, 3)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            coordinator.tick(time.monotonic())
            time.sleep(0.01)
        signed.set(keys.host_report(0), "{not json")
        coordinator._next_scan = 0.0
        coordinator.tick(time.monotonic())
        signed.set(keys.host_report(0), json.dumps({"seq": 2, "workers": {"w0": {"g": "x"}}}))
        coordinator._next_scan = 0.0
        coordinator.tick(time.monotonic())
    assert coordinator.generation == 0 and not coordinator.failed and not coordinator.gone
    text = caplog.text
    for key in ("exit/w1", "exit/w2", "host/0"):
        assert re.search(rf"ignored a write to ep0/dp/{key} that does not carry the job token",
                         text), text
    assert "ignored a malformed exit report of w3" in text
    assert "ignored a malformed report of host 0" in text
    assert "ignored a malformed view of w0 from host 0" in text
    signed.set(keys.exit_report("w1"), "1")
    raw.add(keys.EXITS, 1)
    coordinator.tick(time.monotonic())
    coordinator.tick(time.monotonic())
    assert coordinator.generation == 1, "a genuine exit report must still be acted on"


WATCH = r"""
import os, sys, time
from deadpool_megatron.control import keys
from deadpool_megatron.control.auth import SignedStore
from deadpool_megatron.control.client import ControlClient, JobShutdown
from deadpool_megatron.control.sockets import store_server
import torch.distributed as dist

server = store_server("127.0.0.1", 0, timeout_s=10)
host0 = SignedStore(server, "k" * 32, keys.epoch_prefix(0))
forger = dist.PrefixStore(keys.epoch_prefix(0), server)
from deadpool_megatron.control.declaration import Declaration
host0.set(keys.declared(0), Declaration(0, 1).to_json())
forged = Declaration(1, 1, {0: "intruder"}, {0: "intruder"}).to_json()
forger.set(keys.declared(1), forged)  # a forged declaration, before the client
ctl = ControlClient("127.0.0.1", server.port, "w0", timeout_s=10, token="k" * 32)
assert ctl._latest == 0, ctl._latest
seen = []
ctl.watch(0, seen.append)
forger.set(keys.SHUTDOWN, "done")
ctl.check_shutdown()  # a forged shutdown is no shutdown
time.sleep(0.3)
assert seen == [], seen
host0.set(keys.declared(1), Declaration(1, 1).to_json())  # the real one replaces it
deadline = time.monotonic() + 5
while not seen and time.monotonic() < deadline:
    time.sleep(0.01)
assert seen == [1] and ctl.members(1) == {0: "w0"}, seen
host0.set(keys.SHUTDOWN, "done")
try:
    ctl.check_shutdown()
    raise AssertionError("a genuine shutdown was ignored")
except JobShutdown:
    pass
print("ok", flush=True)
os._exit(0)
"""


def test_a_worker_acts_only_on_declarations_and_shutdowns_with_the_token() -> None:
    run = subprocess.run([sys.executable, "-c", WATCH], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


PORT = re.compile(r"control plane on [^:\s]+:(\d+)")


def _forge(log: Path, stop: threading.Event, done: list[str]) -> None:
    """A foreign process's writes, without the token, while the job runs."""
    deadline = time.monotonic() + 300
    port = None
    while port is None and not stop.is_set() and time.monotonic() < deadline:
        found = PORT.search(log.read_text(errors="replace")) if log.exists() else None
        port = int(found.group(1)) if found else None
        time.sleep(0.05)
    if port is None:
        return
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    epoch = dist.PrefixStore(keys.epoch_prefix(0), store)
    epoch.set(keys.members(1), json.dumps({str(r): "intruder" for r in range(8)}))
    epoch.set(keys.replaced(1), json.dumps({"0": "intruder"}))
    epoch.set(keys.declared(1), json.dumps({"g": 1, "world": 8, "replaced": {"0": "intruder"},
                                            "swapped": {"0": "intruder"}, "flush": False}))
    epoch.set(keys.GENERATION, "7")
    epoch.set(keys.ready(1), "1")
    epoch.set(keys.kill_request("w0"), "forged")
    epoch.add(keys.KILLS, 1)
    epoch.set(keys.exit_report("w3"), "0")  # a live rank "finished"
    epoch.set(keys.exit_report("w2"), "0" * 64 + ".garbage")
    epoch.add(keys.EXITS, 1)
    store.set(keys.END, "0")
    done.append("declaration")
    while not stop.is_set():  # forged heartbeats of host 0, and a shutdown, all along
        try:
            epoch.set(keys.host_report(0), json.dumps({"seq": 10**9, "workers": {}}))
            epoch.set(keys.SHUTDOWN, "done")
        except dist.DistError:
            return  # the job ended: its store is gone
        stop.wait(0.5)


@pytest.mark.multiproc
@pytest.mark.fault_matrix
def test_a_process_without_the_token_changes_nothing(tmp_path: Path,
                                                     failure_free_8: JobResult) -> None:
    """A forged declaration, shutdown, end, kill request, exit reports and host heartbeats,
    written by a process that reached the port: rank 5 is still killed and hot-swapped by
    the real declaration, and the job ends bit-exact, with the rejections logged."""
    stop, done = threading.Event(), []
    forger = threading.Thread(target=_forge, args=(tmp_path / "launcher.log", stop, done),
                              daemon=True)
    forger.start()
    try:
        args = [*GPT_3D_ARGS, "--train-iters", "8", "--deadpool",
                "--deadpool-inject", "kill rank=5 iter=6 phase=backward"]
        run = run_launched(["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "2"],
                           args, tmp_path, timeout_s=400,
                           env={"DEADPOOL_CONTROL_TIMEOUT_S": "90"})
    finally:
        stop.set()
        forger.join(10)
    assert done, "the forger never reached the control plane"
    assert run.returncodes == [0] and not run.timed_out, run.describe()
    assert run.fingerprint == failure_free_8.fingerprint, run.describe()
    out = run.logs[0]
    assert "generation 1: ranks [5] failed" in out, run.describe()
    assert "generation 2" not in out and "killing worker w0" not in out
    for key in ("ep0/dp/exit/w3", "ep0/dp/exit/w2", "ep0/dp/host/0", "ep0/dp/gen1/declared",
                "ep0/dp/shutdown"):
        assert f"ignored a write to {key} that does not carry the job token" in out, key


def test_the_coordinator_guesses_no_hung_rank_while_a_member_builds(tmp_path: Path) -> None:
    """Host reports as a recovery makes them: two ranks stalled in a wait for peers, and a
    third inside a declared long operation (a spare building alone), of which the report
    names the worker but sends no view. No rank is replaced while it builds, nor for the
    waiters' timeout after (they waited for it: chaos soak --loop megatron guessed a spare
    hung the moment the survivors' save ended); then the furthest behind is (a guess)."""
    store = dist.HashStore()
    coordinator = _coordinator(store, tmp_path)
    signed = SignedStore(store, TOKEN, keys.epoch_prefix(0))

    def view(counter: int) -> dict:
        return {"g": 0, "c": counter, "it": 3, "ph": "recovery", "st": 9.0, "mon": 0.1,
                "wh": 2, "long": False, "to": 3.0, "itn": 0.3, "os": "S",
                "su": 300.0}

    stalled = {"w0": view(90), "w1": view(95)}
    start = time.monotonic()
    for seq, building, at in ((1, ["w2"], 0.0), (2, ["w2"], 0.5), (3, [], 1.0), (4, [], 3.4),
                              (5, [], 3.6)):
        signed.set(keys.host_report(0), json.dumps({"seq": seq, "workers": stalled,
                                                    "it": {}, "long": building}))
        coordinator._next_scan = 0.0
        coordinator.tick(start + at)
        if at < 3.5:  # building, or done 3 s (their timeout) ago at most
            assert not coordinator.failed and not coordinator.gone, seq
    assert "w0" in coordinator.gone and "w1" not in coordinator.gone


def _ended_by_an_exit(tmp_path: Path, worker: str, reason: str, returncode: int) -> tuple:
    """`worker` reports `reason` and exits with `returncode`; host 0's coordinator ticks
    until the epoch ends: (the EpochEnded, the coordinator)."""
    from deadpool_megatron.launch.coordinator import EpochEnded

    store = dist.HashStore()
    coordinator = _coordinator(store, tmp_path)
    signed = SignedStore(store, TOKEN, keys.epoch_prefix(0))
    signed.set(keys.failure_report(worker), reason)
    signed.set(keys.exit_report(worker), str(returncode))
    dist.PrefixStore(keys.epoch_prefix(0), store).add(keys.EXITS, 1)
    with pytest.raises(EpochEnded) as ended:
        for _ in range(3):
            coordinator.tick(time.monotonic())
    return ended.value, coordinator


def test_a_rank_that_found_no_recovery_ends_the_epoch_with_its_reason(tmp_path: Path) -> None:
    """Chaos soak seeds 30 and 44: a rank and its buddy lost together; every rank computes
    the same plan, finds no snapshot it can stand on, and exits (RecoveryImpossible). Host
    0 counted those exits as failures and ended with "the in-memory shards of ranks [0, 1,
    ..., 7] are lost", blaming all eight; it ends with the ranks' own reason instead."""
    why = "RecoveryImpossible: no snapshot iteration is held by the buddies of ranks [0, 2]"
    ended, _ = _ended_by_an_exit(tmp_path, "w1", why, 3)
    assert ended.returncode == 3 and ended.flush
    assert why in str(ended) and "in-memory shards" not in str(ended)


def test_a_worker_that_refused_the_configuration_ends_the_job_with_its_reason(
        tmp_path: Path) -> None:
    """A flag hot-swap does not cover (--context-parallel-size 2) is refused by every
    worker at its start, spares too. Host 0 took each refusal for a rank's failure, gave
    the spares away one by one, and ended with "start the job with more --spares"; it ends
    at once with the workers' reason instead, and flushes nothing (nothing was trained)."""
    from deadpool_megatron.control.policy import CONFIG_REFUSED_RC

    why = "HotSwapUnsupported: hot-swap is not verified with --context-parallel-size 2"
    ended, coordinator = _ended_by_an_exit(tmp_path, "w1", why, CONFIG_REFUSED_RC)
    assert ended.returncode == CONFIG_REFUSED_RC and not ended.flush
    assert why in str(ended) and "spare" not in str(ended)
    assert coordinator.generation == 0 and coordinator.spares == ["s0.0"]  # none given away


@pytest.mark.multiproc
def test_a_refused_flag_ends_the_launched_job_at_once_with_the_reason(tmp_path: Path) -> None:
    """The whole path of a refusal (no injector: Megatron's parser, the patched hook, the
    worker's exit code through the preloaded child, the exit report, host 0): a job with a
    flag hot-swap refuses ends with CONFIG_REFUSED_RC and the reason, no spare taken."""
    from deadpool_megatron.control.policy import CONFIG_REFUSED_RC

    args = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
            "4", "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size",
            "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
            "--context-parallel-size", "2", "--deadpool"]
    run = run_launched(["--nproc-per-node", "2", "--spares", "1", "--logical-nodes", "2"],
                       args, tmp_path, timeout_s=240, script=MEGATRON_GPT)
    assert run.returncodes == [CONFIG_REFUSED_RC] and not run.timed_out, run.describe()
    out = run.logs[0]
    assert "ending the job: the workers refused the job's configuration: HotSwapUnsupported: " \
           "hot-swap is not verified with --context-parallel-size 2" in out, run.describe()
    assert "take their places" not in out and "more --spares" not in out, run.describe()
