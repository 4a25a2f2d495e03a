"""tools/gpu_check.sh --dry-run walks every step on a CPU machine: it checks each job's
flags as the training script would and says what it would run, and runs nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deadpool_megatron.testing.jobs import REPO


def _dry_run(tmp_path: Path, *extra: str) -> str:
    env = {**os.environ, "PY": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--dry-run", *extra],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was run, nothing written
    return proc.stdout


def test_dry_run_walks_every_step_and_runs_nothing(tmp_path: Path) -> None:
    out = _dry_run(tmp_path)
    for header in ("1/3 the device", "2/3 snapshot overhead", "3/3 elastic path", "figures"):
        assert f"== {header}" in out
    assert not re.search(r"^\$ ", out, re.M)  # no command was started
    params = int(re.search(r"^model parameters: (\d+)", out, re.M)[1])
    assert params >= 1_000_000_000
    snapshots_on = re.search(r"^would run 1 x snapshots on: 2 ranks of (.*)$", out, re.M)[1]
    assert "--deadpool " in snapshots_on and "--num-layers 20" in snapshots_on
    assert "would run 1 x snapshots off" in out
    # One GPU: two ranks cannot share it under NCCL, so gloo over CUDA tensors.
    assert re.search(r"would run the failure-free job: .*--distributed-backend gloo", out)
    faulty = re.search(r"^would run the job with .*$", out, re.M)[0]
    assert "deadpool_megatron.launch --nproc-per-node 2 --spares 1" in faulty
    assert "--deadpool-inject 'kill rank=1 iter=4 phase=backward'" in faulty
    assert "would compare the two state fingerprints" in out
    assert out.rstrip().endswith("dry run complete: every step checked, nothing run")


def test_with_enough_gpus_every_step_runs_nccl(tmp_path: Path) -> None:
    out = _dry_run(tmp_path, "--devices", "8")
    assert "backend nccl for 2 ranks on 8" in out
    assert "backend nccl for 2 ranks and a spare on 8" in out
    assert re.search(r"would run the job with .*--distributed-backend nccl", out)


@pytest.mark.parametrize("arg", ["--bogus"])
def test_unknown_arguments_are_refused(arg: str) -> None:
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), arg], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown argument --bogus" in proc.stderr
