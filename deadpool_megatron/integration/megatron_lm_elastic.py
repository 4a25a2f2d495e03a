"""Hot-swap in Megatron-LM's own loop: Megatron's `pretrain()` as a `TrainingLoop` of the
one generation loop (training/driver.py), on the same fast path as our own loop.

The patched `maybe_wrap_for_inprocess_restart` (megatron/training/inprocess_restart.py)
returns `HotSwapPretrain` under deadpool-launch with `--deadpool`: the user's script calls
it as it would call `pretrain`. The worker's training thread runs Megatron's `pretrain()`
once for its whole life:

- the generation's groups are made by the main thread, with Megatron's own
  initialisation (`_initialize_distributed`, so every group is named as Megatron names it),
  before `pretrain()` runs; `pretrain()` then finds them made and builds the model,
  optimizer, scheduler and data iterators as usual: every rank together at the job's start,
  or a spare alone, in a local world at the failed rank's coordinates;
- the patched `pretrain()` calls `train()` through `run_train` (integration/megatron_lm.py),
  where the thread parks between generations (`MegatronSession`): a survivor keeps every
  object, its groups are swapped by the rebind, and `train()` is entered again at the
  restored iteration; a rank's data iterator is rebuilt at the restored position only where
  it recomputes (locally: the dataset is kept); an intact replica keeps its gradients and
  computes nothing in the interrupted iteration; the others recompute their micro-batches
  through Megatron's own forward_backward_func.

Megatron's global state is set again only when every rank builds again (a failure before
any snapshot existed): the thread then leaves `pretrain()` and runs it from the top.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import logging
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, NoReturn

from deadpool_megatron.hooks import LoopState, TrainingHooks
from deadpool_megatron.integration import live
from deadpool_megatron.integration.checkpoint import megatron_saves_declared
from deadpool_megatron.integration.spare_jit import JitWarmedAhead
from deadpool_megatron.integration.spare_loaders import SpareLoaders
from deadpool_megatron.reconstruct.rebind import NotWalked

if TYPE_CHECKING:
    from deadpool_megatron.ft_config import DeadPoolConfig

log = logging.getLogger("deadpool_megatron.megatron_lm")


class HotSwapUnsupported(RuntimeError):
    """A Megatron-LM configuration that hot-swap in Megatron's own loop does not cover."""


def maybe_hot_swap(pretrain: Callable, args: argparse.Namespace) -> "HotSwapPretrain | None":
    """The patched `maybe_wrap_for_inprocess_restart`'s call: `pretrain` wrapped for
    hot-swap under deadpool-launch with --deadpool; None otherwise (Megatron's own path).
    A configuration hot-swap does not cover ends the job (`refuse_job`)."""
    if not getattr(args, "deadpool", False) or os.environ.get("DEADPOOL_WORKER_ID") is None:
        return None
    from deadpool_megatron.control.client import ControlClient

    from deadpool_megatron.training.driver import leave_sigterm_to_the_launcher

    ctl = ControlClient.from_env()  # joins the control plane now, before any group
    leave_sigterm_to_the_launcher()
    try:
        check_hot_swap(args)
    except HotSwapUnsupported as refused:
        refuse_job(refused, ctl)
    return HotSwapPretrain(pretrain, ctl)


def refuse_job(refused: HotSwapUnsupported, ctl: Any) -> NoReturn:
    """Every worker refuses the same flags: this one says why to host 0 and exits with
    CONFIG_REFUSED_RC, which ends the job with that reason (no spare is taken for a refusal
    that a spare would repeat, and no restart is tried). It leaves as a worker always does
    (driver.exit_now): an interpreter shutdown raced the control client's threads, and
    the worker died of std::terminate (SIGABRT) instead of its code, once in CI."""
    from deadpool_megatron.control.policy import CONFIG_REFUSED_RC
    from deadpool_megatron.training import driver

    reason = f"{type(refused).__name__}: {refused}"
    log.error("worker %s: %s", ctl.worker, reason)
    ctl.report_failure(reason[:2000])
    driver.exit_now(CONFIG_REFUSED_RC)


