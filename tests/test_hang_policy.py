"""control/hang.find_hung: which stalled ranks are replaced."""

from __future__ import annotations

from deadpool_megatron.control.hang import WorkerView, find_hung
from deadpool_megatron.control.progress import IN_COLLECTIVE, RUNNING


def _view(worker: str, stalled_s: float, where: int = IN_COLLECTIVE, os_state: str = "S",
          counter: int = 100, generation: int = 0) -> WorkerView:
    return WorkerView(worker=worker, generation=generation, counter=counter,
                      stalled_s=stalled_s,
                      timeout_s=5.0, monitor_age_s=0.1, where=where, long_operation=False,
                      os_state=os_state, phase="backward")


def test_a_stopped_rank_is_the_culprit_and_its_victims_stay() -> None:
    verdict = find_hung([_view("w0", 5.2), _view("w5", 5.1, where=RUNNING, os_state="T")])
    assert verdict is not None and verdict.certain
    assert verdict.culprits == ("w5",) and verdict.stalled == ("w0", "w5")


def test_victims_that_stalled_first_are_not_guessed_while_a_stopped_rank_catches_up() -> None:
    # A first pipeline stage stamped last before the stopped last stage's backward: it
    # crosses the timeout moments before the rank it waits for.
    views = [_view("w0", 5.01, counter=90), _view("w1", 5.01, counter=90),
             _view("w5", 4.99, where=RUNNING, os_state="T")]
    assert find_hung(views) is None
    later = [_view("w0", 5.11, counter=90), _view("w1", 5.11, counter=90),
             _view("w5", 5.09, where=RUNNING, os_state="T")]
    verdict = find_hung(later)
    assert verdict is not None and verdict.certain and verdict.culprits == ("w5",)


def test_without_any_rank_that_may_be_the_culprit_the_furthest_behind_are_guessed() -> None:
    views = [_view("w0", 5.2, counter=90), _view("w1", 5.2, counter=95),
             _view("w2", 1.0)]
    verdict = find_hung(views)
    assert verdict is not None and not verdict.certain and verdict.culprits == ("w0",)


def test_victims_that_stalled_first_are_not_guessed_while_a_blocked_rank_catches_up() -> None:
    """CI: rank 3 blocked in its backward moments after its tensor-parallel peer (w2) and a
    last-stage rank (w6) stamped; they crossed the timeout first and were guessed (a buddy
    pair, so hot-swap was impossible), rank 3, seen outside any collective, left alone."""
    views = [_view("w2", 5.01, counter=90), _view("w6", 5.01, counter=90),
             _view("w3", 4.9, counter=91, where=RUNNING), _view("w7", 4.95, counter=91)]
    assert find_hung(views) is None
    later = [_view("w2", 5.12, counter=90), _view("w6", 5.12, counter=90),
             _view("w3", 5.01, counter=91, where=RUNNING), _view("w7", 5.06, counter=91)]
    verdict = find_hung(later)
    assert verdict is not None and verdict.certain and verdict.culprits == ("w3",)
    # A rank that finished (phase "done") runs no more: it holds no guess back.
    done = WorkerView(worker="w3", generation=0, counter=91, stalled_s=9.0, timeout_s=5.0,
                      monitor_age_s=0.1, where=RUNNING, long_operation=False, os_state="S",
                      phase="done")
    verdict = find_hung([*views[:2], done])
    assert verdict is not None and not verdict.certain and verdict.culprits == ("w2", "w6")


def test_no_guess_while_a_member_builds_but_a_certain_culprit_still_goes() -> None:
    # Survivors waiting in a rendezvous for a spare that builds alone (a long operation,
    # of which hosts send no view): they stall with no culprit, and none is guessed.
    waiting = [_view("w0", 5.2, counter=90), _view("w1", 5.2, counter=95)]
    assert find_hung(waiting, someone_building=True) is None
    assert find_hung(waiting) is not None  # without the build: the furthest behind, a guess
    stopped = [*waiting, _view("w5", 5.1, where=RUNNING, os_state="T")]
    verdict = find_hung(stopped, someone_building=True)
    assert verdict is not None and verdict.certain and verdict.culprits == ("w5",)


