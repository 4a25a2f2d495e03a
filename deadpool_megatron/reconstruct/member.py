"""What one worker carries from generation to generation (`Member`), what its recovery
steps need of the training loop (`LoopTraits`, `StoppableThread`), and how a rank says it
cannot go on (`CannotContinue`) or has flushed (`JobFlushed`). The steps themselves:
leave.py, recovery.py, flushing.py."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Protocol

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.control.client import ControlClient
from deadpool_megatron.control.progress import ProgressBoard
from deadpool_megatron.faults.injector import FaultInjector
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.hooks import LoopState
from deadpool_megatron.integration.device import CPU, ProcessDevice
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.reconstruct import keep
from deadpool_megatron.reconstruct.abort import GenerationCut
from deadpool_megatron.reconstruct.binding import GroupBinding
from deadpool_megatron.reconstruct.forming import Forming
from deadpool_megatron.reconstruct.rebind import GroupKey, NotWalked
from deadpool_megatron.replay.ledger import MicrobatchLedger
from deadpool_megatron.replay.plan import SPARE_REPORT, RankReport
from deadpool_megatron.snapshot.engine import SnapshotEngine
from deadpool_megatron.topology import ParallelSizes, buddy_of, coord_of
from deadpool_megatron.topology.replicas import replica_holders



class StoppableThread(Protocol):
    """What `leave` needs of the broken generation's training thread (training/elastic.py)."""

    def alive(self) -> bool: ...
    def stop_now(self) -> None: ...
    def stop_before_reduction(self) -> None: ...
    def join(self, timeout_s: float) -> bool: ...
    def where(self) -> str: ...
    @property
    def ident(self) -> int | None: ...


class JobFlushed(Exception):
    """Host 0 asked for a flush (hot-swap impossible, or the job stopped): this rank wrote
    what it holds and leaves; the job restarts from the flush, or ends."""


class CannotContinue(RuntimeError):
    """This rank cannot take part in the next generation (it was declared lost, or a thread
    of the broken generation would not stop); it leaves so a spare replaces it."""


@dataclass(frozen=True)
class LoopTraits:
    """What the recovery steps need to know of the training loop that runs them (ours,
    or Megatron-LM's own: training/driver.TrainingLoop)."""

    # This generation's model-parallel groups, over its default group; None: ours for cfg.
    make_groups: Callable[[timedelta], None] | None = None
    # What must hold while make_groups runs (its patches of torch and Megatron), entered
    # and left on the main thread (reconstruct/forming.py); None: nothing (or ours for cfg).
    groups_patched: Callable[[timedelta], contextlib.AbstractContextManager] | None = None
    # Micro-batches per replica in an iteration, where a batch-size schedule varies them
    # (Megatron's --rampup-batch-size); None: cfg's, the same in every iteration.
    microbatches_of: Callable[[int], int] | None = None