def check_hot_swap(args: argparse.Namespace) -> None:
    """Raise HotSwapUnsupported, naming the flag and what to change, for what hot-swap in
    Megatron's own loop does not cover."""
    if getattr(args, "inprocess_restart", False):
        raise HotSwapUnsupported("--deadpool under deadpool-launch replaces Megatron's "
                                 "in-process restart: drop --inprocess-restart")
    if getattr(args, "exit_signal_handler", False) or \
            getattr(args, "exit_signal_handler_for_training", False):
        raise HotSwapUnsupported("hot-swap runs Megatron's pretrain() in a thread of its own, "
                                 "where no signal handler can be installed: drop "
                                 "--exit-signal-handler (deadpool-launch handles SIGTERM)")
    unverified = unverified_features(args)
    if unverified:
        raise HotSwapUnsupported(
            f"hot-swap in Megatron's own loop is not verified with {', '.join(unverified)}: "
            f"their state (fp8 scaling history, communicators registered with buffers, "
            f"captured CUDA graphs) is not in the snapshot, and the group audit cannot see "
            f"it; drop them, or drop --deadpool (deadpool-launch then restarts the job "
            f"from --save)")
    if getattr(args, "async_save", False):
        raise HotSwapUnsupported(
            "hot-swap is not verified with --async-save: Megatron's queue of asynchronous "
            "saves lives in each process (a spare has none), and each save in it is "
            "finalized by a world all-reduce at an iteration's start that a spare would not "
            "join, with call numbers that would differ from the survivors'; and its writer "
            "is a fresh interpreter (--use-persistent-ckpt-worker), which the CPU rehearsal "
            "cannot run. Drop --async-save (snapshots make frequent durable saves "
            "unnecessary; --ckpt-assume-constant-structure and --ckpt-fully-parallel-save "
            "shorten the blocking one), or drop --deadpool (deadpool-launch then restarts "
            "the job from --save)")
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1:
        raise HotSwapUnsupported(
            f"hot-swap is not verified with --context-parallel-size {cp}: a recovery counts "
            f"replicas and their micro-batches by tensor, pipeline and data parallelism "
            f"only (a context-parallel peer would pass for a replica of its own), and "
            f"megatron-core's local attention refuses context parallelism, so no CPU "
            f"rehearsal has run it (TransformerEngine on a GPU is needed); drop it, or drop "
            f"--deadpool (deadpool-launch then restarts the job from --save)")
    spread_blocked = spread_refusals(args)
    if getattr(args, "deadpool_replay", "local") == "spread" and spread_blocked:
        raise HotSwapUnsupported(
            f"--deadpool-replay spread runs a share of an iteration's micro-batches in a "
            f"schedule of their own, each loss weighed 1/N; it is not supported with "
            f"{', '.join(spread_blocked)} (losses scaled by the whole iteration's counts, "
            f"a schedule that needs more micro-batches, or batches that change by "
            f"iteration): drop them, or drop --deadpool-replay spread (the default, local, "
            f"is bit-exact)")


def spread_refusals(args: argparse.Namespace) -> list[str]:
    """The flags of `args` with which a spread replay's share of an iteration would not
    weigh what it weighs in the whole: MoE's auxiliary losses and multi-token prediction
    are scaled by the schedule's micro-batch count, per-token loss by the iteration's
    token count; a virtual pipeline needs at least as many micro-batches as pipeline
    stages in a schedule."""
    blocked = []
    if getattr(args, "num_experts", None):
        blocked.append("--num-experts")
    if getattr(args, "mtp_num_layers", None):
        blocked.append("--mtp-num-layers")
    if getattr(args, "calculate_per_token_loss", False):
        blocked.append("--calculate-per-token-loss")
    if getattr(args, "step_batch_size_schedule", None):
        blocked.append("--step-batch-size-schedule")
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None or \
            getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None:
        blocked.append("--num-layers-per-virtual-pipeline-stage")
    return blocked


