"""Bad flags exit non-zero, before any process group, with a message naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deadpool_megatron.testing.jobs import PRETRAIN_GPT


def _run(args: list[str], world: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0"}
    return subprocess.run([sys.executable, str(PRETRAIN_GPT), *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, world, expected",
    [
        (["--mock-data", "--tensor-model-parallel-size", "3"], 8,
         "--tensor-model-parallel-size (3) x --pipeline-model-parallel-size (1)"),
        (["--mock-data", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
          "2", "--global-batch-size", "6", "--micro-batch-size", "2"], 8,
         "--global-batch-size (6) is not divisible by --micro-batch-size (2)"),
        ([], 1, "pass --mock-data or --data-path"),
        (["--mock-data", "--save-interval", "5"], 1, "--save-interval needs --save"),
        (["--mock-data", "--micro-batch-size", "0"], 1, "--micro-batch-size must be positive"),
        (["--mock-data", "--deadpool", "--deadpool-startup-timeout", "0"], 1,
         "--deadpool-startup-timeout must be positive"),
    ],
)
def test_bad_flag_is_named(args: list[str], world: int, expected: str) -> None:
    proc = _run(args, world)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr, proc.stderr


def test_unknown_choice_is_rejected_by_argparse() -> None:
    proc = _run(["--mock-data", "--distributed-backend", "mpi"], 1)
    assert proc.returncode == 2
    assert "--distributed-backend" in proc.stderr
