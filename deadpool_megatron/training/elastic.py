"""The generation loop of a worker under deadpool-launch: train until done; on a failure,
recover into the next generation (reconstruct/recovery.py) and go on.

Each generation's training runs in a thread of its own, so the main thread can leave a
broken generation the moment it is declared. Survivors and spares run the same code: a
spare starts by waiting for a rank, builds that rank's objects alone, and enters the
generation that gave it the rank the way a survivor enters the next one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from functools import partial
from typing import Callable, ContextManager

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.control.client import ControlClient, JobShutdown, NotAMember
from deadpool_megatron.control.failures import caused_by_a_peer
from deadpool_megatron.control.progress import ProgressBoard
from deadpool_megatron.control.policy import RecoveryImpossible
from deadpool_megatron.faults.injector import FaultInjector
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.hooks import LoopState, TrainingHooks
from deadpool_megatron.integration.device import CPU, ProcessDevice
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.metrics.errors import without_frames
from deadpool_megatron.reconstruct.recovery import CannotContinue, JobFlushed, Member
from deadpool_megatron.replay.ledger import MicrobatchLedger, ReductionBarrier
from deadpool_megatron.replay.plan import MicrobatchWork

log = logging.getLogger("deadpool_megatron.elastic")


class GenerationBroken(RuntimeError):
    """A newer generation was declared while this one was training."""


class _StopPoints(TrainingHooks):
    """Raises in a stopping training thread at the next point where its state is clean:
    any micro-batch boundary (stop_now), or only the points outside the micro-batches, so an
    intact replica finishes accumulating its gradients first (stop_before_reduction)."""

    def __init__(self) -> None:
        self.now = threading.Event()
        self.before_reduction = threading.Event()

    def _anywhere(self) -> None:
        if self.now.is_set():
            raise GenerationBroken("this generation was abandoned")

    def _between_microbatches(self) -> None:
        if self.now.is_set() or self.before_reduction.is_set():
            raise GenerationBroken("this generation was abandoned")

    def on_phase(self, phase: str, state: LoopState) -> None:
        if phase in ("forward", "microbatch", "backward"):
            self._anywhere()

    def on_iteration_start(self, state: LoopState) -> None:
        self._between_microbatches()

    def before_grad_reduction(self, state: LoopState) -> None:
        self._between_microbatches()

    def before_optimizer_step(self, state: LoopState) -> None:
        self._between_microbatches()

    def after_iteration(self, state: LoopState) -> None:
        self._between_microbatches()


class GenerationThread:
    """One generation's training in a thread of its own."""

    def __init__(self, body: Callable[[TrainingHooks], None],
                 thread_context: Callable[[], ContextManager]) -> None:
        self.stops = _StopPoints()
        self._body, self._context = body, thread_context
        self._error: BaseException | None = None
        self.error_text = ""
        self._thread = threading.Thread(target=self._target, name="deadpool-train",
                                        daemon=True)

    def _target(self) -> None:
        try:
            with self._context():
                self._body(self.stops)
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            self.error_text = traceback.format_exc()  # its frames are dropped (errors.py)
            self._error = without_frames(err)

    def run(self, declared: threading.Event) -> None:
        """Return when training ends; raise its error, or GenerationBroken as soon as a
        new generation is declared."""
        self._thread.start()
        while self._thread.is_alive():
            self._thread.join(0.005)
            if declared.is_set() and self._thread.is_alive():
                raise GenerationBroken("a new generation was declared")
        if self._error is not None:
            raise self._error

    # -- what reconstruct/recovery.py's leave needs (StoppableThread) ------------------------
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop_now(self) -> None:
        self.stops.now.set()

    def stop_before_reduction(self) -> None:
        self.stops.before_reduction.set()

    def join(self, timeout_s: float) -> bool:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def where(self) -> str:
        frame = sys._current_frames().get(self._thread.ident or -1)
        return "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "ended"


class IterationEvents(TrainingHooks):
    """Marks each completed iteration (recovery timelines, time lost), and after a recovery
    the end of the replay with the micro-batches it really computed."""

    def __init__(self, member: Member, last_replayed: int | None) -> None:
        self.member, self.last = member, last_replayed
        self.computed_before = member.ledger.computed
        self.started = time.time()

    def on_iteration_start(self, state: LoopState) -> None:
        self.started = time.time()  # the iteration's span on this rank (metrics/report.py)

    def after_iteration(self, state: LoopState) -> None:
        self.member.events.emit("step_completed", iteration=state.iteration,
                                started=self.started)
        if state.iteration == self.last:
            self.member.events.emit(
                "replay_done", iteration=state.iteration,
                microbatches_computed=self.member.ledger.computed - self.computed_before)


