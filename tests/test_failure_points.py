"""Only the failed coordinates change (issue 8's acceptance): a rank killed at each point of
an iteration, from the first iteration on, in TP2 x PP2 x DP2 with the distributed optimizer
and TP2 x DP4 without it. Every run ends with the failure-free fingerprint; every survivor
keeps its very parameter tensors and at most 1.1 x its memory; each rank recomputes exactly
the micro-batches the plan said were lost, none on a replica that lost nothing; no object
holds an old group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import GPT_3D_ARGS
from recoveries import SPREAD_TOLERANCE, check_recoveries
from deadpool_megatron.faults.megatron_faults import ENV as MEGATRON_FAULT
from deadpool_megatron.testing.jobs import JobResult, run_job, run_launched

pytestmark = [pytest.mark.multiproc, pytest.mark.fault_matrix]
ITERS = 8
ENV = {"DEADPOOL_CONTROL_TIMEOUT_S": "90"}
TP2_DP4 = [a for a in GPT_3D_ARGS if a != "--use-distributed-optimizer"]
TP2_DP4[TP2_DP4.index("--pipeline-model-parallel-size") + 1] = "1"


def _launch(tmp: Path, args: list[str], faults: list[str], spares: int,
            launch: tuple[str, ...] = ()) -> tuple[JobResult, list[dict]]:
    """The job with every fault of `faults`, one after another (each taken by a spare)."""
    events = tmp / "events"
    # Small chunks: a sender killed after its first chunk leaves a torn copy.
    args = [*args, "--train-iters", str(ITERS), "--deadpool", "--deadpool-events", str(events),
            "--deadpool-audit-groups", "--deadpool-snapshot-chunk-mb", "0.05"]
    for fault in faults:
        args += ["--deadpool-inject", fault]
    run = run_launched(["--nproc-per-node", "8", "--spares", str(spares), "--logical-nodes", "2",
                        *launch], args, tmp, timeout_s=500, env=ENV)
    out = []
    for path in events.parent.glob(events.name + ".rank*"):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return run, sorted(out, key=lambda e: e["t"])


@pytest.fixture(scope="module")
def tp2_dp4_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    run = run_job(8, [*TP2_DP4, "--train-iters", str(ITERS)],
                  tmp_path_factory.mktemp("tp2_dp4_reference"), timeout_s=300)
    assert run.ok, run.describe()
    return run.fingerprint


def test_every_point_of_an_iteration_3d_distributed_optimizer(
        tmp_path: Path, failure_free_8: JobResult) -> None:
    faults = ["kill rank=5 iter=1 phase=forward",  # the first iteration
              "kill rank=2 iter=2 phase=snapshot",  # snapshot 2 torn on the wire
              "kill rank=6 iter=5 phase=reduction",  # after every replica began reducing
              "kill rank=1 iter=7 phase=optimizer",  # just before the optimizer step
              "kill rank=3 iter=8 phase=backward wait=commit"]
    run, events = _launch(tmp_path, [*GPT_3D_ARGS], faults, spares=5)
    recovered = check_recoveries(run, events, failure_free_8.fingerprint, count=5)
    by_gen = {g: [e for e in recovered if e["generation"] == g] for g in range(1, 6)}
    # Iteration 1: everyone stands on the starting state's snapshot; replica 1 kept its
    # gradients of iteration 1 and recomputes nothing.
    assert {e["restored"] for e in by_gen[1]} == {0}
    assert {e["rank"] for e in by_gen[1] if e["kept_grads"]} == {2, 3, 6, 7}
    # ... and every survivor kept some groups (reconstruct/keep.py); after a reduction had
    # begun (generations 3 and 4), none.
    assert all(e["groups_kept"] > 0 for e in by_gen[1] if e["rank"] != 5), by_gen[1]
    assert not any(e["groups_kept"] for g in (3, 4) for e in by_gen[g])
    # Snapshot 2 torn on rank 2's buddy: back to 1 from each rank's own copy, iteration 2 redone.
    assert {e["restored"] for e in by_gen[2]} == {1}
    # A reduction that had begun is never trusted: both replicas recompute iteration 5.
    assert not any(e["kept_grads"] for e in by_gen[3])
    assert all(e["microbatches_recomputed"] >= 4 for e in by_gen[3])
    # Backward of iteration 8 in rank 3's replica: the other one keeps its gradients.
    assert {e["rank"] for e in by_gen[5] if e["kept_grads"]} == {0, 1, 4, 5}


def test_every_point_tp2_dp4_plain_optimizer(tmp_path: Path, tp2_dp4_reference: str) -> None:
    """Also the way NCCL recovers, every group made again (--deadpool-remake-groups)."""
    faults = ["kill rank=3 iter=1 phase=snapshot",  # snapshot 1 in flight: back to the start
              "kill rank=4 iter=4 phase=backward wait=commit",  # three replicas keep their grads
              "kill rank=7 iter=6 phase=forward",
              "kill rank=0 iter=7 phase=reduction",
              "kill rank=5 iter=8 phase=optimizer"]
    run, events = _launch(tmp_path, [*TP2_DP4, "--deadpool-remake-groups"], faults, spares=5)
    recovered = check_recoveries(run, events, tp2_dp4_reference, count=5)
    assert not any(e["groups_kept"] for e in recovered)
    second = [e for e in recovered if e["generation"] == 2]
    assert {e["rank"] for e in second if e["kept_grads"]} == {0, 1, 2, 3, 6, 7}
    assert {e["rank"]: e["microbatches_recomputed"] for e in second if not e["kept_grads"]} \
        == {4: 2, 5: 2}  # global batch 8 over DP4: two micro-batches per replica
    assert not any(e["kept_grads"] for e in recovered if e["generation"] == 4)  # reducing


def test_spread_replay_deals_the_lost_microbatches_once(tmp_path: Path) -> None:
    """`--deadpool-replay spread`: replica 2's two lost micro-batches are computed once each,
    by two replicas; the result equals the failure-free run's up to floating-point
    reassociation (dropout off: spread replays draw other masks)."""
    no_dropout = [*TP2_DP4, "--hidden-dropout", "0", "--attention-dropout", "0"]
    reference = run_job(8, [*no_dropout, "--train-iters", str(ITERS)], tmp_path / "reference",
                        timeout_s=300)
    assert reference.ok, reference.describe()
    run, events = _launch(tmp_path / "spread", [*no_dropout, "--deadpool-replay", "spread"],
                          ["kill rank=4 iter=4 phase=backward wait=commit"], spares=1)
    assert run.ok, run.describe()
    computed = {e["rank"]: e["microbatches_computed"] for e in events
                if e["event"] == "replay_done"}
    assert sum(computed.values()) == 2 * 2, computed  # 2 micro-batches x 2 tensor-parallel ranks
    assert max(computed.values()) == 1, computed
    relative = abs(run.param_norm - reference.param_norm) / reference.param_norm
    print(f"spread replay: parameter norm {run.param_norm!r} vs failure-free "
          f"{reference.param_norm!r}: relative difference {relative:.2e}")
    assert relative < SPREAD_TOLERANCE
    assert run.fingerprint != reference.fingerprint  # not bit-identical, as documented


def test_a_rank_lost_with_its_source_is_hot_swapped_from_the_next_holder(
        tmp_path: Path, tp2_dp4_reference: str) -> None:
    """TP2 x DP4, plain optimizer (every optimizer byte replicated): ranks 2 and 4 die in
    one iteration, on two nodes. Rank 4 is rank 2's data-parallel source, rank 0 rank 4's;
    their buddies hold only their unique bytes. Ranks 6 and 0 hold the same replicated
    bytes (topology/replicas.py): host 0 takes the hot swap, rank 2's region comes from 6
    and rank 4's from 0, and the run ends with the failure-free fingerprint (before: 'the
    replicated bytes of ranks [2] are lost', a flush and a restart from the checkpoint)."""
    run, events = _launch(tmp_path, TP2_DP4, ["kill rank=2 iter=4 phase=optimizer",
                                              "kill rank=4 iter=4 phase=optimizer"],
                          spares=2, launch=("--failure-window", "2.0"))
    assert "restarting all" not in run.output, run.describe()
    assert [e["failed_ranks"] for e in events if e["event"] == "generation_declared"] == \
        [[2, 4]], run.describe()
    recovered = check_recoveries(run, events, tp2_dp4_reference, count=1)
    assert sorted(e["rank"] for e in recovered if e["how"] == "buddy") == [2, 4], recovered
    taken = {(e["source"], e["to"]) for e in events
             if e["event"] == "replicated_region_moved" and e["role"] == "spare"}
    assert taken == {(6, 2), (0, 4)}, run.describe()


