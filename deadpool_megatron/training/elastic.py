"""The generation loop of a worker under deadpool-launch: train until done; on a failure,
leave the broken generation, join the next one, restore state, and go on.

Survivors and spares run the same code: a spare simply starts by waiting for a rank.
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

import torch
import torch.distributed as dist

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.control.client import ControlClient, JobShutdown
from deadpool_megatron.control.policy import RecoveryImpossible
from deadpool_megatron.faults.injector import FaultInjector, InjectedFault
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.integration.distributed import destroy_process_groups
from deadpool_megatron.reconstruct.groups import (join_generation, leave_generation,
                                                  sever_connections)
from deadpool_megatron.training.hooks import LoopState, TrainingHooks

log = logging.getLogger("deadpool_megatron.elastic")
STOP_TIMEOUT_S = 5.0  # how long a survivor waits for its broken generation's thread to end


class GenerationBroken(RuntimeError):
    """A newer generation was declared while this one was training."""


class GenerationThread:
    """One generation's training in a thread of its own, so the main thread can leave a
    broken generation at once (gloo cannot free a collective blocked in another thread)."""

    def __init__(self, body: Callable[[TrainingHooks], None],
                 thread_context: Callable[[], ContextManager]) -> None:
        self.cancelled = threading.Event()
        self._body, self._context = body, thread_context
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._target, name="deadpool-train",
                                        daemon=True)

    def _target(self) -> None:
        try:
            with self._context():
                self._body(_StopWhenCancelled(self.cancelled))  # the loop's first hook
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            self._error = err

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

    def stop(self, timeout_s: float) -> bool:
        """Ask the thread to stop at its next safe point (_StopWhenCancelled) and wait; True if
        it ended. Called after the broken generation's connections are cut, so a thread
        blocked in a collective fails out too; one that does not end in time is left."""
        self.cancelled.set()
        if self._thread.ident is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def where(self) -> str:
        """The thread's current stack (to say where a thread that would not stop is)."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        return "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "ended"


class _StopWhenCancelled(TrainingHooks):
    """Raises in an abandoned training thread at its next micro-batch or step boundary, so it
    never touches the model, optimizer or RNG state again."""

    def __init__(self, cancelled: threading.Event) -> None:
        self.cancelled = cancelled

    def _check(self) -> None:
        if self.cancelled.is_set():
            raise GenerationBroken("this generation was abandoned")

    def on_phase(self, phase: str, state: LoopState) -> None:
        self._check()

    def before_optimizer_step(self, state: LoopState) -> None:
        self._check()

    def after_iteration(self, state: LoopState) -> None:
        self._check()