def _reduction_barrier() -> Callable[[], None] | None:
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    if ps.get_data_parallel_world_size(with_context_parallel=True) == 1:
        return None
    return lambda: dist.barrier(group=ps.get_data_parallel_group(with_context_parallel=True))


def _train(member: Member, dataset: object, finish: Callable[[LoopState], None],
           work: dict[int, MicrobatchWork], stops: TrainingHooks) -> None:
    from deadpool_megatron.training.loop import train

    hooks: list[TrainingHooks] = [member.ledger, stops, member.injector.hooks(), member.engine]
    if member.progress is not None:
        hooks.insert(0, member.progress.hooks())
    barrier = _reduction_barrier()
    if barrier is not None:
        hooks.append(ReductionBarrier(barrier))
    hooks.append(IterationEvents(member, max(work) if work else None))
    try:
        train(member.cfg, dataset, member.state, hooks=hooks,
              checkpointer=member.checkpointer(), replay=work)
        finish(member.state)
    finally:
        if member.progress is not None:  # a later thread may reuse this one's id
            member.progress.training_thread = None


def member_injector(ft: DeadPoolConfig, ctl: ControlClient, rank: int, sizes: object,
                    world: int, events: EventLog) -> FaultInjector:
    """The fault injector of a worker under deadpool-launch. Faults belong to the original
    workers of the first launch: neither a spare taking a rank nor a restart from the
    checkpoint re-fires them; `deadpool-inject` reaches every worker (faults/remote.py)."""
    from deadpool_megatron.faults.spec import parse_fault, target_ranks

    first_epoch = os.environ.get("DEADPOOL_EPOCH", "0") == "0"
    faults = [parse_fault(s) for s in ft.deadpool_inject]
    mine = [] if ctl.is_spare or not first_epoch else [
        f for f in faults if rank in target_ranks(f, sizes, ft.ranks_per_node(world))]
    injector = FaultInjector(mine, rank, events)
    injector.follow_control(ctl.store, ctl.worker)
    return injector


