"""What every hot-swap recovery must show, in our loop and in Megatron-LM's."""

from __future__ import annotations

from deadpool_megatron.testing.jobs import JobResult

# A spread replay against the failure-free run: relative, on the L2 norm of all parameters
# at the end (reassociation leaves ~1e-10; a share weighed wrong, ~1e-5).
SPREAD_TOLERANCE = 1e-6


def check_recoveries(run: JobResult, events: list[dict], reference: str, count: int,
                     ranks: int = 8) -> list[dict]:
    """What every recovery must show (the job ran with --deadpool-audit-groups): the
    failure-free fingerprint, a clean group audit on every rank, survivors on their very
    parameter tensors within 1.1 x their memory, each rank recomputing exactly the
    micro-batches the plan counted lost and none where its replica kept its gradients, no
    group left polling. Returns the `recovered` events."""
    assert run.ok, run.describe()
    assert run.fingerprint == reference, run.describe()
    audits = [line for line in run.output.splitlines() if "group audit on rank" in line]
    assert len(audits) == ranks * count, run.describe()
    assert all(", 0 of them from an old generation" in line for line in audits), audits
    recovered = [e for e in events if e["event"] == "recovered"]
    assert sorted({e["generation"] for e in recovered}) == list(range(1, count + 1))
    for e in recovered:
        assert len([r for r in recovered if r["generation"] == e["generation"]]) == ranks
        if e["how"] != "buddy":  # a survivor: same tensors, no second copy of its state
            assert e["kept_objects"], e
            assert e["rss_peak"] <= 1.1 * e["rss_steady"], e
        done = [d for d in events if d["event"] == "replay_done" and d["rank"] == e["rank"]
                and d["t"] > e["t"] and d["iteration"] == e["last_iteration"]]
        if e["last_iteration"] > e["restored"]:
            assert done and done[0]["microbatches_computed"] == e["microbatches_recomputed"], e
        if e["kept_grads"]:
            assert e["microbatches_recomputed"] == 0, e
    released = [e for e in events if e["event"] == "groups_released"]
    assert released and all(not e["alive"] for e in released), released  # none left polling
    return recovered
