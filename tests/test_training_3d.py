"""Issue 2's acceptance: real TP2 x PP2 x DP2 training on CPU, determinism, durable resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import GPT_3D_ARGS
from deadpool_megatron.testing.jobs import JobResult, run_job

pytestmark = pytest.mark.multiproc
ITERS = 24


def _run(tmp: Path, name: str, extra: list[str], iters: int = ITERS) -> JobResult:
    result = run_job(8, [*GPT_3D_ARGS, "--train-iters", str(iters), *extra], tmp / name,
                     timeout_s=300)
    assert result.ok, result.describe()
    return result


# Megatron-LM's recommended save path: fully parallel save and load, cached save plans (the
# second save reuses the first's).
BEST_PRACTICE = ["--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
                 "--ckpt-assume-constant-structure"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, JobResult]:
    tmp = tmp_path_factory.mktemp("gpt3d")
    ckpt = tmp / "ckpt"
    return {
        "baseline": _run(tmp, "baseline", ["--log-param-changes"]),
        # Compared with the session's 8-iteration reference run of the same job.
        "short_repeat": _run(tmp, "short_repeat", [], iters=8),
        # Another seed: another initialisation, so another first loss (3 iterations: the
        # shortest run past the 2 warm-up iterations).
        "other_seed": _run(tmp, "other_seed", ["--seed", "4321"], iters=3),
        "stopped": _run(tmp, "stopped", ["--save", str(ckpt), "--save-interval", "5",
                                          "--exit-interval", "10", *BEST_PRACTICE]),
        "resumed": _run(tmp, "resumed", ["--load", str(ckpt), *BEST_PRACTICE]),
    }


def test_loss_goes_down_and_every_parameter_changes(runs: dict[str, JobResult]) -> None:
    losses = runs["baseline"].losses
    assert sorted(losses) == list(range(1, ITERS + 1))
    first = sum(losses[i] for i in range(1, 5)) / 4
    last = sum(losses[i] for i in range(ITERS - 3, ITERS + 1)) / 4
    assert last < first - 0.1, losses
    line = next(l for l in runs["baseline"].output.splitlines() if "parameters changed" in l)
    changed, total = (int(x) for x in line.split(":")[1].split(" of "))
    assert total > 0 and changed == total, line


def test_identical_runs_have_identical_fingerprints(runs: dict[str, JobResult],
                                                    failure_free_8: JobResult) -> None:
    """A second run of the session's 8-iteration reference job ends identical."""
    assert runs["baseline"].fingerprint is not None
    assert runs["short_repeat"].fingerprint not in (None, runs["baseline"].fingerprint)
    assert runs["short_repeat"].fingerprint == failure_free_8.fingerprint
    assert runs["short_repeat"].losses == failure_free_8.losses


def test_other_seed_changes_the_first_loss(runs: dict[str, JobResult],
                                          failure_free_8: JobResult) -> None:
    other, same = runs["other_seed"].losses, failure_free_8.losses
    assert sorted(other) == [1, 2, 3] and other[1] != same[1], (other, same)


def test_stop_after_save_and_resume_matches_uninterrupted(runs: dict[str, JobResult]) -> None:
    """Saved at 5 and 10 (the second save reusing the first's plan), stopped at 10,
    resumed: the uninterrupted result."""
    stopped, resumed = runs["stopped"], runs["resumed"]
    assert max(stopped.losses) == 10
    assert "saved checkpoint at iteration 10 " in stopped.output, stopped.describe()
    assert "loaded checkpoint of iteration 10" in resumed.output
    assert min(resumed.losses) == 11 and max(resumed.losses) == ITERS
    assert resumed.fingerprint == runs["baseline"].fingerprint
    # The losses after resuming are the uninterrupted run's, bit for bit as printed.
    assert {i: resumed.losses[i] for i in range(11, ITERS + 1)} == {
        i: runs["baseline"].losses[i] for i in range(11, ITERS + 1)
    }