def test_a_source_killed_inside_a_replica_fetch_hands_the_region_to_the_next_holder(
        tmp_path: Path, tp2_dp4_reference: str) -> None:
    """TP2 x DP4: rank 2 is killed and its spare takes the replicated region of its shard
    from rank 4, its data-parallel source on the other node, over a two-rank group the two
    make alone. Rank 4 is killed inside that group's gloo creation, after publishing its
    address (a test-only fault): the spare waits to be connected, which no cut ends.
    - The fetch's group is made like the generation's others (reconstruct/forming.py): the
      next declaration leaves it behind, and no rank is taken for hung (before, the spare
      stayed in the superseded generation and was replaced as hung).
    - The spare's own copy then lacks its replicated region: that copy is not held
      (before, the next plan restored rank 2 from it, the region's stale bytes, and the
      run ended 'ok' with a wrong model: parameter norm 1.4e11).
    - Ranks 6 and 0 hold the same bytes as rank 4 (topology/replicas.py: the holders): the
      next plan takes rank 2's region from 6 and rank 4's from 0, and the job goes on
      hot-swapped, bit-exact (before, hot-swap ended, 'the replicated bytes of ranks [2]
      are lost', and the job restarted from its durable state)."""
    events = tmp_path / "events"
    args = [*TP2_DP4, "--train-iters", str(ITERS), "--deadpool", "--deadpool-events",
            str(events), "--deadpool-inject", "kill rank=2 iter=3 phase=backward",
            "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    run = run_launched(["--nproc-per-node", "8", "--spares", "2", "--logical-nodes", "2"],
                       args, tmp_path, timeout_s=500,
                       env={**ENV, MEGATRON_FAULT: "kill rank=4 at=fetch call=1",
                            "GLOO_SOCKET_IFNAME": "lo"})
    found = sorted((json.loads(line) for path in events.parent.glob(events.name + ".rank*")
                    for line in path.read_text().splitlines()), key=lambda e: e["t"])
    assert run.ok and run.fingerprint == tp2_dp4_reference, run.describe()
    assert "test fault: kill in a replica fetch (call 1)" in run.output, run.describe()
    assert "restarting all" not in run.output, run.describe()
    assert [e["failed_ranks"] for e in found if e["event"] == "generation_declared"] == \
        [[2], [4]], run.describe()
    assert not [e for e in found if e["event"] == "hang_localized"], run.describe()
    # (ranks outside the broken fetch may have recovered generation 1 first)
    recovered = [e for e in found if e["event"] == "recovered" and e["generation"] == 2]
    assert len(recovered) == 8, recovered
    assert sorted(e["rank"] for e in recovered if e["how"] == "buddy") == [2, 4], recovered
    taken = {(e["source"], e["to"]) for e in found
             if e["event"] == "replicated_region_moved" and e["role"] == "spare"}
    assert taken == {(6, 2), (0, 4)}, run.describe()
