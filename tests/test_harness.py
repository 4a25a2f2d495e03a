"""The job harness: bounded time, every rank's log kept, no process left behind."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from deadpool_megatron.testing.jobs import run_job
from deadpool_megatron.testing.processes import running


def _script(tmp: Path, body: str) -> Path:
    path = tmp / "job.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_hung_job_is_killed_at_the_deadline(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("rank", os.environ["RANK"], "pids", os.getpid(), child.pid, flush=True)
        time.sleep(600)
    """)
    result = run_job(2, [], tmp_path / "logs", timeout_s=5, script=script)
    assert result.timed_out and not result.ok
    assert 4 < result.elapsed_s < 30
    pids = [int(x) for r in result.logs.values() for x in r.split("pids")[1].split()]
    assert len(pids) == 4 and running(pids) == []  # grandchildren too


def test_one_failed_rank_stops_the_others_and_keeps_all_logs(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, sys, time
        print("hello from", os.environ["RANK"], flush=True)
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(600)
    """)
    result = run_job(3, [], tmp_path / "logs", timeout_s=60, script=script)
    assert not result.timed_out and result.returncodes[1] == 3
    assert result.elapsed_s < 30
    assert all(f"hello from {r}" in result.logs[r] for r in range(3))
    assert "rank 1" in result.describe()


def test_store_port_is_passed_to_ranks(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os
        from datetime import timedelta
        import torch.distributed as dist
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(seconds=20))
        store.set(f"r{os.environ['RANK']}", "x")
        store.wait([f"r{i}" for i in range(int(os.environ["WORLD_SIZE"]))])
        print("rendezvous ok", flush=True)
    """)
    result = run_job(2, [], tmp_path / "logs", timeout_s=60, script=script)
    assert result.ok, result.describe()
    assert all("rendezvous ok" in log for log in result.logs.values())
    assert os.path.isdir(result.log_dir)
