"""Workers forked from a preloader (launch/preload.py) are the processes `python -u SCRIPT
ARGS` would have been: argv, environment, path, output, name, exit status and signals; and
where a fork cannot be exact the worker is a fresh interpreter."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from deadpool_megatron.launch.preload import PreloadedProcess, Preloader

SCRIPT = """
    import os, sys, time
    print("preloaded", "torch" in sys.modules, "megatron.core" in sys.modules, flush=True)
    print("main", __name__, "path0", sys.path[0], flush=True)
    print("argv", sys.argv, "rank", os.environ.get("RANK"), "pid", os.getpid(), flush=True)
    print("ppid-is-preloader", os.getppid() == int(os.environ["PRELOADER_PID"]), flush=True)
    what = sys.argv[1]
    if what == "raise":
        raise ValueError("the worker's own error")
    if what == "sleep":
        time.sleep(600)
    sys.exit(int(what))
"""


@pytest.fixture(scope="module")
def preloader(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("preload")
    script = root / "worker.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    p = Preloader(str(script), str(root / "preload.log"), env, str(root))
    yield p, script, env, root
    p.close()


def _spawn(preloader, what: str, name: str, extra: dict[str, str] | None = None
           ) -> tuple[PreloadedProcess, Path]:
    p, script, env, root = preloader
    own = {"RANK": "3", "PRELOADER_PID": str(p.proc.pid)}
    log = root / f"{name}.log"
    proc = p.spawn([str(script), what], {**env, **own, **(extra or {})}, str(log), name, own)
    return proc, log


def test_a_forked_worker_runs_its_script_as_python_would(preloader) -> None:
    proc, log = _spawn(preloader, "7", "w3")
    assert proc.wait(timeout=60) == 7
    out = log.read_text()
    assert "preloaded True True" in out, out  # torch and Megatron-Core came imported
    assert f"main __main__ path0 {preloader[1].parent}" in out, out
    assert f"argv ['{preloader[1]}', '7'] rank 3 pid {proc.pid}" in out, out
    assert "ppid-is-preloader True" in out, out


def test_its_name_signals_and_death_are_its_own(preloader) -> None:
    proc, log = _spawn(preloader, "sleep", "s0.1")
    deadline = time.monotonic() + 60
    while not (log.exists() and "ppid" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "s0.1"
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.kill()  # a dead worker's signal goes nowhere (no reused pid is hit)


def test_its_own_error_exits_1_with_the_traceback(preloader) -> None:
    proc, log = _spawn(preloader, "raise", "w4")
    assert proc.wait(timeout=60) == 1
    out = log.read_text()
    assert "Traceback (most recent call last)" in out and \
        "ValueError: the worker's own error" in out, out


def test_an_environment_that_differs_gets_a_fresh_interpreter(preloader) -> None:
    """A variable the launcher did not name as the worker's own (PYTHONHASHSEED here) may
    be read at interpreter start-up: that worker executes its command instead."""
    proc, log = _spawn(preloader, "0", "w5", {"PYTHONHASHSEED": "7"})
    assert proc.wait(timeout=120) == 0
    out = log.read_text()
    assert "fresh interpreter: its environment differs from the preloader's in " \
        "PYTHONHASHSEED" in out, out
    assert "preloaded False False" in out and "ppid-is-preloader True" in out, out


def test_a_script_whose_path_finds_another_torch_gets_a_fresh_interpreter(preloader) -> None:
    """Another script, beside a `torch` of its own: Python would import that one, so the
    worker executes its command instead of running on the preloaded torch."""
    p, script, env, root = preloader
    other = root / "other"
    (other / "torch").mkdir(parents=True)
    (other / "torch" / "__init__.py").write_text("")
    (other / "worker.py").write_text(script.read_text())
    own = {"RANK": "1", "PRELOADER_PID": str(p.proc.pid)}
    log = root / "other.log"
    proc = p.spawn([str(other / "worker.py"), "0"], {**env, **own}, str(log), "w1", own)
    assert proc.wait(timeout=120) == 0
    out = log.read_text()
    assert "fresh interpreter: its path finds torch elsewhere than the preloaded one" in out
    assert f"preloaded False False\nmain __main__ path0 {other}" in out, out
