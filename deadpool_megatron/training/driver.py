"""The generation loop of a worker under deadpool-launch, the one both training loops use:
our pretrain_gpt.py's (training/elastic.py) and Megatron-LM's own (integration/
megatron_lm_elastic.py). Each is a `TrainingLoop`: how it makes a generation's groups and
what its training thread runs; everything else is here, once.

    a spare      waits for a rank; builds that rank's objects alone (a local world at the
                 rank's coordinates); enters the generation that gave it the rank
    a worker     joins generation 0 and builds its objects with every other rank
    then         trains; on a failure: leave -> rejoin -> rebind -> restore (reconstruct/
                 recovery.py) -> the training thread resumes with the replay's work

The training thread lives as long as the worker (training_thread.py): a survivor keeps its
objects across recoveries. The main thread watches declarations and does every step of a
recovery. A rank's own error makes it leave the job (a spare replaces it); a peer's failure
is recovered from; a failure during a recovery starts the recovery again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from functools import partial
from typing import Any, Callable, ContextManager, Protocol

from deadpool_megatron.control.client import ControlClient, JobShutdown, NotAMember
from deadpool_megatron.control.failures import caused_by_a_peer
from deadpool_megatron.control.policy import RECOVERY_IMPOSSIBLE_RC, RecoveryImpossible
from deadpool_megatron.faults.injector import FaultInjector, InjectedFault
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.hooks import LoopState, TrainingHooks
from deadpool_megatron.metrics.errors import without_frames
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.reconstruct import recovery
from deadpool_megatron.reconstruct.flushing import flush_alone
from deadpool_megatron.reconstruct.leave import STOP_TIMEOUT_S
from deadpool_megatron.reconstruct.member import CannotContinue, JobFlushed, Member, adopt
from deadpool_megatron.replay.ledger import ReductionBarrier
from deadpool_megatron.training.training_thread import (GenerationBroken, TrainingThread,
                                                        Work)

log = logging.getLogger("deadpool_megatron.elastic")


class TrainingLoop(Protocol):
    """What the generation loop needs of a training loop."""

    def groups_patched(self, timeout: timedelta) -> ContextManager:
        """What must hold while `make_groups` runs (patches of torch and Megatron): entered
        and left by the thread that waits for the creation (reconstruct/forming.py)."""

    def make_groups(self, timeout: timedelta) -> None:
        """This generation's model-parallel groups, over the default group just made."""

    def body(self, member: Member, thread: TrainingThread) -> Any:
        """The training thread: build the objects in the world at hand (a generation's, or
        a spare's local one; `thread.spare` says which), `thread.built(state)`, then
        `thread.generations(...)` with `generation_hooks`."""

    def prepare_spare(self) -> None:
        """What a spare can do before it knows its rank (imports)."""


