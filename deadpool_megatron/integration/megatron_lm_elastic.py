"""Hot-swap in Megatron-LM's own loop: Megatron's whole `pretrain()` entered again in each
generation, by every member (the survivors and the spare that took a rank).

Megatron-LM's own in-process restart does the same: `maybe_wrap_for_inprocess_restart`
(megatron/training/inprocess_restart.py) wraps `pretrain`, and between two calls
`destroy_state()` drops Megatron's global state. The patched wrapper returns `HotSwapPretrain`
instead under deadpool-launch with `--deadpool`. For each generation g it

1. meets g's members in the control plane (a spare first waits for a rank) and calls
   Megatron's `pretrain(..., store=<g's store>)` in a thread of its own
   (training/elastic.GenerationThread): Megatron makes the default and model-parallel groups,
   builds the model, optimizer and data iterators, all as at a job's start;
2. at `MegatronLoop.start` of a generation after the first (`_Recovery`, the first hook):
   the snapshot engine takes the new objects and makes g's snapshot pairs, every rank agrees
   on the plan (replay/plan.py) and restores snapshot T (survivors from their own copy, the
   spare from its buddy, which then gets its ward copy back), and Megatron's train() is left
   and entered again at T (`ReenterTrain`, integration/megatron_lm.run_train), which rebuilds
   the data iterators at T's consumed samples. Every rank recomputes whole iterations from T;
3. on a declaration (a peer died) the thread is stopped and cut loose
   (reconstruct/recovery.leave), Megatron's `destroy_state()` runs, and generation g+1
   begins with Megatron's arguments as parsed at the start. A rank's own error makes it
   leave the job, and a spare replaces it.

The hooks (snapshot engine, injector, ledger) live in the `HotSwapPretrain` object across
generations and are handed to each generation's Megatron arguments (`args.deadpool_hooks`).
A recovery costs more than in our own loop, which keeps its objects: here every member
rebuilds them (Megatron's initialisation, model, optimizer, data iterators).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, ContextManager

from deadpool_megatron.control.hang import BEFORE_FIRST_ITERATION_S
from deadpool_megatron.control.progress import StartUp
from deadpool_megatron.hooks import LoopState, TrainingHooks

log = logging.getLogger("deadpool_megatron.megatron_lm")


class HotSwapUnsupported(RuntimeError):
    """A Megatron-LM configuration that hot-swap in Megatron's own loop does not cover."""


def maybe_hot_swap(pretrain: Callable, args: argparse.Namespace) -> "HotSwapPretrain | None":
    """The patched `maybe_wrap_for_inprocess_restart`'s call: `pretrain` wrapped for
    hot-swap under deadpool-launch with --deadpool; None otherwise (Megatron's own path)."""
    if not getattr(args, "deadpool", False) or os.environ.get("DEADPOOL_WORKER_ID") is None:
        return None
    if getattr(args, "inprocess_restart", False):
        raise HotSwapUnsupported("--deadpool under deadpool-launch replaces Megatron's "
                                 "in-process restart: drop --inprocess-restart")
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None or \
            getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None:
        raise HotSwapUnsupported("hot-swap in Megatron's own loop re-enters train() with one "
                                 "data iterator: a virtual pipeline is not supported yet "
                                 "(drop --num-layers-per-virtual-pipeline-stage)")
    if getattr(args, "exit_signal_handler", False) or \
            getattr(args, "exit_signal_handler_for_training", False):
        raise HotSwapUnsupported("hot-swap sets Megatron's globals again in each generation's "
                                 "thread, where no signal handler can be installed: drop "
                                 "--exit-signal-handler (deadpool-launch handles SIGTERM)")
    from deadpool_megatron.control.client import ControlClient

    ctl = ControlClient.from_env()  # joins the control plane now, before any group
    return HotSwapPretrain(pretrain, ctl)


def inherited_thread_context(backend: str) -> Callable[[], ContextManager]:
    """What a generation's thread enters: the process's device (CUDA's current device is per
    thread) and the torch function modes active here (per thread too; the CPU rehearsal's
    is one of them)."""
    from torch.overrides import _get_current_function_mode_stack

    from deadpool_megatron.integration.device import ProcessDevice

    device = ProcessDevice.choose(backend)
    modes = _get_current_function_mode_stack()

    def enter() -> ContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(device.thread())
        for mode in modes:
            stack.enter_context(mode)
        return stack

    return enter