# Megatron's argument, the flag that sets it, and the value that leaves it off.
_UNVERIFIED = (("fp8", "--fp8-format", None), ("fp4", "--fp4-format", None),
               ("tp_comm_overlap", "--tp-comm-overlap", False),
               ("nccl_ub", "--use-nccl-ub", False),
               ("cuda_graph_impl", "--cuda-graph-impl", "none"),
               ("enable_cuda_graph", "--enable-cuda-graph", False),
               ("external_cuda_graph", "--external-cuda-graph", False))


def unverified_features(args: argparse.Namespace) -> list[str]:
    """The flags of `args` whose state hot-swap does not carry yet (until a GPU run shows
    it): each named as the user typed it."""
    return [flag for name, flag, off in _UNVERIFIED if getattr(args, name, off) not in (off, None)]


def inherited_thread_context(backend: str) -> Callable[[], ContextManager]:
    """What the training thread enters: the process's device (CUDA's current device is per
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
    """Megatron's `pretrain`, run by a worker of the generation loop (module docstring)."""

    def __init__(self, pretrain: Callable, ctl: Any) -> None:
        import faulthandler
        import signal

        self.pretrain, self.ctl = pretrain, ctl
        # `kill -USR1 <pid>` prints every thread's stack, as for our own pretrain_gpt.py.
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        from deadpool_megatron.integration.megatron_data import BatchSchedule
        from deadpool_megatron.integration.megatron_lm import deadpool_config, train_config
        from deadpool_megatron.integration.results_queue import ensure_watched
        from deadpool_megatron.reconstruct.member import LoopTraits
        from deadpool_megatron.training.driver import exit_now, run_worker
        from deadpool_megatron.training.elastic import new_worker_member

        margs = get_args()
        cfg, ft = train_config(margs), deadpool_config(margs)
        world = int(os.environ["WORLD_SIZE"])
        ft.validate(world)
        ensure_watched()  # the checkpoint writer's queue server ends with this worker
        progress = _progress_board(ft)
        from deadpool_megatron.integration.device import ProcessDevice

        device = ProcessDevice.choose(cfg.distributed_backend)
        loop = MegatronLmLoop(self.pretrain, args, kwargs, margs, device)
        schedule = BatchSchedule() if getattr(margs, "step_batch_size_schedule", None) \
            else None

        def new_member(rank: int, generation: int) -> Any:
            return new_worker_member(cfg, ft, self.ctl, rank, generation, world, progress,
                                     device, LoopTraits(make_groups=loop.make_groups,
                                                        groups_patched=loop.groups_patched,
                                                        microbatches_of=schedule))

        rc = run_worker(self.ctl, new_member, loop,
                        inherited_thread_context(cfg.distributed_backend))
        if rc != 0:
            exit_now(rc)
        return loop.result


