"""DeadPool's own flags (`--deadpool...`), generated from this dataclass like TrainConfig's."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from deadpool_megatron.config import ConfigError, flag
from deadpool_megatron.control.progress import BEFORE_FIRST_ITERATION_S


@dataclass
class DeadPoolConfig:
    """Defaults are what a GPU-cluster user wants: snapshot every iteration, one failure
    domain per host (torchrun's LOCAL_WORLD_SIZE), buddies always on another host."""

    deadpool: bool = field(default=False, metadata=flag("Turn the fault-tolerance layer on."))
    deadpool_snapshot_interval: int = field(
        default=1, metadata=flag("Snapshot every N iterations.")
    )
    deadpool_ranks_per_node: int | None = field(
        default=None,
        metadata=flag("Ranks per failure domain (node); on one host, logical nodes. "
                      "Default: the launcher's ranks per host (LOCAL_WORLD_SIZE)."),
    )
    deadpool_allow_same_node_buddy: bool = field(
        default=False,
        metadata=flag("Allow buddies on the same node (single-node jobs; no node-loss cover)."),
    )
    deadpool_snapshot_chunk_mb: float = field(
        default=16.0, metadata=flag("Buddy transfers stream in chunks of this many MB.")
    )
    deadpool_send_replicated: bool = field(
        default=False,
        metadata=flag("Send each snapshot's data-parallel replicated bytes (parameters; with "
                      "a plain optimizer, its state too) to the buddy as well. By default a "
                      "rank whose data-parallel peer on another node holds them sends only "
                      "its unique bytes, and a recovery takes the rest from that peer."),
    )
    deadpool_snapshot_nice: int = field(
        default=0,
        metadata=flag("Niceness added to the snapshot's threads (Linux: the worker and the "
                      "transport threads of its pair groups; 0, the default, leaves them at "
                      "the training thread's): the copy, checksums and transfers then use "
                      "the CPU time the training threads leave idle before taking theirs. "
                      "Not measured to help on 2 shared cores (docs/DESIGN.md); compare "
                      "values with tools/bench_snapshot.py --variant."),
    )
    deadpool_snapshot_timeout: float = field(
        default=120.0, metadata=flag("Seconds any snapshot transfer or commit may block.")
    )
    deadpool_inject: list[str] = field(
        default_factory=list,
        metadata=flag("Fault to inject, e.g. 'kill rank=5 iter=3 phase=backward' (repeatable).",
                      repeatable=True),
    )
    deadpool_events: str | None = field(
        default=None, metadata=flag("Write structured events (JSON lines) to this path.")
    )
    deadpool_verify_restore_at: int | None = field(
        default=None,
        metadata=flag("Restore check: at this iteration every rank replaces its live state by a "
                      "fresh model restored from its buddy's committed snapshot."),
    )

    deadpool_replay: str = field(
        default="local",
        metadata=flag("After a failure, who recomputes the lost micro-batches: 'local' (the "
                      "replica that lost them, in their order: bit-identical) or 'spread' "
                      "(dealt over all data-parallel replicas: faster, equal up to "
                      "floating-point reassociation, and not the same dropout masks).",
                      choices=["local", "spread"]),
    )
    deadpool_progress_timeout: float | None = field(
        default=None,
        metadata=flag("Seconds a rank may make no progress (outside a declared long operation, "
                      "such as a durable save) before it counts as stalled; of the stalled "
                      "ranks, the culprit is replaced. Default: 10 x the longest iteration "
                      "seen, at least 20 s (--deadpool-startup-timeout until an iteration "
                      "completed)."),
    )
    deadpool_startup_timeout: float = field(
        default=BEFORE_FIRST_ITERATION_S,
        metadata=flag("Seconds a rank may make no progress before its first iteration "
                      "(imports, building the model, optimizer and data; a spare building a "
                      "failed rank's objects alone) before it counts as stalled; of the "
                      "stalled ranks, the culprit is replaced. Lower it where builds are "
                      "quick, so that a rank hung while it builds is found sooner."),
    )
    deadpool_audit_groups: bool = field(
        default=False,
        metadata=flag("After each recovery, check that no live object holds an old group."),
    )
    deadpool_remake_groups: bool = field(
        default=False,
        metadata=flag("Make every process group again at every recovery, as NCCL always "
                      "does. By default gloo keeps each group that no failure touched and "
                      "that every member left idle and even (reconstruct/keep.py)."),
    )

    def keeps_groups(self, backend: str) -> bool:
        """Groups outlive a recovery (reconstruct/keep.py): gloo only; NCCL's communicators
        blocked on a dead peer can only be aborted (docs/DESIGN.md)."""
        return backend == "gloo" and not self.deadpool_remake_groups

    def ranks_per_node(self, world_size: int) -> int:
        if self.deadpool_ranks_per_node is not None:
            return self.deadpool_ranks_per_node
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

    def validate(self, world_size: int) -> None:
        if not self.deadpool:
            used = [f for f in ("deadpool_inject", "deadpool_verify_restore_at")
                    if getattr(self, f)]
            if used:
                raise ConfigError(f"--{used[0].replace('_', '-')} needs --deadpool")
            return
        if self.deadpool_snapshot_interval <= 0:
            raise ConfigError("--deadpool-snapshot-interval must be positive, got "
                              f"{self.deadpool_snapshot_interval}")
        if self.deadpool_snapshot_chunk_mb <= 0:
            raise ConfigError("--deadpool-snapshot-chunk-mb must be positive")
        if not 0 <= self.deadpool_snapshot_nice <= 19:
            raise ConfigError(f"--deadpool-snapshot-nice must be between 0 and 19 (a thread "
                              f"may lower its own priority only), got "
                              f"{self.deadpool_snapshot_nice}")
        if self.deadpool_snapshot_timeout <= 0:
            raise ConfigError("--deadpool-snapshot-timeout must be positive")
        if self.deadpool_progress_timeout is not None and self.deadpool_progress_timeout <= 0:
            raise ConfigError("--deadpool-progress-timeout must be positive (or left out for "
                              "the default derived from the iteration time)")
        if self.deadpool_startup_timeout <= 0:
            raise ConfigError("--deadpool-startup-timeout must be positive, got "
                              f"{self.deadpool_startup_timeout}")
        # Placement errors (single node, ranks per node not dividing) come from topology.
        from deadpool_megatron.faults.spec import parse_fault
        from deadpool_megatron.topology import buddy_map

        try:
            buddy_map(world_size, self.ranks_per_node(world_size),
                      self.deadpool_allow_same_node_buddy)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        for spec in self.deadpool_inject:
            try:
                parse_fault(spec)
            except ValueError as err:
                raise ConfigError(str(err)) from err
