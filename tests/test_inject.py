"""Issue 14, part 1: deadpool-inject puts faults into a running job from outside, through its
authenticated control plane; each job still ends with the failure-free fingerprint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import GPT_3D_ARGS, REPO
from deadpool_megatron.control import keys
from deadpool_megatron.faults.cli import IN_RECOVERY_S, chaos_plan
from deadpool_megatron.faults.injector import FaultInjector
from deadpool_megatron.faults.remote import InjectRequest, JobShape, delivery_of, resolve
from deadpool_megatron.faults.spec import FaultSpecError, parse_fault
from deadpool_megatron.testing.jobs import JobResult, job_token_file, run_hosts, run_launched

ITERS = 8
ENV = {"DEADPOOL_CONTROL_TIMEOUT_S": "90"}
INJECT = [sys.executable, str(REPO / "tools" / "inject_fault.py")]
SHAPE = JobShape(world=8, tp=2, pp=2, cp=1, ranks_per_node=4)


# -- pure parts ----------------------------------------------------------------------------
def test_specs_without_iteration_or_phase_are_for_running_jobs_only() -> None:
    assert str(parse_fault("kill tp=1,pp=0,dp=1", when_required=False)) == "kill dp=1,pp=0,tp=1"
    with pytest.raises(FaultSpecError, match="iter= and phase= are required"):
        parse_fault("kill rank=1")
    assert delivery_of(parse_fault("kill rank=1", when_required=False)) == "signal"
    assert delivery_of(parse_fault("hang node=1", when_required=False)) == "signal"
    assert delivery_of(parse_fault("raise rank=1", when_required=False)) == "worker"
    assert delivery_of(parse_fault("kill rank=1 iter=3", when_required=False)) == "worker"


def test_targets_resolve_against_the_current_members() -> None:
    members = {r: f"w{r}" for r in range(8)}
    members[5] = "s0.1"  # a spare took rank 5 in an earlier hot swap
    hit = resolve(parse_fault("kill node=1", when_required=False), SHAPE, members)
    assert [members[r] for r in hit] == ["w4", "s0.1", "w6", "w7"]
    with pytest.raises(FaultSpecError, match="rank 8 >= world size 8"):
        resolve(parse_fault("kill rank=8", when_required=False), SHAPE, members)
    with pytest.raises(FaultSpecError, match="tp=2 but the tp size is 2"):
        resolve(parse_fault("kill tp=2", when_required=False), SHAPE, members)
    with pytest.raises(FaultSpecError, match="no node 2"):
        resolve(parse_fault("kill node=2", when_required=False), SHAPE, members)


def test_chaos_plan_is_reproducible_from_its_seed() -> None:
    plan = chaos_plan(7, mtbf_s=5.0, duration_s=100.0, actions=["kill", "raise"], world=8,
                      max_faults=6)
    assert plan == chaos_plan(7, 5.0, 100.0, ["kill", "raise"], 8, 6)
    assert plan != chaos_plan(8, 5.0, 100.0, ["kill", "raise"], 8, 6)
    assert len(plan) == 6 and all(p.at_s <= 100 for p in plan)
    assert [p.at_s for p in plan] == sorted(p.at_s for p in plan)
    nodes = chaos_plan(3, 5.0, 100.0, ["kill", "node"], 8, 12, ranks_per_node=4)
    specs = {p.spec.rsplit("=", 1)[0] for p in nodes}
    assert specs == {"kill rank", "kill node"}, nodes
    assert {int(p.spec.rsplit("=", 1)[1]) for p in nodes if "node" in p.spec} <= {0, 1}
    # Faults during the last one's recovery: drawn only when asked (a seed's plan is
    # otherwise unchanged), never the first, within IN_RECOVERY_S of the declaration.
    during = chaos_plan(7, 5.0, 100.0, ["kill", "raise"], 8, 6, in_recovery=0.5)
    assert [p.spec for p in during[:2]] == [p.spec for p in plan[:2]]
    assert plan[0].in_recovery_s is None and during[0].in_recovery_s is None
    drawn = [p.in_recovery_s for p in chaos_plan(1, 5.0, 1e6, ["kill"], 8, 200,
                                                 in_recovery=0.5)]
    assert 60 < sum(d is not None for d in drawn) < 140
    assert all(0 <= d <= IN_RECOVERY_S for d in drawn if d is not None)
    assert all(p.in_recovery_s is None for p in plan)


def test_the_next_chaos_fault_waits_until_the_last_one_is_declared(monkeypatch) -> None:
    """A killed rank's signal reaches it through its launcher, and a hang is found only at
    the progress timeout: meanwhile the job goes on for iterations, which must not count as
    quiet ones after a recovery (chaos soak seed 156: a spare killed, its successor's buddy
    killed 0.2 s later while it restored from it, 2 iterations after the first kill was
    injected). The wait ends at a newer generation, or a restart's new epoch."""
    from deadpool_megatron.faults import job as job_module
    from deadpool_megatron.faults.job import InjectError, JobControl, Progress

    monkeypatch.setattr(job_module, "POLL_S", 0.0)
    members = {r: f"w{r}" for r in range(8)}
    injected = Progress(1, 6, members, epoch=0)
    seen = iter([Progress(1, 8, members), Progress(1, 9, members), Progress(2, 6, members),
                 Progress(2, 7, members)])
    job = JobControl.__new__(JobControl)
    job.where = "h:1"
    job.progress = lambda: next(seen)  # type: ignore[method-assign]
    assert job.wait_taken(injected, timeout_s=5) == Progress(2, 6, members)
    restarted = iter([Progress(1, 9, members), Progress(0, 4, members, epoch=1)])
    job.progress = lambda: next(restarted)  # type: ignore[method-assign]
    assert job.wait_taken(injected, timeout_s=5).epoch == 1
    job.progress = lambda: Progress(1, 40, members)  # type: ignore[method-assign]
    with pytest.raises(InjectError, match="declared no generation after 1"):
        job.wait_taken(injected, timeout_s=0.05)