class HotSwapPretrain:
    """Megatron's `pretrain`, entered once per generation (see the module docstring)."""

    def __init__(self, pretrain: Callable, ctl: Any) -> None:
        import faulthandler
        import signal

        self.pretrain, self.ctl = pretrain, ctl
        # `kill -USR1 <pid>` prints every thread's stack, as for our own pretrain_gpt.py.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        self.member: Any = None
        self.recovery: _Recovery | None = None
        self._pristine: argparse.Namespace | None = None
        self._fresh_globals = True  # Megatron's globals as the script set them, unused
        self._startup: dict[str, Any] = {}
        self.progress: Any = None  # control/progress.ProgressBoard, which the launcher reads

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import megatron.training.training as training
        from megatron.training import get_args

        from deadpool_megatron.control.client import JobShutdown

        margs = get_args()
        self._pristine = copy.deepcopy(margs)  # each later generation starts from these
        # pretrain() records its start-up times in a module dict that destroy_state() keeps,
        # and all-reduces them only once set: every member's pretrain() must see the
        # script's values (a survivor's would otherwise run one all-reduce more than the
        # spare's, and both wait for ever).
        self._startup = dict(training._STARTUP_TIMESTAMPS)
        self.progress = _progress_board(margs)
        try:
            if self.ctl.is_spare:
                log.info("spare %s ready (imports done); waiting for an assignment",
                         self.ctl.worker)
                generation, rank = self.ctl.wait_for_assignment()
            else:
                generation, rank = 0, int(os.environ["RANK"])
        except JobShutdown as end:
            log.info("spare %s released: %s", self.ctl.worker, end)
            return None
        self.member = self._member(margs, rank, generation)
        self.recovery = _Recovery(self.member, time.perf_counter())
        return self._generations(args, kwargs)

    def _member(self, margs: argparse.Namespace, rank: int, generation: int) -> Any:
        from deadpool_megatron.integration.device import ProcessDevice
        from deadpool_megatron.integration.megatron_lm import deadpool_config, train_config
        from deadpool_megatron.metrics.events import EventLog
        from deadpool_megatron.reconstruct.recovery import Member
        from deadpool_megatron.replay.ledger import MicrobatchLedger
        from deadpool_megatron.snapshot.engine import SnapshotEngine
        from deadpool_megatron.topology import ParallelSizes
        from deadpool_megatron.training.elastic import member_injector

        cfg, ft = train_config(margs), deadpool_config(margs)
        world = int(os.environ["WORLD_SIZE"])
        ft.validate(world)
        events = EventLog(ft.deadpool_events, rank)
        sizes = ParallelSizes.from_world(world, cfg.tensor_model_parallel_size,
                                         cfg.pipeline_model_parallel_size)
        injector = member_injector(ft, self.ctl, rank, sizes, world, events)
        device = ProcessDevice.choose(cfg.distributed_backend)
        return Member(cfg=cfg, ft=ft, ctl=self.ctl, rank=rank, world=world,
                      cpu_rehearsal=cfg.distributed_backend == "gloo", events=events,
                      engine=SnapshotEngine(cfg, ft, injector, events, device),
                      ledger=MicrobatchLedger(), injector=injector, dataset=None,
                      generation=generation, progress=self.progress, device=device)

    # -- the generations ----------------------------------------------------------------------
    def _generations(self, args: tuple, kwargs: dict) -> Any:
        from deadpool_megatron.control.client import JobShutdown, NotAMember
        from deadpool_megatron.control.failures import caused_by_a_peer
        from deadpool_megatron.control.policy import RecoveryImpossible
        from deadpool_megatron.metrics.errors import without_frames
        from deadpool_megatron.reconstruct.recovery import CannotContinue
        from deadpool_megatron.training.elastic import GenerationThread, leave_job

        member = self.member
        context = inherited_thread_context(member.cfg.distributed_backend)
        generation = member.generation
        while True:
            result: dict[str, Any] = {}
            training = GenerationThread(
                lambda stops: result.update(value=self._pretrain(stops, args, kwargs)),
                context)
            declared = threading.Event()
            try:
                generation = self._join(generation, declared)
                if generation is None:  # a newer one was declared while forming
                    generation = self._leave_or_exit(None)
                    continue
                training.run(declared)
                self.ctl.unwatch()
                self.ctl.mark_done()
                return result.get("value")
            except JobShutdown as end:
                log.error("rank %d: job ended by the launcher: %s", member.rank, end)
                _exit(1)
            except (RecoveryImpossible, CannotContinue, NotAMember) as err:
                _exit(leave_job(member, err))
            except Exception as err:  # noqa: BLE001 - a peer's failure, or this rank's own
                self.ctl.unwatch()
                if not declared.is_set() and not caused_by_a_peer(err):
                    _exit(leave_job(member, err, training.error_text))
                broken = without_frames(err)
            log.warning("rank %d: generation %d broken (%s); Megatron's pretrain() will be "
                        "entered again", member.rank, member.generation,
                        str(broken).splitlines()[0][:160] if str(broken) else type(broken))
            generation = self._leave_or_exit(training)

    def _join(self, generation: int, declared: threading.Event) -> int | None:
        """Meet `generation`'s members (the store barrier); its groups are Megatron's to
        make, on the generation's own store. None if a newer one was declared meanwhile."""
        from deadpool_megatron.reconstruct.groups import GenerationStore, socket_inodes

        member, ctl = self.member, self.ctl
        if member.sockets_before is None:  # the first generation this worker joins
            member.sockets_before = socket_inodes()
        member.generation = generation
        store = GenerationStore(ctl, generation)
        member.gen_store = store
        # A newer declaration ends the generation: the training thread's waits on this
        # generation's store (Megatron making its groups) fail once the main thread cuts it.
        ctl.watch(generation, lambda newer: declared.set())
        if not ctl.rendezvous(generation, member.world, member.rank, waiter=store.control):
            return None
        member.stamp("recovery")  # in `generation` now (the hang analysis compares them)
        ctl.prepare_connection()  # the next generation's, in the background
        return generation

    def _pretrain(self, stops: TrainingHooks, args: tuple, kwargs: dict) -> Any:
        """The training thread's body: Megatron's arguments for this generation, with its
        rank and the hooks, then Megatron's own pretrain() on the generation's store."""
        import megatron.training.training as training
        from megatron.training import get_args
        from megatron.training.global_vars import set_global_variables

        member = self.member
        if self._fresh_globals:
            margs = get_args()
            self._fresh_globals = False
        else:
            margs = copy.deepcopy(self._pristine)
            set_global_variables(margs)
        training._STARTUP_TIMESTAMPS.clear()
        training._STARTUP_TIMESTAMPS.update(self._startup)
        os.environ["RANK"] = str(member.rank)
        margs.rank = member.rank
        startup = StartUp(member.progress, BEFORE_FIRST_ITERATION_S)
        margs.deadpool_hooks = self._hooks(stops, margs, startup)
        try:
            return self.pretrain(*args, **{**kwargs, "store": member.gen_store.store})
        finally:
            startup.close()
            if member.progress is not None:  # a later thread may reuse this one's id
                member.progress.training_thread = None

    def _hooks(self, stops: TrainingHooks, margs: argparse.Namespace,
               startup: TrainingHooks) -> list[TrainingHooks]:
        """The order matters at on_train_start: the recovery restores before the snapshot
        engine takes its first snapshot of the generation. The progress stamps come first,
        as in our own loop (training/elastic._train)."""
        from deadpool_megatron.training.elastic import IterationEvents

        member = self.member
        hooks: list[TrainingHooks] = [member.ledger, self.recovery, stops,
                                      member.injector.hooks(), member.engine,
                                      IterationEvents(member, None)]
        if member.progress is not None:
            hooks[:0] = [member.progress.hooks(), startup]
        ft = member.ft
        if ft.deadpool_verify_restore_at is not None and member.generation == 0:
            from deadpool_megatron.integration.megatron_lm import RewindRehearsal

            hooks.append(RewindRehearsal(member.engine, ft.deadpool_verify_restore_at,
                                         member.cfg.use_distributed_optimizer))
        return hooks

    def _leave_or_exit(self, training: Any) -> int:
        """Leave the broken generation; a rank that cannot take part leaves the job."""
        from deadpool_megatron.control.client import JobShutdown, NotAMember
        from deadpool_megatron.control.policy import RecoveryImpossible
        from deadpool_megatron.reconstruct.recovery import CannotContinue
        from deadpool_megatron.training.elastic import leave_job

        try:
            return self._leave(training)
        except (JobShutdown, TimeoutError) as err:
            log.error("rank %d: no recovery: %s", self.member.rank, err)
            _exit(1)
        except (RecoveryImpossible, CannotContinue, NotAMember) as err:
            _exit(leave_job(self.member, err))
        except Exception as err:  # noqa: BLE001 - this rank's own, while leaving
            _exit(leave_job(self.member, err, traceback.format_exc()))
        raise AssertionError("unreachable")

    def _leave(self, training: Any) -> int:
        """Stop the generation's thread, cut its connections, drop its groups and
        Megatron's global state; the generation to join next."""
        from megatron.training.inprocess_restart import destroy_state

        from deadpool_megatron.reconstruct.recovery import leave

        member = self.member
        self.recovery.note_leaving(member)
        if member.gen_store is not None:
            member.gen_store.cut()  # a thread waiting in Megatron's group set-up
        generation = leave(member, training, keep_intact_replicas=False)
        _flush_refused(member, generation)
        destroy_state()
        self._fresh_globals = False  # the next generation sets them from the parsed copy
        member.state = None
        gc.collect()  # the old generation's model and optimizer go before the new ones
        return generation