def run_elastic(cfg: TrainConfig, ft: DeadPoolConfig, ctl: ControlClient, dataset: object,
                cpu_rehearsal: bool, finish: Callable[[LoopState], None],
                thread_context: Callable[[], ContextManager],
                progress: ProgressBoard | None = None, device: ProcessDevice = CPU) -> int:
    from deadpool_megatron.integration.distributed import destroy_process_groups
    from deadpool_megatron.reconstruct.recovery import build_fresh, enter, rejoin
    from deadpool_megatron.reconstruct.rebind import MegatronGlobals
    from deadpool_megatron.reconstruct.spare import build_for_rank, warm_up_imports
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.topology import ParallelSizes

    world = int(os.environ["WORLD_SIZE"])
    try:
        if ctl.is_spare:
            warm_up_imports()
            megatron_globals = MegatronGlobals().prepare()
            log.info("spare %s ready (imports done); waiting for an assignment", ctl.worker)
            generation, rank = ctl.wait_for_assignment()
        else:
            generation, rank = 0, int(os.environ["RANK"])
    except JobShutdown as end:
        log.info("spare %s released: %s", ctl.worker, end)
        return 0
    t0 = time.perf_counter()
    events = EventLog(ft.deadpool_events, rank)
    sizes = ParallelSizes.from_world(world, cfg.tensor_model_parallel_size,
                                     cfg.pipeline_model_parallel_size)
    injector = member_injector(ft, ctl, rank, sizes, world, events)
    member = Member(cfg=cfg, ft=ft, ctl=ctl, rank=rank, world=world,
                    cpu_rehearsal=cpu_rehearsal, events=events,
                    engine=SnapshotEngine(cfg, ft, injector, events, device),
                    ledger=MicrobatchLedger(), injector=injector, dataset=dataset,
                    generation=generation, progress=progress, device=device)
    if ctl.is_spare:
        member.megatron_globals = megatron_globals
    work: dict[int, MicrobatchWork] = {}
    try:
        if ctl.is_spare:
            objs, member.registry = build_for_rank(cfg, rank, world, cpu_rehearsal)
            member.state = LoopState(iteration=0, consumed_samples=0, objects=objs)
            member.engine.attach(objs, prefault=False)  # on the recovery's path
            member.remember_identity()
            log.info("spare %s takes rank %d (generation %d); built its objects alone in "
                     "%.0f ms", ctl.worker, rank, generation, 1e3 * (time.perf_counter() - t0))
            work = enter(member, generation, t0)
        else:
            if not rejoin(member, 0):
                raise GenerationBroken("a new generation was declared before the job started")
            ctl.unwatch()
            build_fresh(member)
            if rank == 0:
                ctl.publish_replica_sources(member.engine.replica_sources())
    except JobShutdown as end:
        log.error("rank %d: job ended by the launcher: %s", rank, end)
        return 1
    except JobFlushed as flushed:
        log.warning("%s", flushed)
        return 0
    except Exception as err:  # noqa: BLE001 - a failure while joining or building
        if not caused_by_a_peer(err):
            return leave_job(member, err, traceback.format_exc())
        work = _recover(member, None, without_frames(err))

    while True:
        training = GenerationThread(partial(_train, member, dataset, finish, work),
                                    thread_context)
        try:
            declared = threading.Event()
            ctl.watch(member.generation, lambda g: declared.set())
            training.run(declared)
            ctl.unwatch()
            ctl.mark_done()
            destroy_process_groups()
            return 0
        except JobShutdown as end:
            log.error("rank %d: job ended by the launcher: %s", rank, end)
            return 1
        except (RecoveryImpossible, CannotContinue, NotAMember) as err:
            return leave_job(member, err)
        except Exception as err:  # noqa: BLE001 - a peer's failure, or this rank's own
            ctl.unwatch()
            if not caused_by_a_peer(err):
                return leave_job(member, err, training.error_text)
            broken = without_frames(err)
        # Outside the except block: an error of this rank's own during the recovery must
        # not carry the peer's error as its context (it would read as a peer's).
        work = _recover(member, training, broken)


def _recover(member: Member, training: GenerationThread | None,
             err: BaseException) -> dict[int, MicrobatchWork]:
    """Recover, again and again while failures strike during recovery."""
    from deadpool_megatron.reconstruct.recovery import recover

    while True:
        _flush_if_control_lost(member, training)
        log.warning("rank %d: generation %d broken (%s); recovering", member.rank,
                    member.generation, str(err).splitlines()[0][:160] if str(err) else err)
        try:
            return recover(member, training)
        except JobFlushed as flushed:
            log.warning("%s", flushed)
            _exit(0)
        except BaseException as again:  # noqa: BLE001 - sorted out below
            _flush_if_control_lost(member, training)
            if isinstance(again, (JobShutdown, TimeoutError)):
                log.error("rank %d: no recovery: %s", member.rank, again)
                _exit(1)
            if isinstance(again, (RecoveryImpossible, CannotContinue, NotAMember)):
                _exit(leave_job(member, again))
            if not isinstance(again, Exception) or not caused_by_a_peer(again):
                _exit(leave_job(member, again, traceback.format_exc()))
            err, training = without_frames(again), None


def _flush_if_control_lost(member: Member, training: GenerationThread | None) -> None:
    """Without the control plane no recovery can be declared: flush and leave."""
    from deadpool_megatron.reconstruct.recovery import flush_alone

    if member.ctl.control_lost.is_set():
        flush_alone(member, training)
        _exit(1)


def leave_job(member: Member, err: BaseException, details: str = "") -> int:
    """This rank cannot go on (its own error, or it cannot take part): say why, with the
    traceback, and leave at once; the launcher sees the exit and a spare replaces it."""
    from deadpool_megatron.reconstruct.groups import leave_generation

    reason = f"{type(err).__name__}: {err}"
    log.error("rank %d: leaving the job: %s%s", member.rank, reason,
              f"\n{details.rstrip()}" if details else "")
    member.ctl.report_failure(reason[:2000])
    running = member.ledger.entry.iteration if member.ledger.entry is not None else None
    member.events.emit("rank_failed", reason=reason[:300], iteration=running)
    leave_generation()
    return 3 if isinstance(err, RecoveryImpossible) else 1


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
