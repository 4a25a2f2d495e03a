"""Nothing a worker started stays after it: when it leaves with os._exit (training/driver.py
exit_now), nor when it is killed (launch/orphans.py); nor what a killed launcher made; nor,
without --deadpool, the workers of a failed job."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from deadpool_megatron.testing.jobs import REPO, run_hosts
from deadpool_megatron.testing.processes import running

LEAVE = """
import multiprocessing, sys
from deadpool_megatron.training.driver import exit_now

if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").Manager().Queue()  # as Megatron's writer
    print(*[c.pid for c in multiprocessing.active_children()], flush=True)
    exit_now(3)
"""


def test_a_worker_leaving_kills_its_multiprocessing_children(tmp_path) -> None:
    """Megatron's checkpoint writer keeps a spawned Manager server; os._exit runs no
    finalizer that would end it: exit_now kills it first (before, every worker of an epoch
    that ended left one behind, orphaned, for good)."""
    script = tmp_path / "leave.py"
    script.write_text(LEAVE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = tmp_path / "out"
    with out.open("w") as sink:  # not a pipe: a child left behind would hold it open
        done = subprocess.run([sys.executable, str(script)], stdout=sink,
                              stderr=subprocess.STDOUT, timeout=120, env=env)
    children = [int(word) for word in out.read_text().split() if word.isdigit()]
    assert done.returncode == 3 and children, out.read_text()
    deadline = time.monotonic() + 10
    while running(children) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = running(children)
    for pid in left:  # a failing run leaves nothing behind either
        psutil.Process(pid).kill()
    assert not left, f"still running after the worker left: {left}"


HOLD = """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(1)
    sys.exit(1)
print("waiting", flush=True)
time.sleep(120)  # as a rank waits in a collective for the one that failed
"""


def test_without_deadpool_the_other_workers_of_a_failed_rank_are_stopped_at_once(
        tmp_path: Path) -> None:
    """A job without --deadpool (torchrun's way: no hot-swap, nothing to flush): rank 1
    fails, and its peers, which would wait in their collectives, are stopped with SIGTERM at
    once, not after --shutdown-timeout (here longer than the test's deadline)."""
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    run = run_hosts([["--nproc-per-node", "3", "--shutdown-timeout", "300"]], [],
                    tmp_path / "job", timeout_s=90, script=script)
    assert not run.timed_out and run.returncodes[0] != 0, run.describe()
    assert "rank 1 (worker w1 on host 0) exited with 1" in run.logs[0], run.describe()
    assert "stopping 2 worker(s) still running (w0, w2): SIGTERM" in run.logs[0], \
        run.describe()


def test_what_a_killed_worker_started_is_stopped_by_its_launcher(tmp_path: Path) -> None:
    """Every worker of a stand-in job starts a child that would outlive it; rank 1 is
    SIGKILLed (as a hang's culprit, --deadpool-inject kill or the OOM killer do), so it
    cannot stop its own. Its launcher adopted the orphan, stops it and says so; the spare
    takes rank 1, and when the job ends no child of any worker is left."""
    worker = REPO / "deadpool_megatron" / "testing" / "control_worker.py"
    run = run_hosts([["--nproc-per-node", "2", "--logical-nodes", "2", "--spares", "1",
                      "--heartbeat-timeout", "3"]],
                    ["--deadpool", "--seconds", "4", "--fail-rank", "1", "--fail-by",
                     "sigkill", "--child"], tmp_path, timeout_s=120, script=worker)
    children = {name: int(pid) for name, pid in
                re.findall(r"worker (\S+) started child pid (\d+)", run.logs[0])}
    left = running(list(children.values()))
    for pid in left:  # a failing run leaves nothing behind either
        psutil.Process(pid).kill()
    assert run.returncodes == [0] and not run.timed_out, run.describe()
    assert set(children) == {"w0", "w1", "s0.0"}, run.describe()
    assert "rank 1 (worker w1 on host 0) exited with -9" in run.logs[0], run.describe()
    assert f"stopping pid {children['w1']} " in run.logs[0], run.describe()
    assert not left, f"still running after the job: {left}"


ORPHANS = """
import json, logging, os, signal, subprocess, sys, time
from deadpool_megatron.launch.orphans import Orphans

logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
def child(code):
    return subprocess.Popen([sys.executable, "-c", code])
stubborn = child("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "print('ready', flush=True); time.sleep(60)")
plain, ours = child("import time; time.sleep(60)"), child("import time; time.sleep(60)")
ended = child("pass")
# Like a resource tracker: ends by itself once its pipe closes, so never asked to stop.
settling = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
time.sleep(1.5)  # the children start (the stubborn one ignores SIGTERM from then on)
orphans = Orphans(adopted=True, grace_s=0.5, settle_s=1.0)
asked = orphans.sweep([ours.pid])
settling.stdin.close()
orphans.close()
print(json.dumps({"found": sorted(asked), "pending": orphans.pending,
                  "stubborn": stubborn.pid, "plain": plain.pid, "ended": ended.pid,
                  "settling": settling.pid,
                  "ours_alive": ours.poll() is None}), flush=True)
ours.kill()
ours.wait()
"""


def test_an_orphan_is_asked_to_stop_then_killed_and_always_reaped(tmp_path: Path) -> None:
    """One that ends by itself soon (a resource tracker once its pipe closes, after its
    cleanup) or has ended is reaped without a word; the others are asked to stop
    (SIGTERM), and killed after the grace if they ignore it; the launcher's own children
    are left alone."""
    script = tmp_path / "orphans.py"
    script.write_text(ORPHANS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout.splitlines()
    result = json.loads(said[-1])
    assert result["found"] == sorted([result["stubborn"], result["plain"],
                                      result["settling"]]), said
    assert result["pending"] == 0 and result["ours_alive"], said
    for name in ("stubborn", "plain"):
        assert sum(f"stopping pid {result[name]} " in line for line in said) == 1, said
    assert sum(f"pid {result['stubborn']} ignored SIGTERM" in line for line in said) == 1
    assert not any(f"pid {result['plain']} ignored" in line for line in said), said
    for name in ("ended", "settling"):
        assert not any(f"pid {result[name]} " in line for line in said), said


def test_a_dead_launchers_progress_directory_is_removed_by_the_next() -> None:
    """A SIGKILLed launcher (a lost host) leaves its epoch's progress records in tmpfs; the
    next launcher on the host removes those whose launcher is gone, never a live one's."""
    from deadpool_megatron.launch.workers import PROGRESS_PREFIX, progress_directory

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    dead = tempfile.mkdtemp(prefix=f"{PROGRESS_PREFIX}{gone.pid}-", dir=base)
    live = tempfile.mkdtemp(prefix=f"{PROGRESS_PREFIX}{os.getppid()}-", dir=base)
    Path(dead, "w0").write_bytes(b"\0" * 88)
    made = progress_directory()
    try:
        assert not os.path.exists(dead) and os.path.isdir(live)
        assert Path(made).name.startswith(f"{PROGRESS_PREFIX}{os.getpid()}-")
    finally:
        for path in (dead, live, made):
            shutil.rmtree(path, ignore_errors=True)
