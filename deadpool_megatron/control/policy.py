"""Recovery policies as pure functions over plain data (testable at 100,000 ranks)."""

from __future__ import annotations

from dataclasses import dataclass

from deadpool_megatron.topology import lost_shards
from deadpool_megatron.topology.replicas import replicas_lost


class RecoveryImpossible(RuntimeError):
    """Hot-swap cannot restore the job; the message names ranks and generation."""


# A worker's exit code when the ranks found no recovery together (RecoveryImpossible: the
# plan every rank computes alike): host 0 ends the epoch with that reason.
RECOVERY_IMPOSSIBLE_RC = 3
# A worker's exit code when it refused the job's configuration at its start (a flag
# hot-swap does not cover): every worker, spares too, would refuse it alike, so host 0 ends
# the job with that reason: no spare taken, no restart.
CONFIG_REFUSED_RC = 4


@dataclass(frozen=True)
class Assignment:
    generation: int  # the generation this membership opens
    rank_to_worker: dict[int, str]  # global rank -> worker id ("w3", "s1", ...)
    replaced: dict[int, str]  # failed rank -> the spare that takes its place


def assign_spares(generation: int, current: dict[int, str], failed: set[int],
                  free_spares: list[str], avoid_hosts: dict[int, set[int]] | None = None,
                  spare_host: dict[str, int] | None = None) -> Assignment:
    """Give each failed rank (lowest first) a free spare, in launch order, preferring one
    whose host is not in avoid_hosts[rank] (the hosts of the rank's buddy and ward), so
    that one host's loss never takes a shard and its copy together."""
    if len(failed) > len(free_spares):
        raise RecoveryImpossible(
            f"generation {generation}: ranks {sorted(failed)} failed but only "
            f"{len(free_spares)} spare(s) remain ({free_spares}); start the job with more "
            f"--spares")
    free = list(free_spares)
    replaced: dict[int, str] = {}
    for rank in sorted(failed):
        avoid = (avoid_hosts or {}).get(rank, set())
        pick = next((s for s in free if (spare_host or {}).get(s) not in avoid), free[0])
        free.remove(pick)
        replaced[rank] = pick
    members = {**current, **replaced}
    return Assignment(generation + 1, members, replaced)


def check_recoverable(generation: int, failed: set[int], world_size: int,
                      ranks_per_node: int, allow_same_node: bool,
                      holders: list[list[int]] | None = None) -> None:
    """Refuse when a failed rank's buddy copy died too (shard and copy both lost), or when
    its replicated bytes, which only its data-parallel peers hold (`holders`, see
    topology/replicas.py), died with every one of them."""
    lost = lost_shards(failed, world_size, ranks_per_node, allow_same_node)
    if lost:
        raise RecoveryImpossible(
            f"generation {generation}: the in-memory shards of ranks {sorted(lost)} are lost "
            f"(each rank and the buddy holding its copy failed together: failed ranks "
            f"{sorted(failed)})")
    gone = replicas_lost(failed, holders) if holders is not None else set()
    if gone:
        raise RecoveryImpossible(
            f"generation {generation}: the replicated bytes of ranks {sorted(gone)} are lost "
            f"(their buddies hold only their unique bytes, and each one's data-parallel "
            f"holders, {[list(holders[r]) for r in sorted(gone)]}, failed too; "
            f"--deadpool-send-replicated keeps whole copies at the buddies)")


def common_generation(committed: list[int | None]) -> int | None:
    """The newest generation every survivor can restore: the minimum of their commits."""
    known = [c for c in committed if c is not None]
    if not known or len(known) != len(committed):
        return None
    return min(known)