class MegatronLmLoop:
    """Megatron's `pretrain()` as a `TrainingLoop` (training/driver.py)."""

    def __init__(self, pretrain: Callable, args: tuple, kwargs: dict,
                 margs: argparse.Namespace, device: Any) -> None:
        import megatron.training.training as training

        self.pretrain, self.args, self.kwargs = pretrain, args, kwargs
        self.device = device  # this process's (a spare keeps its slot's at any rank)
        self.pristine = copy.deepcopy(margs)  # Megatron's arguments as the script parsed them
        # pretrain() records its start-up times in a module dict and all-reduces them once
        # set: every build must see the script's values, or ranks run unequal collectives.
        self.startup = dict(training._STARTUP_TIMESTAMPS)
        self.fresh_globals = True  # Megatron's globals as the script set them, unused
        self.result: Any = None
        self.prebuilt: _Prebuilt | None = None  # a spare's datasets, built while it waited
        self.loaders = SpareLoaders({})  # and its data loaders' workers, started then
        self.jit = JitWarmedAhead()  # and Megatron's JIT warm-up, run then

    @contextlib.contextmanager
    def groups_patched(self, timeout: timedelta) -> Iterator[None]:
        """While the groups are made: Megatron's timeout is the creation's, and on CPU
        Megatron sees a device and shares groups of equal members."""
        from megatron.training import get_args

        margs = get_args()
        saved = margs.distributed_timeout_minutes
        margs.distributed_timeout_minutes = timeout.total_seconds() / 60
        try:
            with _rehearsal_groups_if_cpu(margs):
                yield
        finally:
            margs.distributed_timeout_minutes = saved

    def make_groups(self, timeout: timedelta) -> None:
        """Megatron's own model-parallel initialisation, over the default group just made
        (it finds the default group there and makes only Megatron's groups), inside
        `groups_patched(timeout)`."""
        from megatron.training.initialize import _initialize_distributed

        _initialize_distributed(self.kwargs.get("get_embedding_ranks"),
                                self.kwargs.get("get_position_embedding_ranks"), store=None)

    def prepare_spare(self) -> None:
        """The script imported Megatron and parsed its arguments already. While it waits, a
        spare imports what the build would import late, runs Megatron's JIT warm-up
        (spare_jit.py), and builds the datasets: Megatron's datasets are the same at every
        coordinate (the sampler, built at the assignment, takes a rank's share), and building
        them was 0.4 s of a spare's 1 s build alone (8 ranks, mock data). Without a world yet, the
        builder makes no collective. A provider that fails here is called again then."""
        import torch
        from megatron.training import training

        from deadpool_megatron.reconstruct.spare import warm_up_imports

        warm_up_imports()  # what Megatron imports only inside its build (the optimizer's)
        self.jit.warm(self.device)
        t0 = time.perf_counter()
        try:
            provider = self._provider()
            with torch.random.fork_rng(devices=[]):
                samples = list(training.get_train_valid_test_num_samples())
                self.prebuilt = _Prebuilt(provider, samples, provider(samples))
            log.info("spare: datasets built ahead in %.0f ms",
                     1e3 * (time.perf_counter() - t0))
        except Exception as err:  # noqa: BLE001 - built at the assignment instead
            log.warning("spare: the datasets could not be built ahead (%s: %s); they are "
                        "built when a rank is assigned", type(err).__name__, err)
            return
        try:
            self.loaders = SpareLoaders.start(self.prebuilt.datasets, self.device)
        except Exception as err:  # noqa: BLE001 - forked at the assignment instead
            log.warning("spare: the data loaders could not be started ahead (%s: %s); their "
                        "workers start when a rank is assigned", type(err).__name__, err)

    def _provider(self) -> Callable:
        return self.kwargs.get("train_valid_test_dataset_provider") or self.args[1]

    def _pretrain_args(self, spare: bool) -> tuple[tuple, dict]:
        """pretrain()'s arguments; a spare's provider hands over what it built ahead."""
        args, kwargs = self.args, {**self.kwargs, "store": None}
        if spare and self.prebuilt is not None:
            if "train_valid_test_dataset_provider" in kwargs:
                kwargs["train_valid_test_dataset_provider"] = self.prebuilt.provider()
            else:
                args = (args[0], self.prebuilt.provider(), *args[2:])
        return args, kwargs

    def body(self, member: Any, thread: Any) -> None:
        """The training thread: Megatron's pretrain(), whose run_train parks the thread
        between generations (MegatronSession)."""
        import megatron.training.training as training

        from deadpool_megatron.control.progress import StartUp
        from deadpool_megatron.integration.megatron_ft_setup import on_parsed_arguments

        margs = self._arguments()
        training._STARTUP_TIMESTAMPS.clear()
        training._STARTUP_TIMESTAMPS.update(self.startup)
        os.environ["RANK"] = str(member.rank)
        margs.rank = member.rank
        if thread.spare:  # its state comes from its buddy: no checkpoint to read alone
            margs.load = None
        startup = StartUp(member.progress)
        hot_swap = live.session(MegatronSession(member, thread, startup))
        saves = megatron_saves_declared(member.progress.durable_save) \
            if member.progress is not None else contextlib.nullcontext()
        loaders, self.loaders = self.loaders, SpareLoaders({})  # for this build alone
        if not thread.spare:  # building with every rank: over datasets of its own
            loaders.close()
        try:
            args, kwargs = self._pretrain_args(thread.spare)
            jit = self.jit.skipped_once() if thread.spare else contextlib.nullcontext()
            with on_parsed_arguments(), loaders.handed_over(), hot_swap, saves, jit:
                self.result = self.pretrain(*args, **kwargs)
        finally:
            startup.close()
            if member.progress is not None:  # a later thread may reuse this one's id
                member.progress.training_thread = None

    def _arguments(self) -> argparse.Namespace:
        """The script's arguments, the first time; after that (every rank builds again),
        Megatron's globals set again from a copy of them (its groups stay: this
        generation's)."""
        from megatron.training import get_args

        if self.fresh_globals:
            self.fresh_globals = False
            return get_args()
        from megatron.core.num_microbatches_calculator import (
            destroy_num_microbatches_calculator,
        )
        from megatron.core.rerun_state_machine import destroy_rerun_state_machine
        from megatron.training.global_vars import destroy_global_vars, set_global_variables

        # Not the global memory buffer: it belongs to parallel_state, made and destroyed
        # with this generation's groups (and was imported from megatron.core.utils, where
        # 0.19 has no such function: every rank failed here, alike).
        destroy_global_vars()
        destroy_num_microbatches_calculator()
        destroy_rerun_state_machine()
        margs = copy.deepcopy(self.pristine)
        set_global_variables(margs)
        return margs