class _Store:
    """The two calls the worker side makes, over a dict (values already verified)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.counters: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.counters[key] = self.counters.get(key, 0) + amount
        return self.counters[key]

    def check(self, keys_: list[str]) -> bool:
        return all(k in self.values for k in keys_)

    def read(self, key: str) -> bytes | None:
        return self.values.get(key)

    def request(self, rid: int, spec: str, workers: list[str], delivery: str = "worker",
                bump: bool = True) -> None:
        self.values[keys.inject_request(rid)] = InjectRequest(
            rid, spec, [0], workers, 0, delivery).to_json().encode()
        if bump:
            self.add(keys.INJECTS, 1)


def test_a_worker_arms_the_requests_aimed_at_it_at_an_iteration_boundary(
        tmp_path: Path) -> None:
    from deadpool_megatron.faults.nudge import nudge

    store = _Store()
    injector = FaultInjector([], rank=3)
    word = str(tmp_path / "w.nudge")
    injector.follow_control(store, "s0.1", nudge_path=word)
    store.request(1, "raise rank=3", ["s0.1"])
    store.request(2, "raise rank=4 iter=9", ["w4"])  # another worker's
    store.request(3, "kill rank=3", ["s0.1"], delivery="signal")  # its launcher's
    store.request(4, "raise rank=3 iter=2", ["s0.1"])  # already past at iteration 5
    assert injector.pending("forward", 5) is None  # nothing read yet: no round trip here
    injector.learn(5)  # the first boundary reads, nudged or not
    assert str(injector.pending("forward", 5)) == "raise rank=3"
    assert injector.pending("snapshot", 5) is None  # only the training loop's phases
    with pytest.raises(RuntimeError, match="injected fault on rank 3"):
        injector.fire("forward", 5)
    assert injector.pending("forward", 6) is None  # fired once
    # Without a nudge from the launcher the store is not read at all.
    store.request(5, "raise rank=3 iter=7 phase=forward", ["s0.1"])
    calls: list[str] = []
    store.add = lambda key, amount, add=store.add: calls.append(key) or add(key, amount)
    injector.learn(6)
    assert calls == [] and injector.pending("forward", 7) is None
    assert nudge(word)  # what the worker's launcher does
    injector.learn(6)
    assert calls == [keys.INJECTS]
    assert str(injector.pending("forward", 7)) == "raise rank=3 iter=7 phase=forward"
    # An id handed out but not yet written stops the read there; the worker looks
    # again at each boundary (no new nudge needed) until it is written.
    store.add(keys.INJECTS, 1)
    store.request(7, "raise rank=3 iter=8 phase=backward", ["s0.1"])
    nudge(word)
    injector.learn(7)
    assert injector.pending("backward", 8) is None
    store.request(6, "raise rank=3 iter=8 phase=forward", ["s0.1"], bump=False)
    injector.learn(7)
    assert str(injector.pending("forward", 8)) == "raise rank=3 iter=8 phase=forward"
    assert str(injector.pending("backward", 8)) == "raise rank=3 iter=8 phase=backward"
    calls.clear()
    injector.learn(8)  # all read: quiet again
    assert calls == []


@pytest.mark.parametrize("thread", ["main", "training"])
def test_a_training_thread_asks_the_store_nothing_per_iteration(tmp_path: Path,
                                                                thread: str) -> None:
    """Counted: 100 iteration boundaries of a training thread (the main thread, or one of
    its own, as training/elastic.py runs it), the injector set up from that thread: one
    store request at the first boundary, then one per nudge only."""
    import threading

    from deadpool_megatron.faults.nudge import nudge

    store = _Store()
    calls: list[str] = []
    store.add = lambda key, amount, add=store.add: calls.append(key) or add(key, amount)
    word = str(tmp_path / "w.nudge")
    seen: list[int] = []

    def train() -> None:
        injector = FaultInjector([], rank=0)
        injector.follow_control(store, "w0", nudge_path=word)
        for iteration in range(1, 101):
            if iteration == 50:
                nudge(word)
            injector.hooks().on_iteration_start(_State(iteration - 1))
        seen.append(len(calls))

    if thread == "main":
        train()
    else:
        t = threading.Thread(target=train)
        t.start()
        t.join(30)
    assert seen == [2]


class _State:
    def __init__(self, iteration: int) -> None:
        self.iteration = iteration


def test_an_id_never_written_is_skipped_after_the_grace() -> None:
    """A deadpool-inject that died between taking an id and writing its request must not
    stall the readers for good."""
    from deadpool_megatron.faults.remote import RequestReader

    store = _Store()
    reader = RequestReader()
    store.add(keys.INJECTS, 1)  # id 1 handed out, never written
    store.request(2, "raise rank=3 iter=9", ["w3"])
    assert reader.read(store, now=100.0) == [] and reader.waiting
    assert reader.read(store, now=100.0 + RequestReader.GAP_GRACE_S - 0.1) == []
    later = reader.read(store, now=100.0 + RequestReader.GAP_GRACE_S)
    assert [r.id for r in later] == [2] and not reader.waiting and reader.seen == 2


# -- real jobs -----------------------------------------------------------------------------
class Outside:
    """deadpool-inject runs, as operators would type them, each in a terminal of its own,
    all started once the job's control plane is up; results in the commands' order.
    `armed` is set once every command has ended or, with --after-iteration, connected and
    begun to wait (it says so): a job held until then (run_hosts' `hold`) cannot outrun
    them, however slowly they start."""

    def __init__(self, token: Path, commands: list[list[str]]) -> None:
        self.token, self.commands = token, commands
        self.results: list[subprocess.CompletedProcess] = []
        self.armed = threading.Event()

    def __call__(self, port: int) -> None:
        procs = [subprocess.Popen(
            [*INJECT, "--master-port", str(port), "--timeout", "20", "--wait-timeout", "200",
             *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
            for command in self.commands]
        errors: list[list[str]] = [[] for _ in procs]
        ready = [threading.Event() for _ in procs]

        def read(i: int) -> None:
            for line in procs[i].stderr:
                errors[i].append(line)
                if "waiting for iteration" in line:
                    ready[i].set()
            ready[i].set()  # ended

        readers = [threading.Thread(target=read, args=(i,), daemon=True)
                   for i in range(len(procs))]
        for t in readers:
            t.start()
        try:
            for r in ready:
                r.wait(240)
            self.armed.set()
            outs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.wait()
            for t in readers:
                t.join(10)
        self.results = [subprocess.CompletedProcess(p.args, p.returncode, out, "".join(err))
                        for p, out, err in zip(procs, outs, errors)]

    def describe(self) -> str:
        return "\n".join(f"rc={r.returncode} {r.args[2:]}\n{r.stdout}{r.stderr[-2000:]}"
                         for r in self.results)


def _events(prefix: Path) -> list[dict]:
    out = []
    for path in prefix.parent.glob(prefix.name + ".rank*"):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(out, key=lambda e: e["t"])


def _args(events: Path, extra: list[str] = ()) -> list[str]:
    return [*GPT_3D_ARGS, "--train-iters", str(ITERS), "--deadpool", "--deadpool-events",
            str(events), *extra]


def _single_host(tmp: Path, commands: list[list[str]], spares: int = 2
                 ) -> tuple[JobResult, Outside, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    token = job_token_file(tmp)
    outside = Outside(token, [["--job-token-file", str(token), *c] for c in commands])
    events = tmp / "events"
    launch = ["--nproc-per-node", "8", "--spares", str(spares), "--logical-nodes", "2",
              "--job-token-file", str(token)]
    run = run_launched(launch, _args(events), tmp, timeout_s=400, env=ENV, on_port=outside)
    return run, outside, events


@pytest.mark.multiproc
def test_inject_by_rank_into_a_running_job(tmp_path: Path, failure_free_8: JobResult) -> None:
    """SIGKILL of rank 5's worker by its launcher (host 1's), at once, once iteration 3 is
    reached; the bad requests, while the job starts, are refused with what to change, and
    change nothing. Host 1 is launched once the requests are in (bad ones answered, the
    kill waiting for iteration 3): the job cannot end before they come, however slowly
    they start on a loaded machine."""
    wrong = tmp_path / "wrong.token"
    wrong.write_text("0" * 64)
    wrong.chmod(0o600)
    tmp = tmp_path / "job"
    tmp.mkdir()
    token = job_token_file(tmp)
    outside = Outside(token, [["--job-token-file", str(token), *c] for c in [
        ["kill rank=9"],
        ["kill colour=1"],
        ["kill rank=1", "--job-token-file", str(wrong)],
        ["--after-iteration", "3", "kill rank=5"],
    ]])
    events = tmp / "events"
    common = ["--nproc-per-node", "4", "--job-token-file", str(token)]
    run = run_hosts([[*common, "--spares", "2"], [*common, "--spares", "0"]], _args(events),
                    tmp, timeout_s=400, env=ENV, on_port=outside, hold=outside.armed)
    assert run.returncodes == [0, 0] and not run.timed_out, run.describe()
    r = outside.results
    assert [x.returncode for x in r] == [2, 2, 2, 0], outside.describe()
    assert "rank 9 >= world size 8" in r[0].stderr
    assert "unknown key 'colour'" in r[1].stderr
    assert "wrong job token" in r[2].stderr
    done = json.loads(r[3].stdout)
    assert done["workers"] == ["w5"] and done["delivery"] == "signal", done
    assert run.ok, run.describe()
    assert run.fingerprint == failure_free_8.fingerprint, run.describe()
    assert "deadpool-inject #1: SIGKILL to worker w5" in run.output, run.describe()
    ev = _events(events)
    requested = [e for e in ev if e["event"] == "fault_requested"]
    assert [(e["fault"], e["workers"]) for e in requested] == [("kill rank=5", ["w5"])]
    failed = [e for e in ev if e["event"] == "failure_detected"]
    assert [(e["rank"], e["returncode"]) for e in failed] == [(5, -9)], json.dumps(failed)


@pytest.mark.multiproc
def test_inject_by_coordinate_at_an_iteration(tmp_path: Path,
                                              failure_free_8: JobResult) -> None:
    """An exception raised in the training code of the rank at tp=1,pp=0,dp=1, in the
    backward pass of iteration 6, armed from outside at an iteration boundary."""
    run, outside, events = _single_host(tmp_path / "job", [
        ["--after-iteration", "2", "raise tp=1,pp=0,dp=1 iter=6 phase=backward"]])
    assert [x.returncode for x in outside.results] == [0], outside.describe()
    request = json.loads(outside.results[0].stdout)
    assert request["delivery"] == "worker" and len(request["ranks"]) == 1, request
    rank = request["ranks"][0]
    assert run.ok, run.describe()
    # Its launcher nudged it; the worker read the store then (not every iteration).
    assert f"deadpool-inject #1: nudging worker w{rank}" in run.output, run.describe()
    assert run.fingerprint == failure_free_8.fingerprint, run.describe()
    ev = _events(events)
    fired = [e for e in ev if e["event"] == "fault_injected"]
    assert [(e["rank"], e["iteration"], e["phase"]) for e in fired] == \
        [(rank, 6, "backward")], fired
    failed = [e for e in ev if e["event"] == "failure_detected"]
    assert [e["rank"] for e in failed] == [rank] and "InjectedFault" in failed[0]["reason"]


@pytest.mark.multiproc
def test_inject_by_node_into_a_two_host_job(tmp_path: Path,
                                            failure_free_8: JobResult) -> None:
    """Two launchers, as on two hosts: every worker of node 1 is SIGKILLed by host 1's
    launcher; host 0's spares take the four places."""
    tmp = tmp_path / "job"
    tmp.mkdir()
    token = job_token_file(tmp)
    outside = Outside(token, [["--job-token-file", str(token), "--after-iteration", "3",
                               "kill node=1"]])
    events = tmp / "events"
    common = ["--nproc-per-node", "4", "--job-token-file", str(token)]
    run = run_hosts([[*common, "--spares", "4"], [*common, "--spares", "0"]], _args(events),
                    tmp, timeout_s=400, env=ENV, on_port=outside)
    assert [x.returncode for x in outside.results] == [0], outside.describe()
    assert json.loads(outside.results[0].stdout)["workers"] == ["w4", "w5", "w6", "w7"]
    assert run.returncodes == [0, 0] and not run.timed_out, run.describe()
    assert run.fingerprint == failure_free_8.fingerprint, run.describe()
    spares = {e["rank"] for e in _events(events)
              if e["event"] == "recovered" and e["from_buddy"]}
    assert spares == {4, 5, 6, 7}, run.describe()


