"""Megatron-LM's own pretrain() and train() loop, patched, on CPU: TP2 x PP2 x DP2 with the
distributed optimizer (8 processes, gloo), driven by the upstream-shaped driver.

With --deadpool the patched loop snapshots every iteration to ring buddies without changing
a bit of the training, and the micro-batch phases reach the fault injector at the right
point of Megatron's own loop. Megatron's own --save/--load resume the same training, and so
does Megatron's train() entered again after every rank restored its buddy's copy of a
snapshot. Dropout is on (Megatron's default, 0.1): the resumes must rewind its streams too.
Under deadpool-launch with --deadpool a failed rank is hot-swapped without leaving
Megatron's pretrain(): a warm spare built alone takes it, the survivors keep their objects
and rebind their groups, and train() is entered again at the restored iteration
(integration/megatron_lm_elastic.py)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from deadpool_megatron.testing.checkout import lay_out_checkout
from deadpool_megatron.testing.disk import damage_flushed_shard
from deadpool_megatron.testing.jobs import MEGATRON_GPT, JobResult, run_job, run_launched
from deadpool_megatron.testing.signals import sigterm_the_launcher, signal_worker_when
from deadpool_megatron.faults.megatron_faults import CUDA_ERROR, ENV as MEGATRON_FAULT
from deadpool_megatron.metrics.timeline import load_events
from recoveries import SPREAD_TOLERANCE, check_recoveries

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU rehearsal run")
# Megatron's own switches for a CPU run (no TransformerEngine, apex or fused kernels).
CPU_FLAGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion",
             "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
             "--no-bias-dropout-fusion", "--no-rope-fusion", "--rerun-mode", "disabled"]
MODEL = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--use-distributed-optimizer", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
         "--lr", "1e-3", "--mock-data", "--vocab-size", "512", "--distributed-backend", "gloo",
         "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1"]
VALIDATION = re.compile(r"validation loss at iteration (\d+)( on \w+ set)? \| lm loss value: (\S+)")


def _validation(output: str) -> list[tuple[str, str, str]]:
    """Each evaluation's report: iteration, set (the end's), loss."""
    return VALIDATION.findall(output)
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    return lay_out_checkout(tmp_path_factory.mktemp("megatron_lm") / "Megatron-LM")


def _events(path: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{path}.rank{rank}").read_text().splitlines()]


@pytest.fixture(scope="module")
def plain(patched_tree: Path, tmp_path_factory) -> JobResult:
    """The failure-free run: our pretrain_scripts/pretrain_gpt.py (the wheel's megatron/
    patched), given Megatron's CPU switches; the patched user's tree's runs end with its
    fingerprint too."""
    out = tmp_path_factory.mktemp("plain")
    run = run_job(8, [*MODEL, *CPU_FLAGS], out / "logs", timeout_s=400, script=MEGATRON_GPT,
                  env=ENV)
    assert run.ok, run.describe()
    assert sorted(run.losses) == [1, 2, 3, 4] and run.fingerprint, run.describe()
    return run


# Features the errors-and-hang job runs with, against a failure-free run of its own: sequence
# parallelism (CPU workaround sequence-parallel-torch-norm), MoE with expert parallelism
# (expert groups are parallel groups too: rebound and audited), bf16, and a virtual pipeline
# (two model chunks of one layer on each pipeline rank, interleaved 1F1B: one data iterator
# per chunk on a rank that reads data).
FEATURES = ["--sequence-parallel", "--num-experts", "4", "--expert-model-parallel-size", "2",
            "--moe-router-topk", "2", "--expert-tensor-parallel-size", "1", "--bf16",
            "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """A real Megatron indexed dataset (.bin/.idx) made here from text, with a text
    tokenizer trained here, as the flags that replace --mock-data: a SentencePiece BPE
    model (120 pieces) trained on 300 generated sentences, which Megatron's
    GPTSentencePieceTokenizer turns into the documents (each ended by its end-of-document
    token), 90/10 train/valid."""
    import sentencepiece

    from deadpool_megatron.rehearsal import prepare_megatron_import

    prepare_megatron_import(True)  # megatron.core's package imports on a machine without CUDA
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    words = ("the a model rank spare buddy snapshot gradient pipeline tensor data parallel "
             "failure recovery iteration batch loss layer expert token").split()
    rng = np.random.default_rng(7)
    text = [" ".join(rng.choice(words, int(rng.integers(8, 40)))) + "." for _ in range(300)]
    (root / "text.txt").write_text("\n".join(text))
    sentencepiece.SentencePieceTrainer.train(
        input=str(root / "text.txt"), model_prefix=str(root / "tokenizer"), vocab_size=120,
        model_type="bpe", minloglevel=2)
    flags = ["--tokenizer-type", "GPTSentencePieceTokenizer",
             "--tokenizer-model", str(root / "tokenizer.model")]
    tokenizer = build_tokenizer(argparse.Namespace(
        tokenizer_type=flags[1], tokenizer_model=flags[3], metadata_path=None,
        chat_template=None, special_tokens=None, pad_vocab_size=False,
        tokenizer_sentencepiece_ignore_extra_whitespaces=True,
        tokenizer_sentencepiece_legacy=False))
    prefix = root / "corpus_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for line in text:
        ids = [*tokenizer.tokenize(line), tokenizer.eod]
        builder.add_document(np.array(ids, dtype=np.int32), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return ["--data-path", str(prefix), "--split", "90,10,0", *flags]


# The real-data runs take their vocabulary from the tokenizer (`corpus`).
REAL_DATA_MODEL = [a for i, a in enumerate(MODEL) if a != "--mock-data" and
                   "--vocab-size" not in MODEL[max(i - 1, 0):i + 1]]


@pytest.fixture(scope="module")
def plain_features(patched_tree: Path, corpus: list[str], tmp_path_factory) -> JobResult:
    out = tmp_path_factory.mktemp("plain_features")
    run = run_job(8, [*REAL_DATA_MODEL, *corpus, *CPU_FLAGS, *FEATURES], out / "logs",
                  timeout_s=400, script=patched_tree / "pretrain_gpt.py", env=ENV)
    assert run.ok and run.fingerprint, run.describe()
    return run


def test_with_deadpool_it_snapshots_and_the_phases_fire(patched_tree: Path, plain,
                                                        tmp_path: Path) -> None:
    run = plain
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
    run = plain
    events = tmp_path / "events"
    # Megatron's saves too (they copy and pickle args, which once held the hooks' locks).
    job = run_job(8, [*MODEL, *CPU_FLAGS, "--deadpool", "--deadpool-ranks-per-node", "4",
                      "--deadpool-events", str(events), "--deadpool-verify-restore-at", "2",
                      "--save", str(tmp_path / "ckpt"), "--save-interval", "2"],
                  tmp_path / "rewind", timeout_s=400, script=patched_tree / "pretrain_gpt.py",
                  env=ENV)
    assert job.ok, job.describe()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert ("restore check: snapshot 1 from the buddy, iteration 2 again: Megatron's "
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


@pytest.mark.fault_matrix
def test_under_deadpool_launch_a_killed_rank_restarts_the_job_from_megatrons_save(
        patched_tree: Path, plain, tmp_path: Path) -> None:
    """Without --deadpool (no snapshots, so no hot-swap), deadpool-launch runs the job as
    torchrun would: a failure restarts every worker with --load from --save, and Megatron's
    own load resumes the same training bit for bit."""
    run = plain
    script = patched_tree / "pretrain_gpt.py"
    with signal_worker_when(tmp_path / "launch" / "workers" / "epoch0" / "w0.log",  # direct
                            "saved checkpoint from iteration       2 ", "w5") as killed:
        job = run_launched(["--nproc-per-node", "8", "--max-restarts", "1"],
                           [*MODEL, *CPU_FLAGS, "--save", str(tmp_path / "ckpt"),
                            "--save-interval", "2"],
                           tmp_path / "launch", timeout_s=700, env=ENV, script=script)
    assert killed, job.describe()
    assert job.returncodes == [0], job.describe()
    assert "restarting all 8 workers with --load" in job.output, job.describe()
    # The restarted job resumed from Megatron's checkpoint, not from scratch.
    assert re.search(r"successfully loaded checkpoint from \S+ .* at iteration 2\b",
                     job.output), job.describe()
    assert re.findall(r"iteration +(\d+)/ +4 \|", job.output).count("1") == 1, job.describe()
    assert job.fingerprint == run.fingerprint, job.describe()
    # Of the logged losses only iteration 3's is comparable: Megatron does not reset its loss
    # sums after a run's first logged iteration, so a run's second line averages two
    # iterations (1-2 in a fresh run, 3-4 in the resumed one).
    assert job.losses[3] == run.losses[3], job.describe()


def _hot_swap(tmp_path: Path, script: Path, faults: list[str], spares: int,
              extra: list[str] = (), env: dict[str, str] | None = None,
              cpu_flags: list[str] = CPU_FLAGS, model: list[str] = MODEL
              ) -> tuple[JobResult, list[dict]]:
    """Megatron's pretrain() under deadpool-launch with --deadpool and `faults`, one after
    another, each taken by a warm spare; the events of every rank, in time order."""
    events = tmp_path / "events"
    args = [*model, *cpu_flags, "--deadpool", "--deadpool-events", str(events),
            "--deadpool-audit-groups", *extra]
    for fault in faults:
        args += ["--deadpool-inject", fault]
    job = run_launched(["--nproc-per-node", "8", "--spares", str(spares),
                        "--logical-nodes", "2"], args, tmp_path / "launch", timeout_s=700,
                       env={**ENV, "DEADPOOL_CONTROL_TIMEOUT_S": "90", **(env or {})},
                       script=script)
    # Hot-swapped: no worker restarted, every rank's iterations printed once.
    assert "restarting all" not in job.output, job.describe()
    assert not (tmp_path / "launch" / "workers" / "epoch1").exists()
    assert sorted(int(i) for i in re.findall(r"iteration +(\d+)/ +4 \|", job.output)) == \
        [1, 2, 3, 4], job.describe()
    return job, sorted(load_events(events), key=lambda e: e["t"])


def _spares_took_warm_loaders(tmp_path: Path) -> int:
    """How many spares' training and validation loaders each took the workers it started
    while it waited (integration/spare_loaders.py)."""
    logs = [log.read_text() for log in (tmp_path / "launch" / "workers" / "epoch0").glob("s*.log")]
    return sum(all(f"the {split} loader took the workers started ahead" in text
                   for split in ("train", "valid")) for text in logs)


def _spares_took(events: list[dict]) -> list[tuple[int, list[int], str]]:
    declared = [e for e in events if e["event"] == "generation_declared"]
    for d in declared:
        assert all(w.startswith("s") for w in d["replaced"].values()), d  # a spare each
    return [(d["generation"], d["failed_ranks"], sorted(d["replaced"])) for d in declared]


@pytest.mark.fault_matrix
def test_a_kill_while_megatron_builds_has_every_rank_build_again(
        plain, tmp_path: Path) -> None:
    """Rank 4 is killed as its model is built, before the job's first snapshot: there is
    nothing to restore, so a spare takes rank 4 and every rank builds its objects again
    (pretrain() entered again over Megatron's globals set afresh), and the run ends with
    the failure-free fingerprint. Before, that second build imported a function Megatron
    0.19 does not have, every rank failed alike and the job ended with that ImportError
    (found by chaos soak seed 191, a fault during the restarted job's build)."""
    events = tmp_path / "events"
    with signal_worker_when(tmp_path / "launch" / "workers" / "epoch0" / "w4.log",
                            "number of parameters on", "w4") as killed:
        job = run_launched(["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "2"],
                           [*MODEL, *CPU_FLAGS, "--deadpool", "--deadpool-events",
                            str(events)], tmp_path / "launch", timeout_s=400, env=ENV,
                           script=MEGATRON_GPT)
    assert killed and job.ok, job.describe()
    assert job.fingerprint == plain.fingerprint, job.describe()
    assert "ImportError" not in job.output and "restarting" not in job.output, job.describe()
    declared = [e["failed_ranks"] for e in load_events(events)
                if e["event"] == "generation_declared"]
    assert declared == [[4]], job.describe()


@pytest.mark.fault_matrix
def test_a_rank_stopped_while_megatron_starts_is_found_and_replaced(
        plain, tmp_path: Path) -> None:
    """Megatron's loop, as test_real_failures.py's test of our loop: rank 0 is stopped
    (SIGSTOP) while it builds its datasets, before its first progress stamp. Its host
    reports it stopped, it is found at the 3 s progress timeout, a spare takes it, every
    rank builds afresh (there is no snapshot yet) and the run ends bit-exact."""
    with signal_worker_when(tmp_path / "launch" / "workers" / "epoch0" / "w0.log",
                            "Unable to save MockGPTDataset", "w0", signal.SIGSTOP) as stopped:
        job, events = _hot_swap(tmp_path, MEGATRON_GPT, [], spares=1,
                                extra=["--deadpool-progress-timeout", "3"])
    assert stopped and job.ok and job.fingerprint == plain.fingerprint, job.describe()
    assert [e["failed_ranks"] for e in events if e["event"] == "generation_declared"] == \
        [[0]], job.describe()
    (verdict,) = [e for e in events if e["event"] == "hang_localized"]
    assert verdict["culprits"] == ["w0"] and verdict["certain"], verdict
    assert verdict["why"]["w0"] == "stopped by a signal", verdict


@pytest.mark.fault_matrix
def test_a_node_lost_while_megatron_builds_is_rebuilt_with_a_spare_that_built_alone(
        plain, tmp_path: Path) -> None:
    """Megatron's loop, as test_real_failures.py's test of our loop: rank 2 is killed while
    the job builds, its spare builds rank 2 alone, and the rest of its node (ranks 0, 1,
    3) is killed as that generation is declared. Every rank builds afresh (pretrain()
    entered again, the spare's build alone discarded) and the run ends bit-exact,
    hot-swapped (chaos soak seed 215)."""
    launch = tmp_path / "launch"
    launcher, w0_log = launch / "launcher.log", launch / "workers" / "epoch0" / "w0.log"
    with signal_worker_when(w0_log, "Unable to save MockGPTDataset", "w2") as first, \
            signal_worker_when(launcher, "ranks [2] failed; spares", "w0") as w0, \
            signal_worker_when(launcher, "ranks [2] failed; spares", "w1") as w1, \
            signal_worker_when(launcher, "ranks [2] failed; spares", "w3") as w3:
        job, events = _hot_swap(tmp_path, MEGATRON_GPT, [], spares=4)
    assert first and w0 and w1 and w3, job.describe()
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    declared = [e["failed_ranks"] for e in events if e["event"] == "generation_declared"]
    assert declared[0] == [2] and sorted(r for d in declared[1:] for r in d) == [0, 1, 3], \
        job.describe()
    assert {e["how"] for e in events if e["event"] == "recovered"} == {"fresh"}, job.describe()


@pytest.mark.fault_matrix
def test_kills_at_every_point_of_megatrons_iteration_are_hot_swapped(
        patched_tree: Path, plain, tmp_path: Path) -> None:
    """Four kills in Megatron's own loop, one an iteration: in the first iteration's
    forward, a backward, the data-parallel reduction and just before the optimizer step.
    Each is taken by a spare built alone; survivors keep their objects (same parameter
    tensors, no dataset rebuilt) and only rebind their groups; the replica that lost
    nothing keeps its gradients; each rank recomputes exactly the micro-batches the plan
    counted lost; the run ends with the failure-free fingerprint. Run as users run it:
    pretrain_scripts/pretrain_gpt.py, its CPU switches left to the script's defaults; with
    Megatron's durable saves after iterations 2 and 4, each after a recovery (a save
    copies and pickles Megatron's args, which once held the hot-swap session's locks)."""
    run = plain
    job, events = _hot_swap(tmp_path, MEGATRON_GPT, [
        "kill rank=5 iter=1 phase=forward", "kill rank=2 iter=2 phase=backward",
        "kill rank=6 iter=3 phase=reduction", "kill rank=1 iter=4 phase=optimizer"], spares=4,
        cpu_flags=[], extra=["--save", str(tmp_path / "ckpt"), "--save-interval", "2"])
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert "no CUDA: added the defaults --transformer-impl local" in job.output
    # Each spare built the datasets while it waited, and pretrain() took them.
    took = [log.name for log in (tmp_path / "launch" / "workers" / "epoch0").glob("s*.log")
            if "spare: the datasets built ahead handed over" in log.read_text()]
    assert len(took) == 4, (took, job.describe())
    recovered = check_recoveries(job, events, run.fingerprint, count=4)
    assert _spares_took(events) == [(1, [5], ["5"]), (2, [2], ["2"]), (3, [6], ["6"]),
                                    (4, [1], ["1"])]
    # In the CPU rehearsal Megatron's groups with equal members (and backend: its `_GLOO`
    # copies ask for gloo by name) are one gloo group, as in our own loop: a survivor keeps
    # each once (not its TP group, its expert TP group, its tensor-and-context group...
    # each apart). The reduction barrier's group is ours, apart on purpose.
    kept_sets = [[(tuple(ranks), desc.endswith("_GLOO")) for desc, ranks in e["kept_groups"]
                  if desc != "DATA_PARALLEL_REDUCTION_BARRIER"]
                 for e in events if e["event"] == "abort"]
    assert any(kept_sets) and all(len(s) == len(set(s)) for s in kept_sets), kept_sets
    gen = {g: {e["rank"]: e for e in recovered if e["generation"] == g} for g in range(1, 5)}
    assert {e["restored"] for e in gen[1].values()} == {0}  # the starting state's snapshot
    for g, failed in ((1, 5), (2, 2)):  # before the reduction: the other replica keeps
        kept = {r for r, e in gen[g].items() if e["kept_grads"]}
        assert kept and failed not in kept and len(kept) == 4, (g, gen[g])
        # Two micro-batches a replica (global batch 8 = 2 x micro-batch 2 x DP 2).
        assert all(gen[g][r]["microbatches_recomputed"] == 2 for r in set(range(8)) - kept)
    for g in (3, 4):  # a reduction had begun: no gradient is trusted
        assert not any(e["kept_grads"] for e in gen[g].values()), gen[g]
    # Only the spare came from its buddy; the survivors kept their live state.
    for g, failed in ((1, 5), (2, 2), (3, 6), (4, 1)):
        assert {r for r, e in gen[g].items() if e["how"] == "buddy"} == {failed}, gen[g]
    assert job.losses[4] == run.losses[4], job.describe()
    # Evaluations after iterations 2 and 4 read what the failure-free run read: the spare
    # that took rank 6 (its data iterators' rank) in iteration 3 starts its validation
    # iterator where iteration 2's evaluation left the others.
    assert len(_validation(run.output)) == 4 and \
        _validation(job.output) == _validation(run.output), job.describe()


@pytest.mark.fault_matrix
def test_a_slow_save_in_megatrons_loop_is_no_hang(plain, tmp_path: Path) -> None:
    """Megatron's own save in its train() takes 8 s longer on rank 2 (a slow file system),
    every other rank waiting for it there, under a 3 s progress timeout: the save is a
    declared long operation, so nothing is declared (before, every rank was taken for hung
    in it and the job ended: chaos soak --loop megatron --save-interval 4)."""
    job, events = _hot_swap(tmp_path, MEGATRON_GPT, [], spares=1, cpu_flags=[],
                            extra=["--deadpool-progress-timeout", "3", "--save",
                                   str(tmp_path / "ckpt"), "--save-interval", "2"],
                            env={MEGATRON_FAULT: "sleep rank=2 at=save call=1 seconds=8"})
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    assert "test fault: sleep in save" in job.output
    assert not [e for e in events if e["event"] in ("failure_detected", "hang_localized")]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"


@pytest.mark.fault_matrix
def test_a_spare_frozen_while_it_builds_is_found_and_replaced(plain, tmp_path: Path) -> None:
    """Rank 1 is killed in iteration 2; the spare taking it is stopped (SIGSTOP: frozen, as
    by a cgroup freeze) as its assignment is declared, while it builds alone. Its host sees
    it from its assignment on: it is found frozen and replaced by the second spare, no
    survivor waiting for it is taken for hung, and the run ends bit-exact. Before, a spare
    had no view until its first stamp after the build: the survivors waiting for it were
    guessed hung one after another, each taking a spare (chaos soak seed 192)."""
    with signal_worker_when(tmp_path / "launch" / "launcher.log", "spares {1: 's0.0'}",
                            "s0.0", signal.SIGSTOP) as stopped:
        job, events = _hot_swap(tmp_path, MEGATRON_GPT, ["kill rank=1 iter=2 phase=backward"],
                                spares=2, extra=["--deadpool-progress-timeout", "3"])
    assert stopped and job.ok and job.fingerprint == plain.fingerprint, job.describe()
    verdicts = [(e["culprits"], e["certain"]) for e in events if e["event"] == "hang_localized"]
    assert verdicts == [(["s0.0"], True)], job.describe()
    assert [r for e in events if e["event"] == "generation_declared"
            for r in e["failed_ranks"]] == [1, 1], job.describe()


@pytest.mark.fault_matrix
def test_a_spare_hung_while_it_builds_in_megatrons_loop_is_found_at_the_startup_timeout(
        plain, tmp_path: Path) -> None:
    """As test_real_failures' test of the same name, in Megatron's loop: the spare taking
    rank 1 blocks forever in GPTModel's constructor inside Megatron's start-up, run alone.
    The monitor looks at the building thread, so at --deadpool-startup-timeout it is found
    blocked outside any collective (before, it was 'nowhere': never a certain culprit, and
    only the 300 s allowance ended its build); the second spare takes rank 1 and the run
    ends bit-exact."""
    job, events = _hot_swap(tmp_path, MEGATRON_GPT, ["kill rank=1 iter=2 phase=backward"],
                            spares=2, extra=["--deadpool-startup-timeout", "20"],
                            env={MEGATRON_FAULT: "block worker=s0.0 at=build"})
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    assert "test fault: block in build" in job.output, job.describe()
    verdicts = [(e["culprits"], e["certain"], e["why"]) for e in events
                if e["event"] == "hang_localized"]
    assert verdicts == [(["s0.0"], True, {"s0.0": "blocked outside any collective"})], \
        job.describe()
    assert [r for e in events if e["event"] == "generation_declared"
            for r in e["failed_ranks"]] == [1, 1], job.describe()


@pytest.mark.fault_matrix
def test_a_rank_hung_in_megatrons_first_build_is_found_at_the_startup_timeout(
        plain, tmp_path: Path) -> None:
    """As test_real_failures' test of the same name, in Megatron's loop: rank 2 blocks
    forever in GPTModel's constructor inside pretrain()'s start-up, its peers waiting for
    it in Megatron's collectives. Before, a worker that had stamped nothing was never
    judged and the job waited forever; now it is found at --deadpool-startup-timeout,
    blocked outside any collective, a spare takes rank 2, pretrain() starts again on every
    rank and the run ends bit-exact."""
    job, events = _hot_swap(tmp_path, MEGATRON_GPT, [], spares=1,
                            extra=["--deadpool-startup-timeout", "20"],
                            env={MEGATRON_FAULT: "block rank=2 at=build"})
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    assert "test fault: block in build" in job.output, job.describe()
    verdicts = [(e["culprits"], e["certain"], e["why"]) for e in events
                if e["event"] == "hang_localized"]
    assert verdicts == [(["w2"], True, {"w2": "blocked outside any collective"})], \
        job.describe()
    assert [e["failed_ranks"] for e in events if e["event"] == "generation_declared"] == \
        [[2]], job.describe()


@pytest.mark.fault_matrix
def test_a_kill_inside_a_gloo_creation_in_megatrons_loop_leaves_no_peer_waiting(
        plain, tmp_path: Path) -> None:
    """As test_real_failures' test of the same name, in Megatron's loop: rank 3 is killed
    inside generation 1's default group after publishing its address, every peer waits in
    gloo to be connected, and the next declaration leaves each creation behind: two ranks
    replaced, no peer taken for hung, the run bit-exact."""
    job, events = _hot_swap(tmp_path, MEGATRON_GPT, ["kill rank=5 iter=2 phase=backward"],
                            spares=2, cpu_flags=[],
                            env={MEGATRON_FAULT: "kill rank=3 at=gloo call=2",
                                 "GLOO_SOCKET_IFNAME": "lo"})
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    assert "test fault: kill in gloo (call 2)" in job.output
    declared = [e["failed_ranks"] for e in events if e["event"] == "generation_declared"]
    assert declared == [[5], [3]], job.describe()
    left = [e for e in events if e["event"] == "forming_abandoned"]
    assert any(e["left_waiting"] for e in left) and all(e["generation"] == 1 for e in left)
    assert not [e for e in events if e["event"] == "hang_localized"], job.describe()


@pytest.mark.fault_matrix
def test_a_kill_inside_a_snapshot_pair_creation_in_megatrons_loop_leaves_its_buddy_waiting_in_none(
        plain, tmp_path: Path) -> None:
    """As test_real_failures' test of the same shape, in Megatron's loop: rank 3 is killed
    inside generation 1's snapshot pair group after publishing its address; its pair peer
    waits in gloo to be connected, and the next declaration leaves that creation behind:
    two ranks replaced, no peer taken for hung, the run bit-exact."""
    job, events = _hot_swap(tmp_path, MEGATRON_GPT, ["kill rank=5 iter=2 phase=backward"],
                            spares=2, env={MEGATRON_FAULT: "kill rank=3 at=pair call=2",
                                           "GLOO_SOCKET_IFNAME": "lo"})
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    assert "test fault: kill in a snapshot pair (call 2)" in job.output, job.describe()
    declared = [e["failed_ranks"] for e in events if e["event"] == "generation_declared"]
    assert declared == [[5], [3]], job.describe()
    left = [e for e in events if e["event"] == "forming_abandoned"]
    assert any("snapshot pair" in e["what"] and e["left_waiting"] for e in left), left
    assert not [e for e in events if e["event"] == "hang_localized"], job.describe()


@pytest.mark.fault_matrix
def test_a_snapshot_worker_gloo_never_frees_in_megatrons_loop_is_given_up_not_its_rank(
        plain, tmp_path: Path) -> None:
    """As test_real_failures' test of the same shape, in Megatron's loop: rank 3's snapshot
    worker blocks forever in snapshot 1's acknowledgement, and rank 5 is killed in iteration
    2. Rank 3 gives up its worker, waiting on its buddy, 1 s after the cut and goes on:
    only rank 5 is replaced, and the run ends bit-exact."""
    job, events = _hot_swap(tmp_path, MEGATRON_GPT, ["kill rank=5 iter=2 phase=backward"],
                            spares=2, env={MEGATRON_FAULT: "block rank=3 at=ack call=2"})
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    declared = [e["failed_ranks"] for e in events if e["event"] == "generation_declared"]
    assert declared == [[5]], job.describe()
    assert "rank 3: the snapshot worker did not stop within 1 s of its connections being " \
           "cut; going on without it" in job.output, job.describe()


@pytest.mark.fault_matrix
def test_a_restore_transfer_no_cut_frees_in_megatrons_loop_is_left_behind(
        plain, tmp_path: Path) -> None:
    """As test_real_failures' test of the same shape, in Megatron's loop: rank 5 is killed
    in iteration 2, the spare that takes it blocks forever in its restore transfer, and rank
    6 is killed meanwhile. The transfer is left behind, the spare restores rank 5 in the
    next generation, and the run ends bit-exact with no hang declared."""
    spare_log = tmp_path / "launch" / "workers" / "epoch0" / "s0.0.log"
    with signal_worker_when(spare_log, "test fault: block in restore", "w6") as killed:
        job, events = _hot_swap(tmp_path, MEGATRON_GPT, ["kill rank=5 iter=2 phase=backward"],
                                spares=2, env={MEGATRON_FAULT: "block worker=s0.0 at=restore"})
    assert killed and job.ok and job.fingerprint == plain.fingerprint, job.describe()
    declared = [e["failed_ranks"] for e in events if e["event"] == "generation_declared"]
    assert declared == [[5], [6]], job.describe()
    assert "superseded while making the restore transfers" in job.output, job.describe()
    assert not [e for e in events if e["event"] == "hang_localized"], job.describe()


# TP2 x DP4: each rank's parameters are held by three data-parallel peers, two of them on
# the other node (rank 2's: 4, then 6, then 0).
MODEL_DP4 = [*MODEL]
MODEL_DP4[MODEL_DP4.index("--pipeline-model-parallel-size") + 1] = "1"


@pytest.fixture(scope="module")
def plain_dp4(tmp_path_factory) -> JobResult:
    run = run_job(8, [*MODEL_DP4, *CPU_FLAGS], tmp_path_factory.mktemp("plain_dp4") / "logs",
                  timeout_s=400, script=MEGATRON_GPT, env=ENV)
    assert run.ok and run.fingerprint, run.describe()
    return run


@pytest.mark.fault_matrix
def test_a_source_killed_inside_a_replica_fetch_in_megatrons_loop_hands_it_to_the_next_holder(
        plain_dp4: JobResult, tmp_path: Path) -> None:
    """As test_failure_points' test of the same shape, in Megatron's loop: rank 2 is
    killed, and rank 4, the source of its spare's parameters, dies inside the fetch's group
    creation. The next declaration leaves that creation behind; the next plan takes rank
    2's region from rank 6 and rank 4's from rank 0: hot-swapped, bit-exact."""
    job, events = _hot_swap(tmp_path, MEGATRON_GPT, ["kill rank=2 iter=2 phase=backward"],
                            spares=2, model=MODEL_DP4,
                            env={MEGATRON_FAULT: "kill rank=4 at=fetch call=1",
                                 "GLOO_SOCKET_IFNAME": "lo"})
    assert job.ok and job.fingerprint == plain_dp4.fingerprint, job.describe()
    assert "test fault: kill in a replica fetch (call 1)" in job.output, job.describe()
    declared = [e["failed_ranks"] for e in events if e["event"] == "generation_declared"]
    assert declared == [[2], [4]], job.describe()
    assert not [e for e in events if e["event"] == "hang_localized"], job.describe()
    taken = {(e["source"], e["to"]) for e in events
             if e["event"] == "replicated_region_moved" and e["role"] == "spare"}
    assert taken == {(6, 2), (0, 4)}, job.describe()


@pytest.mark.fault_matrix
def test_a_kill_during_megatrons_save_waits_for_a_survivor_still_writing(
        plain, tmp_path: Path) -> None:
    """Rank 5 is killed while rank 2 writes its part of Megatron's save after iteration 2
    (15 s longer: a slow file system; longer than an intact replica's grace and the 5 s
    given a stopping thread, together). Rank 2's training thread is inside a durable save,
    so its recovery waits for it to stop (at the save's next collective, which the cut
    fails) instead of giving it 5 s and leaving the job too (before: every survivor still
    in the save left, and the job ended; chaos soak --loop megatron). One declaration,
    rank 5's; the run ends bit-exact, the save after iteration 4 committed."""
    with signal_worker_when(tmp_path / "launch" / "workers" / "epoch0" / "w2.log",
                            "test fault: sleep in save", "w5") as killed:
        job, events = _hot_swap(tmp_path, MEGATRON_GPT, [], spares=1, cpu_flags=[],
                                extra=["--save", str(tmp_path / "ckpt"), "--save-interval",
                                       "2"],
                                env={MEGATRON_FAULT: "sleep rank=2 at=save call=1 seconds=15"})
    assert killed, job.describe()
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    declared = [e["failed_ranks"] for e in events if e["event"] == "generation_declared"]
    assert declared == [[5]], job.describe()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"


@pytest.mark.fault_matrix
def test_own_errors_and_a_hang_in_megatrons_loop_are_hot_swapped(
        patched_tree: Path, plain_features: JobResult, corpus: list[str],
        tmp_path: Path) -> None:
    """Failures as they come: a CUDA error raised by Megatron-Core's TransformerLayer.forward
    in rank 6 (not our injector: faults/megatron_faults.py, its 5th call: iteration 2's
    first micro-batch, two layers a micro-batch), an exception of rank 2's own in iteration
    3, and rank 5 stopped (SIGSTOP) in iteration 4's backward, found by its stalled progress
    and killed by its launcher. A rank's own error leaves at once with its traceback; every
    one is taken by a spare and the run ends with the failure-free fingerprint. The job
    runs with sequence parallelism, MoE over two expert-parallel ranks, bf16 and a virtual
    pipeline (FEATURES), reading a real indexed dataset (`corpus`): each spare rebuilds the
    datasets from the files, and the training and validation positions (one iterator per
    model chunk) move on as in the failure-free run."""
    run = plain_features
    job, events = _hot_swap(
        tmp_path, patched_tree / "pretrain_gpt.py",
        ["raise rank=2 iter=3 phase=forward", "hang rank=5 iter=4 phase=backward"], spares=3,
        extra=["--deadpool-progress-timeout", "5", *FEATURES],
        env={MEGATRON_FAULT: "raise rank=6 at=forward call=5"},
        model=[*REAL_DATA_MODEL, *corpus])
    recovered = check_recoveries(job, events, run.fingerprint, count=3)
    assert _spares_took(events) == [(1, [6], ["6"]), (2, [2], ["2"]), (3, [5], ["5"])]
    assert _spares_took_warm_loaders(tmp_path) == 3, job.describe()
    # Both errors came in a forward pass of the replica of ranks 2, 3, 6, 7: the other
    # replica kept the gradients of its interleaved iteration and recomputed nothing.
    for g in (1, 2):
        kept = {e["rank"] for e in recovered if e["generation"] == g and e["kept_grads"]}
        assert kept == {0, 1, 4, 5}, (g, recovered)
    detected = [(e["rank"], e["how"]) for e in events if e["event"] == "failure_detected"]
    assert detected == [(6, "exit"), (2, "exit"), (5, "hang")], detected
    assert CUDA_ERROR in job.output and "InjectedFault" in job.output, job.describe()
    assert job.output.count("Traceback (most recent call last)") >= 2, job.describe()
    verdicts = [(e["culprits"], e["certain"]) for e in events if e["event"] == "hang_localized"]
    assert verdicts == [(["w5"], True)], verdicts
    assert _validation(job.output) == _validation(run.output), job.describe()


def _restarted_after(tmp_path: Path, fault: str) -> tuple[JobResult, list[dict]]:
    """Megatron's pretrain() under deadpool-launch with --deadpool, 2 spares, Megatron's
    saves after iterations 2 and 4, and the test-only Megatron `fault`; the events."""
    events = tmp_path / "events"
    job = run_launched(["--nproc-per-node", "8", "--spares", "2", "--logical-nodes", "2"],
                       [*MODEL, "--deadpool", "--deadpool-events", str(events), "--save",
                        str(tmp_path / "ckpt"), "--save-interval", "2"],
                       tmp_path / "launch", timeout_s=700, env={**ENV, MEGATRON_FAULT: fault},
                       script=MEGATRON_GPT)
    return job, load_events(events)


@pytest.mark.fault_matrix
def test_a_nan_that_megatron_finds_on_a_whole_replica_ends_hot_swap_with_its_error(
        plain, tmp_path: Path) -> None:
    """Rank 2's layer output turns NaN in iteration 3 (faults/megatron_faults.py: 'nan', its
    7th call: iteration 3's first micro-batch, after iterations 1-2 and the evaluation
    after 2, two micro-batches of one layer each), so Megatron's own gradient check raises "found NaN in
    local grad norm" in every rank of that replica: ranks 2, 3 and 6, 7, in both failure
    domains. That is an error of the work, which a spare redoing it would meet too: hot-swap
    ends naming it (before, it ended 'the in-memory shards of ranks [2, 3, 6, 7] are lost'
    or, where the NaN's ranks came apart, took a spare for each first; the NaN was only in
    the workers' logs).
    The fallback restarts from Megatron's save after iteration 2; the test fault fires in
    the first launch only, as a transient cause would, so the run ends bit-exact."""
    job, events = _restarted_after(tmp_path, "nan rank=2 at=forward call=7")
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    assert "test fault: nan in forward (call 7)" in job.output, job.describe()
    ended = re.findall(r"hot-swap impossible: ranks \[([\d, ]+)\] failed alike in iteration "
                       r"3, in 2 failure domains \(RuntimeError: Rank \d, node \S+, device 0, "
                       r"iteration \d: Unexpected result nan \(message='found NaN in local "
                       r"grad norm", job.output)
    assert len(ended) == 1 and {2, 3, 6, 7} >= {int(r) for r in ended[0].split(", ")}, \
        job.describe()
    assert job.output.count("restarting all 8 workers with --load") == 1, job.describe()
    failed = {e["rank"] for e in events if e["event"] == "failure_detected"}
    assert failed <= {2, 3, 6, 7}, job.describe()


@pytest.mark.fault_matrix
def test_a_save_that_fails_on_every_rank_ends_hot_swap_with_its_error(
        plain, tmp_path: Path) -> None:
    """Every rank's first save (after iteration 2) fails with "No space left on device", as
    on a full file system (faults/megatron_faults.py 'raise rank=all at=save'), between two
    iterations. Alike on every rank, in both failure domains: the job's storage, which a
    spare would meet too, so hot-swap ends naming it (before, a save's error carried no
    iteration: spares were taken for the first ranks to fail, then hot-swap ended "ranks
    [2, 5] failed but only 1 spare(s) remain; start the job with more --spares", the cause
    only in the workers' logs). The restart finds no durable state (the save failed) and
    starts over, where the test fault is not installed: bit-exact."""
    job, events = _restarted_after(tmp_path, "raise rank=all at=save")
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    ended = re.findall(r"hot-swap impossible: ranks \[([\d, ]+)\] failed alike after iteration "
                       r"2, outside its training step, in 2 failure domains \(OSError: "
                       r"\[Errno 28\] No space left on device", job.output)
    assert len(ended) == 1 and len(ended[0].split(", ")) >= 2, job.describe()
    assert job.output.count("restarting all 8 workers") == 1, job.describe()
    assert "in-memory shards" not in job.output, job.describe()


@pytest.mark.fault_matrix
def test_two_gpus_hardware_errors_alike_in_one_save_are_each_hot_swapped(
        plain, tmp_path: Path) -> None:
    """Rank 1 (node 0) and rank 6 (node 1) raise "CUDA error: uncorrectable ECC error
    encountered" in their first save, after iteration 2: the same error, in the same place,
    in two failure domains, as an error of the work would be. But it names a fault of the
    GPU (control/alike.py MACHINE_SIGNS), which a spare cures: both are hot-swapped and the
    run goes on from the buddies' memory, no restart (before, hot-swap ended "failed alike
    after iteration 2 ... in 2 failure domains" and every worker restarted)."""
    job, events = _restarted_after(tmp_path, "raise rank=1,6 at=save error=ecc")
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    assert job.output.count("test fault: raise in save") == 2, job.describe()
    assert "hot-swap impossible" not in job.output and "restarting" not in job.output, \
        job.describe()
    declared = [r for e in events if e["event"] == "generation_declared"
                for r in e["failed_ranks"]]
    assert sorted(declared) == [1, 6], job.describe()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"


FLUSHED = re.compile(r"flushed the snapshot of iteration (\d+) to")


def _stopped_then_resumed(tmp_path: Path, plain: JobResult, launch: list[str],
                          extra: list[str] = (), term_at: str | None = None,
                          save_interval: int = 100, keep_copy: Path | None = None
                          ) -> tuple[JobResult, JobResult, int, dict[str, list[int]]]:
    """Megatron's loop with --save, `save_interval` (by default no Megatron save within
    its 4 iterations) and `extra`, stopped by the scheduler (SIGTERM at `term_at`, or sent
    by the caller): it ends 143 with one flushed snapshot. The relaunch with --load loads
    Megatron's save if any, then the flushed snapshot, redoes no iteration before it and
    ends with the failure-free fingerprint and validation losses. Returns both runs, the
    flushed iteration, and which ranks wrote each flushed shard ("R", or "R (copy)" for a
    buddy's stand-in copy). `keep_copy`: where the save is copied before the relaunch."""
    save, events = tmp_path / "ckpt", tmp_path / "events"
    args = [*MODEL, *CPU_FLAGS, "--deadpool", "--save", str(save), "--save-interval",
            str(save_interval), "--deadpool-events", str(events)]
    first = run_launched(launch, [*args, *extra], tmp_path / "first", timeout_s=400, env=ENV,
                         script=MEGATRON_GPT, term_at=term_at)
    assert first.returncodes == [143] and not first.timed_out, first.describe()
    flushed = [int(i) for i in FLUSHED.findall(first.output)]
    assert len(flushed) == 1 and flushed[0] >= 2, first.describe()
    assert (save / "latest_checkpointed_iteration.txt").exists() == (save_interval <= 4)
    if keep_copy is not None:
        shutil.copytree(save, keep_copy)
    second = run_launched(launch, [*args, "--load", str(save)], tmp_path / "second",
                          timeout_s=400, env=ENV, script=MEGATRON_GPT)
    assert second.ok and second.fingerprint == plain.fingerprint, second.describe()
    assert f"loaded the snapshot of iteration {flushed[0]} flushed to" in second.output, \
        second.describe()
    done = [int(i) for i in re.findall(r"iteration +(\d+)/ +4 \|", second.output)]
    assert done and min(done) == flushed[0] + 1, second.describe()
    assert _validation(second.output) == [v for v in _validation(plain.output)
                                          if int(v[0]) > flushed[0]], second.describe()
    writers: dict[str, list[int]] = {}
    for e in load_events(events):
        if e["event"] == "flushed":
            for shard in e["written"]:
                writers.setdefault(shard, []).append(e["rank"])
    return first, second, flushed[0], writers


@pytest.mark.fault_matrix
def test_a_schedulers_sigterm_in_megatrons_loop_flushes_and_a_relaunch_resumes_there(
        plain, tmp_path: Path) -> None:
    """SIGTERM to the launcher and every worker (a scheduler's time limit) after iteration
    3 of Megatron's loop: no worker dies of the signal (under hot-swap Megatron installs no
    handler of its own: the driver leaves it to the launcher), every worker writes its
    newest snapshot to --save, the launcher stops the job with 143 and says how to resume.
    The relaunch with --load reads Megatron's save after iteration 2 and then the newer
    flushed snapshot over it (before, Megatron's loop flushed nothing and the relaunch redid
    every iteration since Megatron's last save), repositions its data iterators, and ends
    with the failure-free fingerprint and validation losses."""
    launch = ["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "2"]
    damaged = tmp_path / "damaged"
    first, second, flushed, _ = _stopped_then_resumed(
        tmp_path, plain, launch, term_at="iteration        3/", save_interval=2,
        keep_copy=damaged)
    assert "SIGTERM: left to deadpool-launch" in first.output, first.describe()
    assert "exited with -15" not in first.output, first.describe()
    assert flushed >= 3 and f"relaunch with --load {tmp_path / 'ckpt'}" in first.output, \
        first.describe()
    assert re.search(r"successfully loaded checkpoint from \S+ .* at iteration 2\b",
                     second.output), second.describe()
    # The same flush with one byte of rank 5's shard changed on disk: set aside, and every
    # rank keeps the checkpoint pretrain() loaded (test_flush.py: our loop).
    damage_flushed_shard(damaged, flushed, rank=5)
    third = run_launched(launch, [*MODEL, *CPU_FLAGS, "--deadpool", "--save", str(damaged),
                                  "--save-interval", "2", "--load", str(damaged)],
                         tmp_path / "third", timeout_s=400, env=ENV, script=MEGATRON_GPT)
    assert third.ok and third.fingerprint == plain.fingerprint, third.describe()
    assert f"the snapshot of iteration {flushed} flushed to {damaged} cannot be loaded: " \
           f"rank 5: snapshot of iteration {flushed} fails its checksum; loading Megatron's " \
           f"checkpoint of iteration 2 instead" in third.output, third.describe()
    assert "loaded the snapshot of iteration" not in third.output, third.describe()
    done = [int(i) for i in re.findall(r"iteration +(\d+)/ +4 \|", third.output)]
    assert done and min(done) == 3, third.describe()
    assert (damaged / "deadpool_flush" / f"refused_iter_{flushed:07d}").is_dir()


@pytest.mark.fault_matrix
def test_a_sigterm_during_a_recovery_in_megatrons_loop_flushes_the_spares_rank_from_its_buddy(
        plain, tmp_path: Path) -> None:
    """Megatron's loop, as test_flush.py's test of our loop: rank 1 is killed in iteration
    3 and the scheduler's SIGTERM comes as a spare is declared in its place, before it has
    restored anything. Rank 1's buddy (rank 5) writes its copy as a stand-in, the flush is
    complete, and the relaunch resumes from it (no Megatron save exists) bit-exact."""
    first, _, _, writers = _stopped_then_resumed(
        tmp_path, plain, ["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "2"],
        ["--deadpool-inject", "kill rank=1 iter=3 phase=backward"],
        term_at="ranks [1] failed; spares")
    assert writers.get("1 (copy)") == [5], (writers, first.describe())


@pytest.mark.fault_matrix
def test_a_spare_that_finds_a_flush_for_its_assignment_in_megatrons_loop_reports_to_it(
        plain, tmp_path: Path) -> None:
    """Megatron's loop, as test_flush.py's test of our loop: the only spare is slow to
    start (stopped by a signal) while rank 5 is killed and it is assigned rank 5's place;
    rank 6 dies as that is declared, and host 0 declares a flush before the spare goes on.
    The spare reports holding nothing (before: it waited in the flush generation's
    rendezvous and the flush kept nothing), rank 5's buddy writes its copy, and the
    restart resumes from the flush bit-exact."""
    save, job = tmp_path / "ckpt", tmp_path / "job"
    log = job / "launcher.log"
    args = [*MODEL, *CPU_FLAGS, "--deadpool", "--save", str(save), "--save-interval", "100",
            "--deadpool-inject", "kill rank=5 iter=3 phase=backward"]
    launch = ["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "2",
              "--flush-timeout", "20"]
    with signal_worker_when(log, "epoch 0: 8 workers", "s0.0", signal.SIGSTOP) as stopped, \
            signal_worker_when(log, "ranks [5] failed; spares", "w6") as killed, \
            signal_worker_when(log, "hot-swap impossible", "s0.0", signal.SIGCONT) as resumed:
        run = run_launched(launch, args, job, timeout_s=400, env=ENV, script=MEGATRON_GPT)
    assert stopped and killed and resumed, run.describe()
    assert run.ok and run.fingerprint == plain.fingerprint, run.describe()
    assert "did not report at the flush" not in run.output, run.describe()
    spare = (job / "workers" / "epoch0" / "s0.0.log").read_text()
    assert "rank 5: flushed {} (" in spare, spare[-3000:]
    flushed = [int(i) for i in FLUSHED.findall(run.output)]
    assert len(flushed) == 1 and flushed[0] >= 2, run.describe()
    assert f"loaded the snapshot of iteration {flushed[0]} flushed to" in run.output, \
        run.describe()


@pytest.mark.fault_matrix
def test_a_sigterm_while_a_rank_is_frozen_in_megatrons_loop_flushes_its_copy_from_its_buddy(
        plain, tmp_path: Path) -> None:
    """Megatron's loop, as test_flush.py's test of our loop: rank 3 is stopped by a signal
    (SIGSTOP) as iteration 3 is logged and the scheduler's SIGTERM comes 1.5 s later,
    before its hang is found. Host 0 counts it lost, its buddy (rank 7) writes its copy,
    the stopped worker is killed at once, and the relaunch resumes bit-exact."""
    workers = tmp_path / "first" / "workers"
    # Megatron logs its iterations on the last rank.
    with signal_worker_when(workers / "epoch0" / "w7.log", "iteration        3/", "w3",
                            signal.SIGSTOP, then=sigterm_the_launcher(workers),
                            then_after_s=1.5) as frozen:
        first, _, _, writers = _stopped_then_resumed(
            tmp_path, plain, ["--nproc-per-node", "8", "--logical-nodes", "2"])
    assert frozen, first.describe()
    assert "ranks [3] are stopped by a signal (['w3'])" in first.output, first.describe()
    assert "killing worker w3: stopped by a signal" in first.output, first.describe()
    assert writers.get("3") == [7], (writers, first.describe())


@pytest.mark.fault_matrix
def test_an_error_the_spare_meets_again_ends_hot_swap_with_its_error(
        plain, tmp_path: Path) -> None:
    """A CUDA error in iteration 3's forward on whichever worker holds rank 2 (a fault of
    the work: faults/megatron_faults.py 'iter=3'): rank 2 fails, a spare takes it, redoes
    iteration 3 and fails alike. Another spare would too: hot-swap ends naming the error
    (before, each spare took it in turn until none was left, and the job ended 'start the
    job with more --spares'). The fallback restarts from Megatron's save after iteration 2,
    where the test fault is not installed, as a transient cause would pass: bit-exact."""
    job, events = _restarted_after(tmp_path, "raise rank=2 at=forward iter=3")
    assert job.ok and job.fingerprint == plain.fingerprint, job.describe()
    assert job.output.count("test fault: raise in forward") == 2, job.describe()
    assert f"hot-swap impossible: ranks [2] failed alike in iteration 3, again on the spares " \
           f"that redid their work (RuntimeError: {CUDA_ERROR})" in job.output, job.describe()
    assert job.output.count("restarting all 8 workers with --load") == 1, job.describe()
    declared = [e["failed_ranks"] for e in events if e["event"] == "generation_declared"]
    assert declared == [[2]], job.describe()


@pytest.mark.fault_matrix
def test_overlapped_communication_and_recomputation_are_hot_swapped(
        patched_tree: Path, plain, tmp_path: Path) -> None:
    """--overlap-grad-reduce --overlap-param-gather: a bucket's reduction starts inside the
    backward pass and the parameters arrive in the next forward; with full activation
    recomputation (the recomputed forward draws the same dropout masks). Kills in iteration 1's
    forward (the other replica keeps its gradients: in a first batch Megatron starts the
    buckets after the backward), iteration 2's backward (the other replica's buckets began
    reducing in its backward: nothing is kept), iteration 3's reduction and before
    iteration 4's step. train() is entered again with its buckets put back and the
    parameters gathered; the run ends with the fingerprint of the failure-free run without
    the overlap or the recomputation (the same sums, in the same buckets)."""
    run = plain
    job, events = _hot_swap(tmp_path, patched_tree / "pretrain_gpt.py", [
        "kill rank=5 iter=1 phase=forward", "kill rank=2 iter=2 phase=backward",
        "kill rank=6 iter=3 phase=reduction", "kill rank=1 iter=4 phase=optimizer"], spares=4,
        extra=["--overlap-grad-reduce", "--overlap-param-gather", "--recompute-granularity",
               "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    recovered = check_recoveries(job, events, run.fingerprint, count=4)
    # Megatron's default 2 data-loader workers a loader: each spare started its loaders'
    # workers while it waited, and pretrain()'s took them.
    assert _spares_took_warm_loaders(tmp_path) == 4, job.describe()
    gen = {g: {e["rank"]: e for e in recovered if e["generation"] == g} for g in range(1, 5)}
    kept = {g: {r for r, e in gen[g].items() if e["kept_grads"]} for g in gen}
    assert kept == {1: {2, 3, 6, 7}, 2: set(), 3: set(), 4: set()}, kept
    assert all(gen[1][r]["microbatches_recomputed"] == 0 for r in kept[1])
    assert job.losses[4] == run.losses[4], job.describe()
    assert _validation(job.output) == _validation(run.output), job.describe()


@pytest.mark.fault_matrix
def test_a_virtual_pipeline_with_overlapped_reduction_is_hot_swapped(
        patched_tree: Path, plain_features: JobResult, corpus: list[str],
        tmp_path: Path) -> None:
    """A virtual pipeline with --overlap-grad-reduce --overlap-param-gather (with FEATURES,
    as large jobs run): the interleaved schedule starts a chunk's reduction after its last
    backward, while the chunk before it still computes its own, so no stop there keeps
    gradients (kept, the replica's earlier chunk would miss a micro-batch's gradients and
    the run would end off the failure-free fingerprint). Kills in iteration 1's forward
    and iteration 3's backward: each replica recomputes its micro-batches, and the run
    ends with the fingerprint of the failure-free run without the overlap."""
    job, events = _hot_swap(
        tmp_path, MEGATRON_GPT,
        ["kill rank=5 iter=1 phase=forward", "kill rank=2 iter=3 phase=backward"], spares=2,
        extra=[*FEATURES, "--overlap-grad-reduce", "--overlap-param-gather"],
        model=[*REAL_DATA_MODEL, *corpus])
    recovered = check_recoveries(job, events, plain_features.fingerprint, count=2)
    assert _spares_took(events) == [(1, [5], ["5"]), (2, [2], ["2"])]
    assert not any(e["kept_grads"] for e in recovered), recovered
    assert all(e["microbatches_recomputed"] == 2 for e in recovered), recovered


@pytest.mark.fault_matrix
def test_spread_replay_in_megatrons_loop_deals_the_lost_microbatches_once(
        tmp_path: Path) -> None:
    """--deadpool-replay spread in Megatron's loop: a killed rank's replica lost two
    micro-batches; each replica computes one of them through Megatron's schedule (the
    replica that lost nothing on top of the gradients it kept), each loss scaled to weigh
    1/2 of the iteration. The result equals the failure-free run's up to floating-point
    reassociation (dropout off: a spread replay draws other masks); weighed as a whole
    iteration's, the share moves the parameter norm ~7e-6 (measured), past the tolerance."""
    no_dropout = [*MODEL, *CPU_FLAGS, "--hidden-dropout", "0", "--attention-dropout", "0"]
    reference = run_job(8, no_dropout, tmp_path / "reference", timeout_s=400,
                        script=MEGATRON_GPT, env=ENV)
    assert reference.ok and reference.param_norm, reference.describe()
    job, events = _hot_swap(
        tmp_path, MEGATRON_GPT,
        ["kill rank=2 iter=2 phase=backward", "kill rank=4 iter=3 phase=forward"], spares=2,
        extra=["--hidden-dropout", "0", "--attention-dropout", "0",
               "--deadpool-replay", "spread"])
    assert job.ok and job.param_norm, job.describe()
    assert _spares_took(events) == [(1, [2], ["2"]), (2, [4], ["4"])]
    recovered = [e for e in events if e["event"] == "recovered"]
    kept = {g: {e["rank"] for e in recovered if e["generation"] == g and e["kept_grads"]}
            for g in (1, 2)}
    assert kept == {1: {0, 1, 4, 5}, 2: {2, 3, 6, 7}}, kept
    computed = [(e["rank"], e["iteration"], e["microbatches_computed"]) for e in events
                if e["event"] == "replay_done"]
    assert sorted(computed) == sorted((r, i, 1) for r in range(8) for i in (2, 3)), computed
    relative = abs(job.param_norm - reference.param_norm) / reference.param_norm
    print(f"spread replay in Megatron's loop: parameter norm {job.param_norm!r} vs "
          f"failure-free {reference.param_norm!r}: relative difference {relative:.2e}")
    assert relative < SPREAD_TOLERANCE
    assert job.fingerprint != reference.fingerprint  # not bit-identical, as documented


@pytest.mark.fault_matrix
def test_a_failure_during_a_batch_size_ramp_is_hot_swapped(tmp_path: Path) -> None:
    """Megatron 0.19's batch-size ramp, --step-batch-size-schedule (--rampup-batch-size is
    deprecated there and ignored): a global batch of 4 (one micro-batch per replica) for
    the first 8 samples, then 8 (two). Kills in iteration 2's backward (batch 4) and
    iteration 3's forward (batch 8): each recovery plans with the interrupted
    iteration's own batch, every rank computes what the plan counted (check_recoveries),
    and the run ends with the failure-free fingerprint. With selective activation
    recomputation (the attention's core recomputed in the backward, its dropout masks
    drawn again: the CPU workaround recompute-rng-state)."""
    ramp = [a for i, a in enumerate(MODEL) if "--global-batch-size" not in
            MODEL[max(i - 1, 0):i + 1]] + ["--step-batch-size-schedule", "0:4 256:8",  # tokens
                                           "--recompute-granularity", "selective"]
    reference = run_job(8, [*ramp, *CPU_FLAGS], tmp_path / "reference", timeout_s=400,
                        script=MEGATRON_GPT, env=ENV)
    assert reference.ok and reference.fingerprint, reference.describe()
    batches = re.findall(r"iteration +(\d+)/ +4 \|.*?global batch size: +(\d+)",
                         reference.output)
    assert sorted(set(batches)) == [("1", "4"), ("2", "4"), ("3", "8"), ("4", "8")], batches
    job, events = _hot_swap(
        tmp_path, MEGATRON_GPT,
        ["kill rank=2 iter=2 phase=backward", "kill rank=5 iter=3 phase=forward"], spares=2,
        model=ramp)
    recovered = check_recoveries(job, events, reference.fingerprint, count=2)
    assert _spares_took(events) == [(1, [2], ["2"]), (2, [5], ["5"])]
    assert {e["microbatches_recomputed"] for e in recovered if not e["kept_grads"]} == \
        {1, 2}