class MegatronSession(NotWalked):
    """What the patched pretrain()'s `run_train` and `MegatronLoop.start` reach under
    hot-swap (`live.SESSION`): the member, its training thread, the replay's
    work, and the running iteration's micro-batch outputs (kept with its gradients)."""

    def __init__(self, member: Any, thread: Any, startup: Any) -> None:
        from deadpool_megatron.integration.megatron_lm import Accumulated

        self.member, self.thread, self.startup = member, thread, startup
        self.work: dict = {}
        self.accumulated = Accumulated()

    def run_train(self, train: Callable, call: inspect.BoundArguments) -> Any:
        """Report the objects built and park; then train generation after generation."""
        from megatron.training import get_args

        from deadpool_megatron.integration.megatron_data import data_iterator_at, validation_at
        from deadpool_megatron.integration.megatron_lm import (enter_train, left_train,
                                                               megatron_objects)

        margs = get_args()
        state = LoopState(iteration=int(margs.iteration),
                          consumed_samples=int(margs.consumed_train_samples),
                          objects=megatron_objects(call.arguments),
                          valid_consumed=int(getattr(margs, "consumed_valid_samples", 0)))
        # Iterators where pretrain() built them, not at the state's position: a spare's
        # (at sample 0, no checkpoint read), and every rank's past a flushed snapshot.
        iterators_behind = self.thread.spare or self._load_flushed(margs, state)
        self.startup.close()
        work = self.thread.built(state)

        def train_once(work: dict) -> Any:
            nonlocal iterators_behind
            self.work = work
            state = self.member.state
            margs.iteration = margs.curr_iteration = state.iteration
            margs.consumed_train_samples = state.consumed_samples
            position = _position_after_restore(work.get(state.iteration + 1),
                                               state.consumed_samples)
            if position is None and iterators_behind:
                position = state.consumed_samples
            iterators_behind = False
            if position is not None:
                call.arguments["train_data_iterator"] = data_iterator_at(
                    call.arguments["train_data_iterator"], position)
            validation_at(call.arguments, state.valid_consumed)
            left_train(state.iteration, call.arguments)
            return enter_train(train, call)

        return self.thread.generations(train_once, work)

    @staticmethod
    def _load_flushed(margs: argparse.Namespace, state: LoopState) -> bool:
        """After pretrain() loaded Megatron's newest checkpoint under --load (or none), the
        snapshot a flush wrote there if it is newer (a scheduler's stop, or a hot-swap
        that was impossible, flushed it); whether one was loaded (not where a rank found
        its shard damaged: the checkpoint stays, load_flushed)."""
        from deadpool_megatron.integration.checkpoint import load_flushed, newer_flush

        checkpoint = int(margs.iteration) if margs.iteration else None
        flushed = newer_flush(margs.load, checkpoint)
        if flushed is None:
            return False
        instead = f"Megatron's checkpoint of iteration {checkpoint}" if checkpoint \
            else "nothing (training starts from scratch)"
        return load_flushed(state, margs.load, flushed, bool(margs.use_distributed_optimizer),
                            instead)

    def hooks(self) -> list[TrainingHooks]:
        """This generation's hooks (training/driver.generation_hooks), and in generation 0
        the restore check of --deadpool-verify-restore-at."""
        from deadpool_megatron.training.driver import generation_hooks

        member = self.member
        hooks = generation_hooks(member, self.thread.stops, self.work)
        ft = member.ft
        if ft.deadpool_verify_restore_at is not None and member.generation == 0:
            from deadpool_megatron.integration.megatron_lm import RewindCheck

            hooks.append(RewindCheck(member.engine, ft.deadpool_verify_restore_at,
                                     member.cfg.use_distributed_optimizer))
        return hooks