def test_ranks_stuck_forming_a_superseded_generation_are_the_culprits() -> None:
    """Chaos soak seed 21: rank 3 was stopped while generation 1 formed; generation 2
    replaced it, but ranks 4, 5 and 7 stayed in generation 1's group creation (gloo waits
    for a peer that was to connect, with no socket the declaration could cut). The ranks
    in generation 2's rendezvous wait for them: the stuck ones are replaced, not rank 2, the
    one with the fewest stamps among the waiting (which left every spare to guesses)."""
    views = [_view("w0", 1.0, counter=60, generation=2),
             _view("w2", 5.2, counter=40, generation=2),
             _view("w4", 5.2, counter=70, generation=1),
             _view("w5", 5.2, counter=71, generation=1),
             _view("w7", 5.2, counter=72, generation=1)]
    verdict = find_hung(views)
    assert verdict is not None and verdict.certain
    assert verdict.culprits == ("w4", "w5", "w7")
    assert "still in generation 1" in verdict.why["w4"]
    # Only the stalled ones: a rank of the older generation still moving is left alone.
    moving = views[:4] + [_view("w7", 1.0, counter=72, generation=1)]
    verdict = find_hung(moving)
    assert verdict is not None and verdict.culprits == ("w4", "w5")


def test_a_monitor_silent_alone_on_its_host_is_a_call_holding_the_gil() -> None:
    """Overloaded host (a second job on its 2 cores): two survivors waiting in a collective
    for a spare that hangs as it builds had their monitors silent 5 s together, were taken
    for two calls holding the GIL and replaced; hot-swap then ended. A monitor silent
    alone on its host still makes a certain culprit."""
    def silent(worker: str, mon: float, others: float) -> WorkerView:
        return WorkerView(worker=worker, generation=1, counter=50, stalled_s=5.2,
                          timeout_s=5.0, monitor_age_s=mon, where=IN_COLLECTIVE,
                          long_operation=False, os_state="S", phase="recovery",
                          host_monitor_age_s=others)

    together = [silent("w2", 5.0, 5.1), silent("w3", 5.1, 5.0)]
    assert not any(v.frozen for v in together)
    assert find_hung(together, someone_building=True) is None  # they wait for the spare
    alone = [silent("w2", 5.0, 0.1), silent("w3", 0.1, 5.0)]
    verdict = find_hung(alone)
    assert verdict is not None and verdict.certain and verdict.culprits == ("w2",)
    assert "runs no Python for 5 s" in verdict.why["w2"]


def test_a_hosts_report_carries_the_oldest_other_monitor_of_each_suspect() -> None:
    from deadpool_megatron.launch.workers import host_report

    def view(mon: float) -> dict:
        return {"g": 1, "c": 50, "it": 3, "ph": "backward", "st": 0.5, "mon": mon,
                "wh": IN_COLLECTIVE, "long": False, "to": 20.0, "itn": 0.2, "os": "S",
                "su": 300.0}

    report = host_report(7, {"w0": view(0.1), "w1": view(5.0), "w2": view(0.3)})
    assert list(report["workers"]) == ["w1"]  # the only one unable to run Python
    assert report["workers"]["w1"]["mo"] == 0.3
    report = host_report(8, {"w0": view(4.0), "w1": view(5.0)})
    assert report["workers"]["w0"]["mo"] == 5.0 and report["workers"]["w1"]["mo"] == 4.0
    assert host_report(9, {"w1": view(5.0)})["workers"]["w1"]["mo"] == 0.0  # alone

def test_a_rank_stopped_inside_a_long_operation_is_still_found() -> None:
    """A long operation (a build, a save, the groups' agreement) exempts slow work from the
    timeout; a process the OS stopped does none (chaos soak seed 21: stopped inside the
    agreement, found only when its 10 s budget ran out)."""
    def in_long_op(worker: str, os_state: str) -> WorkerView:
        return WorkerView(worker=worker, generation=1, counter=50, stalled_s=5.2,
                          timeout_s=5.0, monitor_age_s=0.1, where=RUNNING,
                          long_operation=True, os_state=os_state, phase="recovery")

    verdict = find_hung([_view("w0", 5.2, generation=1), in_long_op("w3", "T")])
    assert verdict is not None and verdict.certain and verdict.culprits == ("w3",)
    verdict = find_hung([_view("w0", 5.2, generation=1), in_long_op("w3", "S")])
    assert verdict is not None and "w3" not in verdict.stalled  # working: not timed


def test_before_the_first_iteration_a_stopped_process_gets_the_floor_not_the_allowance() -> None:
    """The 300 s before the first iteration are for slow imports and a slow first build,
    which a stopped process is not doing: with them, its peers waited out generation 0's
    120 s rendezvous for it and the epoch was lost (chaos soak seed 208). A configured
    --deadpool-progress-timeout stays what it says."""
    from deadpool_megatron.control.hang import BEFORE_FIRST_ITERATION_S, FLOOR_S, hang_timeout

    assert hang_timeout(0.0, 0.0) == BEFORE_FIRST_ITERATION_S
    assert hang_timeout(0.0, 0.0, stopped=True) == FLOOR_S < 120.0
    assert hang_timeout(3.0, 0.0, stopped=True) == 3.0
    assert hang_timeout(0.0, 4.0, stopped=True) == hang_timeout(0.0, 4.0) == 40.0