def leave_sigterm_to_the_launcher() -> None:
    """A scheduler that stops the job signals every process of it; the launcher has the
    workers flush what they hold and then ends them, so a worker does not die of it (in
    Megatron's loop too, which installs no handler of its own under hot-swap). Called by
    each entry point as soon as it has joined the control plane, before the long build
    (datasets, model), where a SIGTERM would otherwise kill the worker. Only the main
    thread may install a handler: from another thread it says so and leaves torch's."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("SIGTERM handler not installed: the worker was started off the main "
                    "thread (%s); it keeps the disposition it started with (deadpool-launch "
                    "starts its workers ignoring SIGTERM; started otherwise, a SIGTERM ends "
                    "it at once)", threading.current_thread().name)
        return
    signal.signal(signal.SIGTERM, lambda *_: log.warning(
        "SIGTERM: left to deadpool-launch, which flushes the newest snapshots and stops"))


def run_worker(ctl: ControlClient, new_member: Callable[[int, int], Member],
               loop: TrainingLoop, thread_context: Callable[[], ContextManager]) -> int:
    """The worker's whole life under deadpool-launch; its exit code (0: training done, or a
    spare never needed)."""
    try:
        if ctl.is_spare:
            loop.prepare_spare()
            log.info("spare %s ready (imports done); waiting for an assignment", ctl.worker)
            generation, rank = ctl.wait_for_assignment()
        else:
            generation, rank = 0, int(os.environ["RANK"])
    except JobShutdown as end:
        log.info("spare %s released: %s", ctl.worker, end)
        return 0
    return _Driver(new_member(rank, generation), loop, thread_context).run()


class _Driver:
    def __init__(self, member: Member, loop: TrainingLoop,
                 thread_context: Callable[[], ContextManager]) -> None:
        self.member, self.loop, self.context = member, loop, thread_context
        self.thread: TrainingThread | None = None

    def run(self) -> int:
        member, ctl = self.member, self.member.ctl
        t0 = time.perf_counter()
        work: Work = {}
        broken: BaseException | None = None
        try:
            if ctl.is_spare:
                self._build_alone(t0)
                work = self._enter(member.generation, t0)
            else:
                if not recovery.rejoin(member, 0):
                    raise GenerationBroken("a new generation was declared before the job "
                                           "started")
                ctl.unwatch()
                self._build_together()
                if member.rank == 0:
                    ctl.publish_replica_holders(member.engine.replica_holders())
        except JobShutdown as end:
            log.error("rank %d: job ended by the launcher: %s", member.rank, end)
            return 1
        except JobFlushed as flushed:
            log.warning("%s", flushed)
            return 0
        except Exception as err:  # noqa: BLE001 - a failure while joining or building
            if not caused_by_a_peer(err):
                return fail_this_rank(member, err, traceback.format_exc())
            broken = without_frames(err)
        if broken is not None:  # outside the except block: see the loop's below
            work = self._recover(broken)

        while True:
            declared = threading.Event()
            try:
                ctl.watch(member.generation, lambda g: declared.set())
                self.thread.resume(work)
                stopped = self.thread.wait(declared)
                if stopped is None:  # training is done
                    ctl.unwatch()
                    ctl.mark_done()
                    from deadpool_megatron.integration.distributed import (
                        destroy_process_groups,
                    )

                    destroy_process_groups()
                    return 0
                if stopped.error is None:
                    raise RuntimeError("the training thread parked without an error")
                raise stopped.error
            except JobShutdown as end:
                log.error("rank %d: job ended by the launcher: %s", member.rank, end)
                return 1
            except (RecoveryImpossible, CannotContinue, NotAMember) as err:
                return fail_this_rank(member, err)
            except Exception as err:  # noqa: BLE001 - a peer's failure, or this rank's own
                ctl.unwatch()
                if not declared.is_set() and not caused_by_a_peer(err):
                    return fail_this_rank(member, err, self._error_text())
                broken = without_frames(err)
            # Outside the except block: an error of this rank's own during the recovery must
            # not carry the peer's error as its context (it would read as a peer's).
            work = self._recover(broken)

    def _error_text(self) -> str:
        thread = self.thread
        if thread is None:
            return ""
        return thread.parked.text if thread.parked is not None else thread.error_text

    # -- building ---------------------------------------------------------------------------
    def _start_thread(self, spare: bool) -> LoopState:
        """A training thread runs the loop's body until its objects are built."""
        self.thread = TrainingThread(partial(self.loop.body, self.member), self.context,
                                     spare=spare)
        self.thread.start()
        with self._building(self.thread):
            stopped = self.thread.wait(threading.Event())
        if stopped is None or stopped.error is not None or self.thread.state is None:
            raise RuntimeError(f"rank {self.member.rank}: the training loop ended before its "
                               f"objects were built")
        adopt(self.member, self.thread.state, spare)
        return self.thread.state

    def _building(self, thread: TrainingThread) -> ContextManager[None]:
        """A build as the progress board shows it: a long operation of the start-up's budget
        (--deadpool-startup-timeout), with the monitor looking at the building thread. Not
        watched, a rank hung in its build was 'nowhere', never a certain culprit: a spare
        blocked as it built alone went unfound while the survivors waiting for it crossed
        their timeouts, and one of them could be guessed hung instead; unstamped, a rank
        blocked in the job's first build was never judged at all."""
        board = self.member.progress
        stack = contextlib.ExitStack()
        if board is not None:
            # A first stamp: a worker that has stamped nothing is not judged (it may still
            # be importing), and a rank blocked in the job's first build went unfound.
            self.member.stamp("start")
            stack.enter_context(board.starting_up())
            stack.enter_context(board.watching(thread.ident or 0))
        return stack

    def _build_together(self) -> None:
        """Every rank builds its objects, as at the job's start (seeded initialisation, or
        the --load checkpoint). A previous thread, parked, leaves its body first."""
        old = self.thread
        if old is not None and not old.ended and not old.abandon(STOP_TIMEOUT_S):
            raise CannotContinue(f"rank {self.member.rank}: the training thread did not leave "
                                 f"its objects within {STOP_TIMEOUT_S:.0f} s, at:\n"
                                 f"{old.where()}")
        self.member.state, self.member.state_valid = None, False
        import gc

        gc.collect()  # a survivor's old objects go before the new ones are built
        self._start_thread(spare=False)

    def _build_alone(self, t0: float) -> None:
        """A spare: the failed rank's objects, in a local world at its coordinates."""
        from deadpool_megatron.reconstruct.groups import REBUILD_TIMEOUT_S
        from deadpool_megatron.reconstruct.spare import local_world

        member = self.member
        timeout = timedelta(seconds=REBUILD_TIMEOUT_S)
        # Seen by the hang analysis from its assignment on, its build a long operation:
        # before its first stamp (rejoin's) a spare had no view, and one frozen while it
        # built was never found: the survivors waiting for it were guessed hung instead,
        # each taking a spare (chaos soak seed 192).
        member.stamp("recovery")
        building = member.progress.starting_up() if member.progress is not None \
            else contextlib.nullcontext()
        with building, local_world(member.rank, member.world), \
                self.loop.groups_patched(timeout):
            self.loop.make_groups(timeout)
            self._start_thread(spare=True)
        log.info("spare %s takes rank %d (generation %d); built its objects alone in %.0f ms",
                 member.ctl.worker, member.rank, member.generation,
                 1e3 * (time.perf_counter() - t0))

    # -- recovering ------------------------------------------------------------------------
    def _enter(self, generation: int, t0: float) -> Work:
        return recovery.enter(self.member, generation, t0, self._build_together)

    def _recover(self, err: BaseException) -> Work:
        """Recover, again and again while failures strike during recovery. Each attempt
        goes to a generation declared after the one the last attempt went to: a peer's
        failure during a recovery breaks the generation being formed, so the launcher
        declares a newer one. An error that only reads as a peer's (this rank's own,
        wrapped) is then not tried again and again: no newer generation comes, and the
        rank leaves with it (`_declared_after`)."""
        member = self.member
        after, again_of = member.generation, None
        while True:
            self._flush_if_control_lost()
            log.warning("rank %d: generation %d broken (%s); recovering", member.rank,
                        member.generation, _first_line(err))
            target = None
            try:
                with self._watched():
                    t0 = time.perf_counter()
                    target = self._declared_after(after, again_of)
                    return recovery.recover(member, self._stoppable(), self._build_together,
                                            target, t0)
            except JobFlushed as flushed:
                log.warning("%s", flushed)
                exit_now(0)
            except BaseException as again:  # noqa: BLE001 - sorted out below
                self._flush_if_control_lost()
                if isinstance(again, (JobShutdown, TimeoutError)):
                    log.error("rank %d: no recovery: %s", member.rank, again)
                    exit_now(1)
                if isinstance(again, (RecoveryImpossible, CannotContinue, NotAMember)):
                    exit_now(fail_this_rank(member, again))
                if not isinstance(again, Exception) or not caused_by_a_peer(again):
                    exit_now(fail_this_rank(member, again, traceback.format_exc()))
                err = again_of = without_frames(again)
                after = max(member.generation, target if target is not None else after)

    def _declared_after(self, after: int, again_of: BaseException | None) -> int:
        """The newest generation declared after `after`. Waiting past the generation that a
        recovery failed to reach (`again_of`: its error) and timing out, the error is taken
        for this rank's own (CannotContinue: it leaves, and a spare replaces it)."""
        ctl = self.member.ctl
        try:
            return ctl.wait_generation_after(after)
        except TimeoutError:
            if again_of is None:
                raise
        raise CannotContinue(
            f"rank {self.member.rank}: the recovery to generation {after} failed with an error "
            f"that reads as a peer's ({_first_line(again_of)}), but no newer generation was "
            f"declared within {ctl.timeout_s:.0f} s: it is taken for this rank's own")

    def _watched(self) -> ContextManager[None]:
        """The progress monitor watches this (the main) thread while it recovers."""
        board = self.member.progress
        return board.watching(threading.get_ident()) if board is not None \
            else contextlib.nullcontext()

    def _stoppable(self) -> TrainingThread | None:
        thread = self.thread
        return thread if thread is not None and not thread.ended else None

    def _flush_if_control_lost(self) -> None:
        """Without the control plane no recovery can be declared: flush and leave."""
        if self.member.ctl.control_lost.is_set():
            flush_alone(self.member, self._stoppable())
            exit_now(1)


