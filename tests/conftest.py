"""Shared fixtures: the small TP2 x PP2 x DP2 job that the multi-process tests run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("PYTHONWARNINGS", "ignore")

from deadpool_megatron.testing.jobs import GPT_3D_ARGS  # noqa: E402,F401  (tests import it from here)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multiproc: launches real multi-process jobs")
    config.addinivalue_line("markers", "fault_matrix: the long fault-injection matrix")


@pytest.fixture(scope="session")
def failure_free_8(tmp_path_factory: pytest.TempPathFactory):
    """The 3D job, 8 iterations, distributed optimizer, no DeadPool: the reference result
    that snapshot and hot-swap runs must reproduce bit for bit."""
    from deadpool_megatron.testing.jobs import run_job

    run = run_job(8, [*GPT_3D_ARGS, "--train-iters", "8"],
                  tmp_path_factory.mktemp("failure_free_8"), timeout_s=300)
    assert run.ok, run.describe()
    return run