def run_elastic(cfg: TrainConfig, ft: DeadPoolConfig, ctl: ControlClient, dataset: object,
                cpu_rehearsal: bool, finish: Callable[[LoopState], None],
                thread_context: Callable[[], ContextManager]) -> int:
    from deadpool_megatron.faults.spec import parse_fault, target_ranks
    from deadpool_megatron.integration.distributed import set_seeds
    from deadpool_megatron.integration.model import build_training_objects
    from deadpool_megatron.integration.checkpoint import Checkpointer
    from deadpool_megatron.reconstruct.recovery import recover_state
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.topology import ParallelSizes
    from deadpool_megatron.training.loop import train

    world = int(os.environ["WORLD_SIZE"])
    try:
        if ctl.is_spare:
            log.info("spare %s ready (imports done); waiting for an assignment", ctl.worker)
            generation, rank = ctl.wait_for_assignment()
        else:
            generation, rank = 0, int(os.environ["RANK"])
    except JobShutdown as end:
        log.info("spare %s released: %s", ctl.worker, end)
        return 0
    events = EventLog(ft.deadpool_events, rank)
    sizes = ParallelSizes.from_world(world, cfg.tensor_model_parallel_size,
                                     cfg.pipeline_model_parallel_size)
    faults = [parse_fault(s) for s in ft.deadpool_inject]
    # Faults belong to the original workers of the first launch: neither a spare taking a
    # rank nor a restart from the checkpoint re-fires them.
    first_epoch = os.environ.get("DEADPOOL_EPOCH", "0") == "0"
    mine = [] if ctl.is_spare or not first_epoch else [
        f for f in faults if rank in target_ranks(f, sizes, ft.ranks_per_node(world))]
    injector = FaultInjector(mine, rank, events)
    engine = SnapshotEngine(cfg, ft, injector, events)
    recovering = ctl.is_spare
    failed_at: float | None = None
    old_groups: list = []  # kept only for --deadpool-audit-groups

    def _train_generation(generation: int, recovering: bool, t0: float,
                          t_groups: float, stop_hook: TrainingHooks) -> None:
            set_seeds(cfg.seed)
            state = LoopState(iteration=0, consumed_samples=0,
                              objects=build_training_objects(cfg, cpu_rehearsal))
            engine.open_generation()
            checkpointer = Checkpointer(cfg)
            if recovering:
                injector.fire("recovery", generation)
                replaced = set(ctl.replaced(generation))
                restored, from_buddy = recover_state(engine, state, replaced, generation,
                                                     cfg.use_distributed_optimizer)
                if ft.deadpool_audit_groups:
                    from deadpool_megatron.reconstruct.audit import reachable_groups, stale_groups

                    roots = [state.objects, engine]
                    stale = stale_groups(roots, old_groups)
                    log.info("group audit on rank %d: %d groups reachable from the new "
                             "generation's objects, %d of them from an old generation",
                             rank, len(reachable_groups(roots)), len(stale))
                    if stale:
                        raise RuntimeError(f"{len(stale)} old-generation groups still held")
                events.emit("recovered", generation=generation, restored=restored,
                            groups_s=t_groups - t0, total_s=time.perf_counter() - t0,
                            from_buddy=from_buddy)
                if rank == 0:
                    log.info("recovery: generation %d formed (groups rebuilt in %.0f ms); "
                             "every rank restored snapshot %d (replaced ranks %s); replaying "
                             "from iteration %d", generation, 1e3 * (t_groups - t0), restored,
                             sorted(replaced), restored + 1)
            elif cfg.load:
                checkpointer.load(state)
            train(cfg, dataset, state, hooks=[stop_hook, engine, injector.hooks()],
                  checkpointer=checkpointer,
                  on_iteration=lambda s: _first_step_after(events, s, recovering))
            finish(state)

    while True:
        trainer: GenerationThread | None = None
        try:
            t0 = time.perf_counter()
            if not join_generation(ctl, generation, rank, world, cfg):
                generation = ctl.wait_generation_after(generation)
                continue
            declared = threading.Event()
            ctl.watch(generation, lambda g: declared.set())
            t_groups = time.perf_counter()
            trainer = GenerationThread(partial(_train_generation, generation, recovering, t0,
                                               t_groups), thread_context)
            trainer.run(declared)
            ctl.unwatch()
            ctl.mark_done()
            destroy_process_groups()
            return 0
        except JobShutdown as end:
            log.error("rank %d: job ended by the launcher: %s", rank, end)
            return 1
        except (RecoveryImpossible, InjectedFault) as err:
            # This rank itself cannot go on: leave, and let the launcher see the exit.
            log.error("rank %d: leaving the job: %s", rank, err)
            ctl.report_failure(str(err))
            leave_generation()
            sys.stdout.flush()
            os._exit(3 if isinstance(err, RecoveryImpossible) else 1)
        except Exception as err:  # noqa: BLE001 - a peer failed: recover
            failed_at = time.time()
            if trainer is not None:
                trainer.cancelled.set()  # before anything it may be waiting on is released
            ctl.unwatch()
            if ft.deadpool_audit_groups:
                from deadpool_megatron.reconstruct.groups import live_groups

                old_groups += live_groups()
            engine.abandon()
            severed = sever_connections({ctl.port})
            stopped = trainer is None or trainer.stop(STOP_TIMEOUT_S)
            if not stopped:
                log.warning("rank %d: the training thread of generation %d did not stop "
                            "within %.0f s; leaving it behind, at:\n%s", rank, generation,
                            STOP_TIMEOUT_S, trainer.where())
            leave_generation()
            events.emit("abort", generation=generation, error=str(err)[:300],
                        severed=severed, thread_stopped=stopped)
            log.warning("rank %d: generation %d broken (%s); waiting for the next one",
                        rank, generation, str(err).splitlines()[0][:160])
            try:
                new_generation = ctl.wait_generation_after(generation)
            except (JobShutdown, TimeoutError) as end:
                log.error("rank %d: no recovery: %s", rank, end)
                return 1
            members = ctl.members(new_generation)
            if members.get(rank) != ctl.worker:
                log.error("rank %d: declared failed in generation %d; exiting", rank,
                          new_generation)
                return 1
            events.emit("left_generation", generation=generation, next=new_generation,
                        after_s=time.time() - failed_at)
            generation, recovering = new_generation, True

def _first_step_after(events: EventLog, state: LoopState, recovering: bool) -> None:
    if recovering:
        events.emit("step_completed", iteration=state.iteration)