def test_the_start_up_allowance_is_the_configured_startup_timeout() -> None:
    """--deadpool-startup-timeout replaces the 300 s before the first iteration (a rank hung
    while it builds found sooner where builds are quick); a stopped process still gets the
    floor, or the allowance where that is shorter; after an iteration it no longer counts."""
    from deadpool_megatron.control.hang import FLOOR_S, hang_timeout

    assert hang_timeout(0.0, 0.0, startup_s=45.0) == 45.0
    assert hang_timeout(0.0, 0.0, stopped=True, startup_s=45.0) == FLOOR_S
    assert hang_timeout(0.0, 0.0, stopped=True, startup_s=8.0) == 8.0
    assert hang_timeout(3.0, 0.0, startup_s=45.0) == 3.0
    assert hang_timeout(0.0, 4.0, startup_s=8.0) == 40.0


def test_a_worker_stopped_before_it_made_its_progress_record_is_reported(tmp_path) -> None:
    """Its host sees a worker started as a rank, stopped by a signal, with no progress
    record yet (stopped moments after its start): it reports it, stalled since its start,
    and host 0 finds it the certain culprit. A waiting spare without a record is not
    reported (host 0 judges members only)."""
    import signal
    import subprocess
    import time

    from deadpool_megatron.control.hang import FLOOR_S, hang_timeout
    from deadpool_megatron.launch.config import LaunchConfig
    from deadpool_megatron.launch.workers import LocalWorkers

    workers = LocalWorkers(LaunchConfig(), ["python"], store=None, master_port=0,
                           ranks_per_node=1, epoch=0, log_dir=str(tmp_path),
                           startup_timeout_s=60.0)
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for proc in procs:
            proc.send_signal(signal.SIGSTOP)
        workers.procs = {"w0": procs[0], "s0.0": procs[1]}
        workers._ranked["w0"] = time.monotonic_ns() - int(25e9)  # started 25 s ago
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and workers.views().get("w0", {}).get("os") != "T":
            time.sleep(0.05)  # the signal is delivered
        views = workers.views()
        assert list(views) == ["w0"], views
        v = views["w0"]
        assert v["os"] == "T" and v["c"] == 0 and v["g"] == 0 and v["st"] >= 25, v
        assert v["su"] == 60.0, v
        timeout = hang_timeout(v["to"], v["itn"], stopped=True, startup_s=v["su"])
        assert timeout == FLOOR_S
        verdict = find_hung([_view("w1", 25.0), WorkerView(
            worker="w0", generation=0, counter=0, stalled_s=v["st"], timeout_s=timeout,
            monitor_age_s=v["mon"], where=v["wh"], long_operation=v["long"],
            os_state=v["os"])])
        assert verdict is not None and verdict.certain and verdict.culprits == ("w0",)
    finally:
        workers.procs = dict(enumerate(procs))
        workers.stop(timeout_s=5)  # stopped ones are killed at once; the records' directory


def test_a_worker_missing_at_the_flush_prints_its_stacks_before_it_is_stopped(
        tmp_path) -> None:
    """The launcher's flush waits --flush-timeout for every member's report; those that
    never report are asked for their stacks (SIGUSR1, faulthandler) before they are
    stopped, so their logs say where they were. Workers already gone are skipped."""
    import subprocess
    import sys
    import time

    from deadpool_megatron.launch.config import LaunchConfig
    from deadpool_megatron.launch.workers import LocalWorkers

    workers = LocalWorkers(LaunchConfig(), ["python"], store=None, master_port=0,
                           ranks_per_node=1, epoch=0, log_dir=str(tmp_path))
    code = ("import faulthandler, signal, sys, threading\n"
            "faulthandler.register(signal.SIGUSR1, file=sys.stdout)\n"
            "print('ready', flush=True)\n"
            "def blocked_at_the_flush():\n"
            "    threading.Event().wait(60)\n"
            "blocked_at_the_flush()\n")
    log = tmp_path / "w7.log"
    with log.open("w") as out:
        blocked = subprocess.Popen([sys.executable, "-c", code], stdout=out)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        gone.wait(timeout=30)
        deadline = time.monotonic() + 30
        while "ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        workers.procs = {"w7": blocked, "w3": gone}
        assert workers.dump_stacks(["w7", "w3", "w9"]) == ["w7"]
        deadline = time.monotonic() + 10
        while "blocked_at_the_flush" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "blocked_at_the_flush" in log.read_text(), log.read_text()
    finally:
        blocked.kill()
        blocked.wait(timeout=30)
        workers.procs = {}
        workers.stop(timeout_s=5)
