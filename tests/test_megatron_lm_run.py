"""Megatron-LM's own pretrain() and train() loop, patched, on CPU: TP2 x PP2 x DP2 with the
distributed optimizer (8 processes, gloo), driven by the upstream-shaped driver.

With --deadpool the patched loop snapshots every iteration to ring buddies without changing
a bit of the training, and the micro-batch phases reach the fault injector at the right
point of Megatron's own loop. Megatron's own --save/--load resume the same training, and so
does Megatron's train() entered again after every rank restored its buddy's copy of a
snapshot. Dropout is on (Megatron's default, 0.1): the resumes must rewind its streams too.
Under deadpool-launch with --deadpool a killed rank is hot-swapped: a warm spare takes it and
every member enters Megatron's pretrain() again (integration/megatron_lm_elastic.py)."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import psutil
import pytest
import torch

import megatron
from deadpool_megatron.patching.cli import run
from deadpool_megatron.testing.jobs import JobResult, run_job, run_launched
from deadpool_megatron.testing.megatron_faults import CUDA_ERROR, ENV as MEGATRON_FAULT
from deadpool_megatron.metrics.timeline import load_events

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU rehearsal run")
DRIVER = Path(__file__).resolve().parents[1] / "deadpool_megatron" / "testing" / "megatron_lm_driver.py"
# Megatron's own switches for a CPU run (no TransformerEngine, apex or fused kernels).
CPU_FLAGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion",
             "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
             "--no-bias-dropout-fusion", "--no-rope-fusion", "--rerun-mode", "disabled"]
MODEL = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--use-distributed-optimizer", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
         "--lr", "1e-3", "--mock-data", "--vocab-size", "512", "--distributed-backend", "gloo",
         "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1"]
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron_lm") / "Megatron-LM"
    shutil.copytree(Path(megatron.__path__[0]), root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # pretrain() runs `make` for the dataset helpers (Megatron-LM's Makefile); the wheel
    # ships them built and no Makefile, so the tree gets an empty one.
    (root / "megatron/core/datasets/Makefile").write_text("default:\n\t@true\n")
    shutil.copy(DRIVER, root / "pretrain_gpt.py")
    code, msg = run([str(root)])
    assert code == 0, msg
    return root


def _events(path: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{path}.rank{rank}").read_text().splitlines()]


@pytest.fixture(scope="module")
def plain(patched_tree: Path, tmp_path_factory) -> tuple[JobResult, Path]:
    """The failure-free run, saving Megatron checkpoints at iterations 2 and 4."""
    out = tmp_path_factory.mktemp("plain")
    ckpt = out / "ckpt"
    run = run_job(8, [*MODEL, *CPU_FLAGS, "--save", str(ckpt), "--save-interval", "2"],
                  out / "logs", timeout_s=400, script=patched_tree / "pretrain_gpt.py", env=ENV)
    assert run.ok, run.describe()
    assert sorted(run.losses) == [1, 2, 3, 4] and run.fingerprint, run.describe()
    return run, ckpt


@pytest.mark.fault_matrix
def test_megatrons_load_resumes_bit_for_bit(patched_tree: Path, plain, tmp_path: Path) -> None:
    run, saved = plain
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = run_job(8, [*MODEL, *CPU_FLAGS, "--load", str(ckpt)], tmp_path / "resumed",
                      timeout_s=400, script=patched_tree / "pretrain_gpt.py", env=ENV)
    assert resumed.ok, resumed.describe()
    # The same training, bit for bit: the state fingerprint the patched loop ends with.
    # (Of the logged losses only iteration 3's is comparable: Megatron does not reset its
    # loss sums after a run's first logged iteration, so every run's second line averages
    # two iterations: 1-2 in a fresh run, 3-4 in this resumed one.)
    assert resumed.fingerprint == run.fingerprint, resumed.describe()
    assert resumed.losses[3] == run.losses[3], resumed.describe()


def test_with_deadpool_it_snapshots_and_the_phases_fire(patched_tree: Path, plain,
                                                        tmp_path: Path) -> None:
    run, _ = plain
    events = tmp_path / "events"
    ft = run_job(8, [*MODEL, *CPU_FLAGS, "--deadpool", "--deadpool-ranks-per-node", "4",
                     "--deadpool-events", str(events),
                     "--deadpool-inject", "raise rank=5 iter=4 phase=reduction"],
                 tmp_path / "deadpool", timeout_s=400, script=patched_tree / "pretrain_gpt.py",
                 env=ENV)
    assert not ft.timed_out and ft.returncodes[5] != 0, ft.describe()
    # Bit-identical training up to the failure: the hooks only read. (Iteration 2's line
    # averages 1-2 in both runs.)
    assert ft.losses == {i: run.losses[i] for i in (1, 2, 3)}, ft.describe()
    for rank in range(8):
        committed = [e["iteration"] for e in _events(events, rank)
                     if e["event"] == "snapshot_committed"]
        assert committed == [0, 1, 2, 3], (rank, committed)
    fault = [e for e in _events(events, 5) if e["event"] == "fault_injected"]
    assert [(f["iteration"], f["phase"]) for f in fault] == [(4, "reduction")]
    assert "InjectedFault: injected fault on rank 5" in ft.logs[5], ft.logs[5][-3000:]


@pytest.mark.fault_matrix
def test_megatrons_train_entered_again_after_a_restore_from_the_buddy_is_bit_identical(
        patched_tree: Path, plain, tmp_path: Path) -> None:
    """--deadpool-verify-restore-at 2: after iteration 2 every rank restores its live
    objects from its buddy's copy of snapshot 1 and Megatron's train() goes on from there:
    iteration 2 is computed twice, and the run ends as the run without it."""
    run, _ = plain
    events = tmp_path / "events"
    job = run_job(8, [*MODEL, *CPU_FLAGS, "--deadpool", "--deadpool-ranks-per-node", "4",
                      "--deadpool-events", str(events), "--deadpool-verify-restore-at", "2"],
                  tmp_path / "rewind", timeout_s=400, script=patched_tree / "pretrain_gpt.py",
                  env=ENV)
    assert job.ok, job.describe()
    assert ("restore rehearsal: snapshot 1 from the buddy, iteration 2 again: Megatron's "
            "train() entered again at iteration 1 (8 samples consumed)") in job.output, \
        job.describe()
    # The first train() was left at iteration 2's boundary, before Megatron logs it.
    assert re.findall(r"iteration +(\d+)/ +4 \|", job.output) == ["1", "2", "3", "4"], \
        job.describe()
    for rank in range(8):  # iteration 2 was computed, and snapshotted, twice
        committed = [e["iteration"] for e in _events(events, rank)
                     if e["event"] == "snapshot_committed"]
        assert committed == [0, 1, 2, 2, 3, 4], (rank, committed)
    assert job.fingerprint == run.fingerprint, job.describe()


def _kill_rank_when(log: Path, text: str, script: Path, rank: int, stop: threading.Event,
                    killed: list[int]) -> None:
    """SIGKILL the worker running `script` as `rank` once `text` appears in `log`."""
    while not stop.wait(0.1):
        if not log.exists() or text not in log.read_text(errors="replace"):
            continue
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if str(script) in (proc.info["cmdline"] or []) and \
                        proc.environ().get("RANK") == str(rank):
                    proc.kill()
                    killed.append(proc.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return


@pytest.mark.fault_matrix
def test_under_deadpool_launch_a_killed_rank_restarts_the_job_from_megatrons_save(
        patched_tree: Path, plain, tmp_path: Path) -> None:
    """Without --deadpool (no snapshots, so no hot-swap), deadpool-launch runs the job as
    torchrun would: a failure restarts every worker with --load from --save."""
    run, _ = plain
    script = patched_tree / "pretrain_gpt.py"
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_rank_when, daemon=True, args=(
        tmp_path / "launch" / "workers" / "epoch0" / "w0.log",  # direct, not the console's
        "saved checkpoint from iteration       2 ", script,
        5, stop, killed))
    killer.start()
    try:
        job = run_launched(["--nproc-per-node", "8", "--max-restarts", "1"],
                           [*MODEL, *CPU_FLAGS, "--save", str(tmp_path / "ckpt"),
                            "--save-interval", "2"],
                           tmp_path / "launch", timeout_s=700, env=ENV, script=script)
    finally:
        stop.set()
        killer.join(5)
    assert killed, job.describe()
    assert job.returncodes == [0], job.describe()
    assert "restarting all 8 workers with --load" in job.output, job.describe()
    # The restarted job resumed from Megatron's checkpoint, not from scratch.
    assert re.search(r"successfully loaded checkpoint from \S+ .* at iteration 2\b",
                     job.output), job.describe()
    assert re.findall(r"iteration +(\d+)/ +4 \|", job.output).count("1") == 1, job.describe()
    assert job.fingerprint == run.fingerprint, job.describe()


@pytest.mark.fault_matrix
@pytest.mark.parametrize("fault, failed, how", [
    ("kill rank=5 iter=3 phase=backward", 5, "exit"),  # killed: its launcher sees the exit
    ("raise rank=2 iter=3 phase=forward", 2, "exit"),  # its own error: it leaves the job
    # Stopped (SIGSTOP): only its stalled progress tells; its launcher kills it.
    ("hang rank=5 iter=3 phase=backward", 5, "hang"),
    # Not our injector: Megatron-Core's TransformerLayer.forward raises a CUDA error in
    # rank 2 (testing/megatron_faults.py), at its 5th call: iteration 3's first micro-batch
    # (one layer per stage, two micro-batches per iteration).
    ("megatron raise rank=2 at=forward call=5", 2, "exit"),
])
def test_under_deadpool_launch_a_failed_rank_is_hot_swapped_in_megatrons_loop(
        patched_tree: Path, plain, tmp_path: Path, fault: str, failed: int, how: str) -> None:
    """--deadpool under deadpool-launch, a warm spare per failure domain: a rank fails in
    iteration 3. A spare takes its rank (no worker is restarted), every member enters
    Megatron's pretrain() again, restores snapshot 2 (the spare from its buddy) and
    Megatron's train() recomputes iterations 3 and 4; the run ends with the fingerprint of
    the run without failure. A hung rank is found by the progress Megatron's loop stamps,
    while the start-up of the new generation's pretrain() (seconds, longer than the
    progress timeout) is not taken for a hang."""
    run, _ = plain
    events = tmp_path / "events"
    # Only the hang needs a short progress timeout (the default: 300 s before a first
    # iteration, then ten of the longest iteration, at least 20 s).
    timeout = ["--deadpool-progress-timeout", "5"] if how == "hang" else []
    inside = fault.startswith("megatron ")
    inject = [] if inside else ["--deadpool-inject", fault]
    job = run_launched(["--nproc-per-node", "8", "--spares", "2", "--logical-nodes", "2"],
                       [*MODEL, *CPU_FLAGS, "--deadpool", "--deadpool-events", str(events),
                        *inject, *timeout],
                       tmp_path / "launch", timeout_s=700,
                       env={**ENV, "DEADPOOL_CONTROL_TIMEOUT_S": "90",
                            **({MEGATRON_FAULT: fault.split(" ", 1)[1]} if inside else {})},
                       script=patched_tree / "pretrain_gpt.py")
    if inside:
        assert CUDA_ERROR in job.output, job.describe()  # reported as the rank's own error
    assert job.returncodes == [0], job.describe()
    # Hot-swapped: one declaration, a spare took rank 5, nobody restarted the job.
    assert "restarting all" not in job.output, job.describe()
    assert not (tmp_path / "launch" / "workers" / "epoch1").exists()
    ev = load_events(events)
    declared = [e for e in ev if e["event"] == "generation_declared"]
    assert [(d["generation"], d["failed_ranks"]) for d in declared] == [(1, [failed])], \
        declared
    assert list(declared[0]["replaced"]) == [str(failed)], declared
    assert declared[0]["replaced"][str(failed)].startswith("s"), declared  # a spare's id
    detected = [e for e in ev if e["event"] == "failure_detected"]
    assert [(e["rank"], e["how"]) for e in detected] == [(failed, how)], detected
    verdicts = [(e["culprits"], e["certain"]) for e in ev if e["event"] == "hang_localized"]
    assert verdicts == ([([f"w{failed}"], True)] if how == "hang" else []), verdicts
    recovered = {e["rank"]: e for e in ev if e["event"] == "recovered"}
    assert sorted(recovered) == list(range(8)), recovered
    assert {r: (e["generation"], e["restored"], e["how"]) for r, e in recovered.items()} == \
        {r: (1, 2, "buddy" if r == failed else "own") for r in range(8)}, recovered
    # The hooks in the new generation, in order on every rank: the recovery, then
    # iterations 3 and 4, each completed and snapshotted (snapshot 2, restored, is not
    # taken again).
    for rank in range(8):
        after = [e for e in ev if e["rank"] == rank and e["t"] >= recovered[rank]["t"]]
        steps = [e["iteration"] for e in after if e["event"] == "step_completed"]
        commits = [e["iteration"] for e in after if e["event"] == "snapshot_committed"]
        assert (steps, commits) == ([3, 4], [3, 4]), (rank, after)
    assert sorted(int(i) for i in re.findall(r"iteration +(\d+)/ +4 \|", job.output)) == \
        [1, 2, 3, 4], job.describe()
    # The same training, bit for bit (iteration 3's loss is the first line of the new
    # pretrain(), not averaged with an earlier one: comparable).
    assert job.fingerprint == run.fingerprint, job.describe()
    assert job.losses[3] == run.losses[3], job.describe()