def _position_after_restore(first: Any, consumed_samples: int) -> int | None:
    """Where a rank's training iterator must stand when train() is entered again at the
    restored iteration, whose global batch starts at `consumed_samples`; None: where it
    is. `first`: the replay's work in the iteration after the restored one. A rank that
    kept its gradients read its own micro-batches of it already; one that recomputes its
    own reads them again; a spread replay reads the ones it computes apart
    (`spread_iterator`), so its own iterator moves past the iteration."""
    if first is None or first.keep_grads:
        return None
    if first.microbatches is None:
        return consumed_samples
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size

    return consumed_samples + int(get_current_global_batch_size())


@contextlib.contextmanager
def _rehearsal_groups_if_cpu(margs: argparse.Namespace) -> Any:
    """Megatron makes its groups only where it sees a CUDA device; the CPU rehearsal
    (rehearsal/megatron_lm.py) tells it there is one, there. And its groups with equal
    members share one gloo group there (rehearsal/shared_groups.py), as in our own loop:
    in a recovery at 8 ranks the spare made Megatron's 22 groups one after another, of 7
    member sets, and every survivor waited for it in the world-sized one."""
    from deadpool_megatron.rehearsal import rehearsal_needed

    if not rehearsal_needed(margs.distributed_backend):
        yield
        return
    from deadpool_megatron.rehearsal.megatron_lm import one_cuda_device
    from deadpool_megatron.rehearsal.shared_groups import groups_shared_by_members

    with one_cuda_device(), groups_shared_by_members():
        yield


def _progress_board(ft: DeadPoolConfig) -> Any:
    """What this worker's launcher reads of its progress (control/progress.py), with its
    monitor running, as in our own pretrain_gpt.py (training/main._run_elastic); None
    outside deadpool-launch."""
    from deadpool_megatron.control.progress import ProgressBoard

    board = ProgressBoard.from_env(ft.deadpool_progress_timeout, ft.deadpool_startup_timeout)
    if board is not None:
        board.start_monitor()
    return board


class _Prebuilt:
    """Datasets a spare built while it waited, and the provider that hands them over to
    pretrain() once, for the same sample counts (otherwise it builds, as the script's)."""

    def __init__(self, provider: Callable, samples: list, datasets: Any) -> None:
        self.original, self.samples, self.datasets = provider, samples, datasets

    def provider(self) -> Callable:
        """The script's provider, wrapped."""
        import functools

        @functools.wraps(self.original)  # its signature (vp_stage) and is_distributed too
        def provide(num_samples: Any, *args: Any, **kwargs: Any) -> Any:
            if self.datasets is not None and list(num_samples) == self.samples:
                datasets, self.datasets = self.datasets, None
                log.info("spare: the datasets built ahead handed over")
                return datasets
            return self.original(num_samples, *args, **kwargs)

        return provide