@dataclass
class Member(NotWalked):
    """What one worker carries from generation to generation: first what is fixed at its
    start (its rank, configs, services, and what its loop is), then what the recovery steps
    change (the generation, the live state, the groups and the cut's bookkeeping)."""

    cfg: TrainConfig
    ft: DeadPoolConfig
    ctl: ControlClient
    rank: int
    world: int
    events: EventLog
    engine: SnapshotEngine
    ledger: MicrobatchLedger
    injector: FaultInjector
    loop: LoopTraits = LoopTraits()
    progress: ProgressBoard | None = None  # what this rank's launcher reads of its progress
    device: ProcessDevice = CPU  # set in each thread here that may touch CUDA
    # -- changed by the recovery steps --
    generation: int = 0
    state: LoopState | None = None
    state_valid: bool = False  # live objects hold a completed iteration (or a partial one
    # the ledger describes); False for a spare before its restore, or mid-restore
    groups: GroupBinding = field(default_factory=GroupBinding)  # the objects' groups
    identity: list[tuple[int, int]] = field(default_factory=list)  # params at first build
    start_iteration: int | None = None  # where this job's training began (after --load)
    gen_store: Any = None  # reconstruct/groups.GenerationStore of the generation forming
    forming: Forming | None = None  # its group creations, left behind if it is superseded
    # Sockets older than this worker's first generation (other libraries', made at start):
    # never cut. Every later one is some generation's, and a broken generation's cut takes
    # them all: a group of an older generation still in use (a reference the rebind
    # missed) must fail too, not hang on sockets that were never cut.
    sockets_before: frozenset[int] | None = None

    def cut(self, spared: frozenset[int] = frozenset()) -> GenerationCut:
        """How this generation is cut loose (its NCCL communicators, its connections but
        `spared`: those of the groups it may keep)."""
        return GenerationCut(self.ctl.endpoints, self.sockets_before or frozenset(),
                             nccl=self.cfg.distributed_backend == "nccl", spared=spared)

    @property
    def keeps_groups(self) -> bool:
        return self.ft.keeps_groups(self.cfg.distributed_backend)

    def barrier_sockets(self) -> frozenset[int]:
        """The reduction barrier's group's sockets (none where groups are not kept)."""
        if not self.keeps_groups:
            return frozenset()
        group = keep.find_barrier_group()
        return self.groups.sockets.get(id(group), frozenset()) if group is not None \
            else frozenset()

    def creating_groups(self) -> contextlib.AbstractContextManager:
        """Around the making of a generation's groups (kept ones handed back: keep.py)."""
        if not self.keeps_groups:
            return contextlib.nullcontext()
        return self.groups.creating(self.rank)

    def keepable(self, replaced: set[int], flushing: bool) -> dict[GroupKey, tuple[Any, bool]]:
        """The groups this rank may keep (keep.keepable), each with whether it can (its
        connections known and open): every member of such a group names it, so every
        member reports on it. A rank leaving a generation that never formed here (a newer
        one was declared while it formed: the objects still hold an older one's groups,
        whose connections that interruption cut or is cutting) can keep none."""
        if not self.keeps_groups or flushing:
            return {}
        found = keep.candidates(self.groups.registry, self.groups.sockets, replaced,
                                self.replica_of)
        if self.groups.bound != self.generation:
            return {key: (pg, False) for key, (pg, _) in found.items()}
        return found

    @property
    def sizes(self) -> ParallelSizes:
        return ParallelSizes.from_world(self.world, self.cfg.tensor_model_parallel_size,
                                        self.cfg.pipeline_model_parallel_size)

    def replica_of(self, rank: int) -> int:
        return coord_of(rank, self.sizes).dp

    def buddies(self) -> list[int]:
        rpn = self.ft.ranks_per_node(self.world)
        return [buddy_of(r, self.world, rpn, self.ft.deadpool_allow_same_node_buddy)
                for r in range(self.world)]

    def checkpointer(self) -> Any:
        from deadpool_megatron.integration.checkpoint import Checkpointer

        return Checkpointer(self.cfg, self.progress.durable_save if self.progress else None)

    def stamp(self, phase: str) -> None:
        """Progress of the main thread (recovery steps), for the hang analysis."""
        if self.progress is not None:
            self.progress.set_generation(self.generation)
            self.progress.stamp(phase, self.state.iteration if self.state else 0)

    def remember_identity(self) -> None:
        self.identity = _param_identity(self.state.objects)

    def objects_kept(self) -> bool:
        """The live parameters are the very tensors (same objects, same storage) built at
        this rank's start: nothing was rebuilt or reallocated."""
        return bool(self.identity) and self.identity == _param_identity(self.state.objects)

    def report(self) -> RankReport:
        if self.state is None:
            return SPARE_REPORT
        own, ward = self.engine.held()
        partial = tuple(self.engine.ward_partial())
        if not self.state_valid:
            return RankReport(tuple(own), tuple(ward), None, False, self.state.iteration,
                              ward_partial=partial)
        state, ledger = self.state, self.ledger
        live, reached = ledger.live_iteration(state), ledger.reached(state)
        return RankReport(tuple(own), tuple(ward), live, ledger.grads_intact(state), reached,
                          at_start=live == reached == self.start_iteration,
                          ward_partial=partial)

    def holders(self) -> list[tuple[int, ...]]:
        """Per rank, the data-parallel peers holding its replicated bytes, its source (the
        first on another node) first."""
        return replica_holders(self.sizes, self.ft.ranks_per_node(self.world))


def _param_identity(objs: Any) -> list[tuple[int, int]]:
    return [(id(p), p.data_ptr()) for chunk in objs.model for p in chunk.parameters()]


def adopt(member: Member, state: LoopState, spare: bool) -> None:
    """Take the objects the training thread just built: a fresh build of every rank (the
    job's start, or a recovery before any snapshot existed: nothing was trained), or a
    spare's, built alone for the failed coordinates (its groups are the local world's,
    swapped for the real ones by the rebind)."""
    member.state = state
    member.engine.attach(state.objects, prefault=not spare)  # a spare's: on the recovery's path
    member.groups.adopt(spare, member.generation)
    member.remember_identity()
    member.state_valid = not spare
    if not spare:
        member.start_iteration = state.iteration