class _Recovery(TrainingHooks):
    """The first hook of each generation's chain. At `on_train_start` of a generation after
    the first (once per generation: train() entered again finds it done), it brings the
    objects Megatron just built to the agreed snapshot and has train() entered again there.
    t0: when this rank began its way into the generation (it began leaving the broken one,
    or, a spare, it was given a rank)."""

    def __init__(self, member: Any, t0: float) -> None:
        self.member, self.t0 = member, t0
        self.recovered = -1  # the last generation whose start was handled
        self.reached = -1  # the last iteration this rank worked on, before the failure

    def note_leaving(self, member: Any) -> None:
        self.t0 = time.perf_counter()
        if member.state is not None:
            self.reached = max(self.reached, member.ledger.reached(member.state))

    def on_train_start(self, state: LoopState) -> None:
        member = self.member
        member.state = state
        if self.recovered == member.generation:
            return
        self.recovered = member.generation
        if member.start_iteration is None:
            member.start_iteration = state.iteration
        if member.generation == 0:
            return
        self._recover(state)

    def _recover(self, state: LoopState) -> None:
        from deadpool_megatron.integration.megatron_lm import ReenterTrain
        from deadpool_megatron.reconstruct.recovery import agree, restore_to
        from deadpool_megatron.replay.plan import FRESH_START, SPARE_REPORT, RankReport

        member = self.member
        t_groups = time.perf_counter()
        member.injector.fire("recovery", member.generation)
        member.stamp("recovery")
        member.engine.attach(state.objects, prefault=not member.ctl.is_spare)
        member.engine.connect()
        if member.ctl.is_spare and self.reached < 0:
            report = SPARE_REPORT
        else:  # Megatron rebuilt the live objects: only snapshots count
            own, ward = member.engine.held()
            report = RankReport(tuple(own), tuple(ward), None, False, self.reached,
                                at_start=not own and self.reached <= (member.start_iteration or 0))
        plan, sizes = agree(member, report)
        member.stamp("recovery")
        if plan.target != FRESH_START:
            restore_to(member, plan, sizes)
            member.stamp("recovery")
        self._emit(plan, t_groups)
        if plan.target == FRESH_START:
            return  # Megatron's fresh build is the job's start: train() goes on from it
        restored = {"iteration": state.iteration, "consumed_samples": state.consumed_samples}
        raise ReenterTrain(lambda objects: restored,
                           f"recovery: generation {member.generation} restored snapshot "
                           f"{plan.target}")

    def _emit(self, plan: Any, t_groups: float) -> None:
        from deadpool_megatron.replay.plan import FRESH_START

        member, rank = self.member, self.member.rank
        how = plan.restore[rank]
        member.events.emit(
            "recovered", generation=member.generation, restored=plan.target, how=how,
            from_buddy=how == "buddy", groups_s=t_groups - self.t0,
            total_s=time.perf_counter() - self.t0, references_rebound=0,
            last_iteration=plan.last_iteration,
            microbatches_recomputed=plan.recomputed(rank),
            whole_iteration_replay=plan.whole_iteration_replay(), checkpoint_restart=0,
            kept_grads=False, kept_objects=False, pretrain_reentered=True)
        if rank == 0:
            what = "the job's start" if plan.target == FRESH_START else \
                f"snapshot {plan.target} ({plan.restore.count('buddy')} ranks from a buddy)"
            log.info("recovery: generation %d formed in Megatron's pretrain() (%.0f ms); "
                     "%s; iterations %d..%d recomputed whole", member.generation,
                     1e3 * (t_groups - self.t0), what, plan.target + 1, plan.last_iteration)


def _progress_board(margs: argparse.Namespace) -> Any:
    """What this worker's launcher reads of its progress (control/progress.py), with its
    monitor running, as in our own pretrain_gpt.py (training/main._run_elastic); None
    outside deadpool-launch."""
    from deadpool_megatron.control.progress import ProgressBoard
    from deadpool_megatron.integration.megatron_lm import deadpool_config

    board = ProgressBoard.from_env(deadpool_config(margs).deadpool_progress_timeout)
    if board is not None:
        board.start_monitor()
    return board


def _flush_refused(member: Any, generation: int) -> None:
    """Host 0 declared a flush (hot-swap impossible): Megatron's loop restarts from its own
    --save checkpoints, which our shards are not, so this rank writes nothing and leaves."""
    request = member.ctl.flush_of(generation)
    if request is None:
        return
    member.ctl.report_flushed({"rank": member.rank, "written": {}})
    member.events.emit("flushed", generation=generation, reason=request["reason"],
                       written={})
    log.warning("rank %d: hot-swap impossible (%s); leaving for a restart from Megatron's "
                "--save", member.rank, request["reason"])
    _exit(0)


def _exit(code: int) -> None:
    """Threads of broken generations may still sit in gloo; their groups' destructors would
    block the interpreter's shutdown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