def test_bad_command_lines_say_what_to_change(capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from deadpool_megatron.control.auth import ENV
    from deadpool_megatron.faults.cli import main

    monkeypatch.delenv(ENV, raising=False)
    assert main(["--master-port", "1", "kill rank=1"]) == 2
    assert "launch the job with deadpool-launch --job-token-file F" in capsys.readouterr().err
    assert main(["--master-port", "1", "corrupt rank=1 phase=snapshot"]) == 2
    assert "use it with --deadpool-inject at launch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--master-port", "1", "--chaos", "kill rank=1"])
    assert "exactly one of" in capsys.readouterr().err


def test_job_control_against_a_store_as_host_0_writes_it(tmp_path: Path) -> None:
    """deadpool-inject's side against a real TCPStore laid out as host 0's launcher lays it
    out: targets resolve to the current members, signals go to the workers' launchers, a
    wrong token is refused and a job still starting is waited for (bounded)."""
    from deadpool_megatron.control.auth import SignedStore, new_token
    from deadpool_megatron.control.sockets import store_server
    from deadpool_megatron.faults.job import InjectError, JobControl
    from deadpool_megatron.faults.remote import RequestReader

    server = store_server("127.0.0.1", 0, timeout_s=30)
    token = new_token()
    with pytest.raises(InjectError, match="no launch/layout after 1 s"):
        JobControl("127.0.0.1", server.port, token, timeout_s=1)
    root = SignedStore(server, token)
    root.set(keys.LAYOUT, json.dumps({"nnodes": 1, "nproc_per_node": 8,
                                      "control_only": False, "shape": SHAPE.__dict__}))
    root.set(keys.EPOCH, "0")
    epoch = SignedStore(server, token, keys.epoch_prefix(0))
    members = {r: f"w{r}" for r in range(8)}
    members[5] = "s0.0"
    epoch.set(keys.members(1), json.dumps(members))
    epoch.set(keys.GENERATION, "1")
    views = {w: {"g": 1, "it": 4 + (r == 3)} for r, w in members.items()}
    epoch.set(keys.host_report(0), json.dumps({"seq": 1, "workers": views}))
    with pytest.raises(InjectError, match="wrong job token"):
        JobControl("127.0.0.1", server.port, new_token(), timeout_s=5)
    job = JobControl("127.0.0.1", server.port, token, timeout_s=5)
    assert job.wait_for(4, timeout_s=1).iteration == 4
    with pytest.raises(InjectError, match="did not reach iteration 5"):
        job.wait_for(5, timeout_s=0.2)
    request, _ = job.inject("hang tp=1,pp=1,dp=0")  # rank 5 (tp fastest, then dp): a spare
    assert (request.ranks, request.workers, request.delivery) == ([5], ["s0.0"], "signal")
    assert json.loads(epoch.read(keys.signal_request("s0.0"))) == {"id": 1, "action": "hang"}
    assert epoch.add(keys.KILLS, 0) == 1
    request, _ = job.inject("raise node=0 iter=9")
    assert request.workers == ["w0", "w1", "w2", "w3"] and request.delivery == "worker"
    reader = RequestReader()
    requests = reader.read(epoch)
    assert reader.seen == 2 and [r.spec for r in requests] == ["hang tp=1,pp=1,dp=0",
                                                        "raise node=0 iter=9"]
    with pytest.raises(FaultSpecError, match="rank 8 >= world size 8"):
        job.inject("kill rank=8")
    # A forged request (no job token) is skipped by every reader.
    epoch.store.set(keys.inject_request(3), b"{}")  # the prefixed view, unsigned
    epoch.add(keys.INJECTS, 1)
    assert reader.read(epoch) == [] and reader.seen == 3