# -- what every generation's training runs ----------------------------------------------------
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


def _reduction_barrier(keep_groups: bool) -> Callable[[], None] | None:
    """The data-parallel barrier before the reduction, in the data-parallel group or, where
    groups are kept, a group of its own (reconstruct/keep.py: make_barrier_group).
    The group is looked up at each call: the generation's, after any rebind."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    from deadpool_megatron.reconstruct.keep import barrier_group

    if ps.get_data_parallel_world_size(with_context_parallel=True) == 1:
        return None
    if keep_groups:
        return lambda: dist.barrier(group=barrier_group())
    return lambda: dist.barrier(group=ps.get_data_parallel_group(with_context_parallel=True))


def generation_hooks(member: Member, stops: TrainingHooks, work: Work) -> list[TrainingHooks]:
    """The hooks of one generation's training, in order: progress stamps, the ledger (first
    to record), the stop points, the injector, the snapshot engine, the data-parallel
    barrier before the reduction (last at before_grad_reduction), the iteration events.
    Made in the training thread once the generation's groups exist."""
    hooks: list[TrainingHooks] = [member.ledger, stops, member.injector.hooks(), member.engine]
    if member.progress is not None:
        hooks.insert(0, member.progress.hooks())
    barrier = _reduction_barrier(member.keeps_groups)
    if barrier is not None:
        hooks.append(ReductionBarrier(barrier))
    hooks.append(IterationEvents(member, max(work) if work else None))
    return hooks


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


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0][:160] if str(err) else type(err).__name__