def _state_within(pid: int, wanted: Callable[[str], bool], timeout_s: float) -> bool:
    """Whether the process's state satisfies `wanted` within the bound (a signal takes
    effect when the kernel next schedules the process)."""
    from deadpool_megatron.launch.workers import _os_state

    deadline = time.monotonic() + timeout_s
    while not wanted(_os_state(pid)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_launcher_sends_the_signal_asked_for_once(tmp_path: Path) -> None:
    """The worker's own launcher carries out a signal request: SIGSTOP here (hang), once
    per request id, and nothing for a forged one."""
    from deadpool_megatron.control.auth import SignedStore, new_token
    from deadpool_megatron.control.sockets import store_server
    from deadpool_megatron.launch.config import LaunchConfig
    from deadpool_megatron.launch.workers import LocalWorkers, _os_state

    server = store_server("127.0.0.1", 0, timeout_s=30)
    store = SignedStore(server, new_token(), keys.epoch_prefix(0))
    workers = LocalWorkers(LaunchConfig(nproc_per_node=2), ["sleep", "60"], store,
                           server.port, 2, 0, str(tmp_path), follow_s=0.0)  # every poll
    proc = subprocess.Popen(["sleep", "60"])
    workers.procs = {"w1": proc}
    try:
        store.store.set(keys.signal_request("w1"), json.dumps({"id": 1, "action": "kill"}))
        store.add(keys.KILLS, 1)
        workers.poll()  # forged (unsigned): ignored
        assert proc.poll() is None and _os_state(proc.pid) != "T"
        store.set(keys.signal_request("w1"), json.dumps({"id": 2, "action": "hang"}))
        store.add(keys.KILLS, 1)
        workers.poll()
        assert _state_within(proc.pid, lambda s: s == "T", 30.0)  # stopped (loaded machine)
        os.kill(proc.pid, signal.SIGCONT)
        assert _state_within(proc.pid, lambda s: s != "T", 30.0)
        store.add(keys.KILLS, 1)
        workers.poll()  # the same request again: not resent
        time.sleep(0.2)
        assert _os_state(proc.pid) != "T"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        workers.stop(0)


def test_a_launcher_nudges_a_worker_only_once_it_looks(tmp_path: Path) -> None:
    """A worker-delivered request (raise, iter=, phase=) reaches its worker as a nudge from
    its launcher (its counter moves); a worker that has not made its counter yet (still
    starting) is not nudged: it reads the store at its first boundary anyway."""
    from deadpool_megatron.control.auth import SignedStore, new_token
    from deadpool_megatron.control.sockets import store_server
    from deadpool_megatron.launch.config import LaunchConfig
    from deadpool_megatron.faults.nudge import NudgeWord
    from deadpool_megatron.launch.workers import LocalWorkers

    server = store_server("127.0.0.1", 0, timeout_s=30)
    store = SignedStore(server, new_token(), keys.epoch_prefix(0))
    workers = LocalWorkers(LaunchConfig(nproc_per_node=2), ["sleep", "60"], store,
                           server.port, 2, 0, str(tmp_path), follow_s=0.0)  # every poll

    looking = subprocess.Popen(["sleep", "60"])
    plain = subprocess.Popen(["sleep", "60"])
    workers.procs = {"w0": looking, "w1": plain}
    word = NudgeWord(workers.nudge_path("w0"))  # w0 has started training: it looks
    try:
        for rid, worker in ((1, "w1"), (2, "w0")):
            store.set(keys.inject_request(rid), InjectRequest(
                rid, "raise rank=0 iter=9", [0], [worker], 0, "worker").to_json())
            store.add(keys.INJECTS, 1)
        store.add(keys.KILLS, 1)
        workers.poll()
        assert word.moved() and not word.moved()
        assert not os.path.exists(workers.nudge_path("w1"))  # nothing made for it
        workers.poll()  # nothing new: no second nudge
        assert not word.moved()
    finally:
        for proc in (looking, plain):
            proc.kill()
            proc.wait(timeout=10)
        workers.stop(0)