def fail_this_rank(member: Member, err: BaseException, details: str = "") -> int:
    """This rank cannot go on (its own error, or it cannot take part): say why, with the
    traceback, and leave at once; the launcher sees the exit and a spare replaces it."""
    from deadpool_megatron.reconstruct.groups import forget_groups

    reason = f"{type(err).__name__}: {err}"
    log.error("rank %d: leaving the job: %s%s", member.rank, reason,
              f"\n{details.rstrip()}" if details else "")
    running, after = member.ledger.failing_at()
    # The recovery's own verdicts are no error of the training work: no iteration, so never
    # alike in training to another rank's (control/alike.py). The plan's verdict
    # (RecoveryImpossible) is never alike at all, before the build either: every rank
    # reaches it by construction (chaos soak seed 215: four spares' "no snapshot iteration
    # is held..." ended the job as an error of its configuration, where the fallback
    # restarts it). Nor is an injected fault: it rehearses one rank's own failure.
    if isinstance(err, (RecoveryImpossible, CannotContinue, NotAMember)):
        running, after = None, False
    member.ctl.report_failure(reason[:2000], running, after=after, comparable=not isinstance(
        err, (InjectedFault, RecoveryImpossible)))
    member.events.emit("rank_failed", reason=reason[:300], iteration=running,
                       between_iterations=after)
    forget_groups()
    return RECOVERY_IMPOSSIBLE_RC if isinstance(err, RecoveryImpossible) else 1


def exit_now(code: int) -> None:
    """Threads of broken generations may still sit in gloo; their groups' destructors would
    block the interpreter's shutdown. os._exit skips the finalizers that end this process's
    multiprocessing children too: they are killed first, or they outlive the job (Megatron's
    checkpoint writer starts a Manager server at its first save: each worker of an epoch
    that ended left one behind, 270 MB, for good)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
