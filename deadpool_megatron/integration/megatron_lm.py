"""Megatron-LM's own training loop, as patched by patches/, reaches DeadPool here.

The patched `train()` and `train_step()` in megatron/training/training.py make a handful of
calls into `MegatronLoop`; every decision is made here, through the same `TrainingHooks`
and `LoopState` our own loop (training/loop.py) drives, so both loops share every line of
the fault-tolerance layer. The hook points land in Megatron's loop as in ours:

    on_train_start      MegatronLoop.start(), once the model, optimizer and scheduler exist
    on_iteration_start  iteration_start(), just before train_step()
    on_phase(...)       the wrapped forward_step_func: 'forward' (first micro-batch),
                        'backward' (its backward begins), 'microbatch' (each later one)
    before_grad_reduction, on_phase('reduction')
                        the wrapped config.finalize_model_grads_func (the DP reduction)
    before_optimizer_step, on_phase('step')
                        before_optimizer_step(), just before optimizer.step()
    after_iteration     after_iteration(), once iteration and consumed samples advanced
    on_train_end        end(), after the while loop

The patched pretrain() calls train() through `run_train`, which can leave train() and enter
it again at a restored iteration (`ReenterTrain`): the way back into Megatron's own loop
after its state was restored from a snapshot. The hooks, the snapshot engine with them, stay
the same across entries (`live.HOOKS`, not on args: Megatron's saves copy and pickle
args). Under deadpool-launch, hot-swap parks the
training thread in `run_train` between generations and enters train() again there
(megatron_lm_elastic.MegatronSession), with each generation's hooks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from deadpool_megatron.config import ConfigError, TrainConfig, add_arguments, from_namespace
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.hooks import HookChain, LoopState, TrainingHooks
from deadpool_megatron.integration import ddp_overlap, live
from deadpool_megatron.integration.megatron_data import (data_iterator_at, evaluated,
                                                         validation_at)
from deadpool_megatron.reconstruct.rebind import NotWalked


class ReenterTrain(Exception):
    """Raised by a hook inside Megatron's train() at an iteration boundary: `run_train`
    leaves train(), restores the state `restore` returns (its small objects: iteration,
    consumed_samples) and enters train() again there."""

    def __init__(self, restore: Callable[[Any], dict[str, Any]], why: str) -> None:
        super().__init__(why)
        self.restore = restore


def add_deadpool_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `--deadpool...` flags, in Megatron's parser (the patched add_megatron_arguments)."""
    add_arguments(parser, DeadPoolConfig, "deadpool")
    return parser


def deadpool_config(args: argparse.Namespace) -> DeadPoolConfig:
    return from_namespace(DeadPoolConfig, args)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """Our TrainConfig from Megatron's args: our flags carry Megatron's names, so the fields
    Megatron has are taken as they are; the rest keep their defaults."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
              if getattr(args, f.name, None) is not None}
    return TrainConfig(**values)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def fault_tolerance_hooks(args: argparse.Namespace) -> list[TrainingHooks]:
    """The hooks `--deadpool` adds to Megatron's loop (none without it)."""
    ft = deadpool_config(args)
    world = _world_size()
    ft.validate(world)
    if not ft.deadpool:
        return []
    if os.environ.get("DEADPOOL_WORKER_ID") is not None:
        from deadpool_megatron.integration.megatron_lm_elastic import HotSwapUnsupported

        # The hot-swap wrapper sets the session (live.SESSION); it is not there.
        raise HotSwapUnsupported(
            "--deadpool under deadpool-launch (hot-swap) needs pretrain() wrapped as upstream "
            "pretrain_gpt.py does: `pretrain, store = inprocess_restart."
            "maybe_wrap_for_inprocess_restart(pretrain)`, then `pretrain(..., store=store)`; "
            "or drop --deadpool (deadpool-launch then restarts the job from --save).")
    from deadpool_megatron.integration.device import ProcessDevice
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.training.main import deadpool_hooks

    backend = getattr(args, "distributed_backend", "nccl")
    cfg = train_config(args)
    # Megatron set the device from LOCAL_RANK already; the snapshot threads take the same.
    # Our loop's restore check builds a fresh model with our builder; here the check
    # restores the live objects and re-enters Megatron's train() (RewindCheck).
    hooks = deadpool_hooks(cfg, dataclasses.replace(ft, deadpool_verify_restore_at=None),
                           world, cpu_rehearsal=backend == "gloo",
                           device=ProcessDevice.choose(backend))
    if ft.deadpool_verify_restore_at is not None:
        engine = next(h for h in hooks if isinstance(h, SnapshotEngine))
        hooks.append(RewindCheck(engine, ft.deadpool_verify_restore_at,
                                 cfg.use_distributed_optimizer))
    return hooks


class RewindCheck(TrainingHooks):
    """`--deadpool-verify-restore-at K` in Megatron's loop: after iteration K every rank
    receives from its buddy the copy of the snapshot before K, restores its live objects
    from it, and Megatron's train() is entered again there (`run_train`), so iteration K is
    computed a second time. A run with it must end with the fingerprint of the run without
    it: the path of a survivor's recovery (restore, re-enter, recompute the lost iteration),
    in Megatron's own loop, before any failure needs it."""

    def __init__(self, engine: Any, at_iteration: int, distributed_optimizer: bool) -> None:
        self.engine, self.at = engine, at_iteration
        self.distributed_optimizer = distributed_optimizer
        self.done = False

    def after_iteration(self, state: LoopState) -> None:
        if state.iteration != self.at or self.done:
            return
        self.done = True
        # Every rank at once sends its ward its copy of the snapshot before this iteration
        # and receives its own from its buddy (the way a spare receives its shard).
        slot = self.engine.fetch_own_from_buddy(before=state.iteration)

        def restore(objects: Any) -> dict[str, Any]:
            from deadpool_megatron.snapshot.restore import restore_shard

            restored = restore_shard(objects, slot, self.distributed_optimizer)
            self.engine.commit_recovered(restored["iteration"])
            return restored

        raise ReenterTrain(restore, f"restore check: snapshot {slot.iteration} from the "
                                    f"buddy, iteration {self.at} again")


def run_train(train: Callable, datasets_provider: Callable, *args: Any, **kwargs: Any) -> Any:
    """The patched pretrain()'s call of Megatron's train(args...). Under deadpool-launch
    with --deadpool (hot-swap, megatron_lm_elastic.py) the training thread parks here
    between generations; anywhere else, train() is entered again whenever a hook raises
    ReenterTrain (--deadpool-verify-restore-at)."""
    call = inspect.signature(train).bind(*args, **kwargs)
    session = live.SESSION.get()
    if session is not None:
        return session.run_train(train, call)
    return enter_train(train, call)


def enter_train(train: Callable, call: inspect.BoundArguments) -> Any:
    """Megatron's train(); when a hook raises ReenterTrain, leave it, restore the objects,
    put Megatron's position (args.iteration, args.consumed_train_samples) there, move the
    training data iterator to that position and enter train() again."""
    from megatron.training import get_args

    margs = get_args()
    while True:
        try:
            return train(*call.args, **call.kwargs)
        except ReenterTrain as again:
            reason = str(again)
            restore = again.restore
        # Outside the except block: the error (and the left train()'s frames) is gone.
        restored = restore(megatron_objects(call.arguments))
        margs.iteration = margs.curr_iteration = int(restored["iteration"])
        margs.consumed_train_samples = int(restored["consumed_samples"])
        call.arguments["train_data_iterator"] = data_iterator_at(
            call.arguments["train_data_iterator"], margs.consumed_train_samples)
        validation_at(call.arguments, int(restored.get("valid_consumed", 0)))
        left_train(margs.iteration, call.arguments)
        if _rank() == 0:  # printed, as Megatron's own lines are (its logging stays quiet)
            print(f"{reason}: Megatron's train() entered again at iteration {margs.iteration} "
                  f"({margs.consumed_train_samples} samples consumed)", flush=True)


# train()'s arguments that hold no process group: the rebind does not walk them (a data
# iterator reaches its whole dataset: half a second of walking on every recovery).
_HOLD_NO_GROUP = frozenset({"forward_step_func", "train_data_iterator", "valid_data_iterator",
                            "process_non_loss_data_func", "non_loss_data_func"})


def megatron_objects(arguments: dict[str, Any]) -> Any:
    """train()'s model, optimizer and scheduler, as the snapshot code reads them; its other
    arguments that may hold a group (a process-group collection, a p2p communicator, the
    checkpointing context) are held for the rebind, which swaps groups inside them."""
    from deadpool_megatron.integration.model import TrainingObjects

    held = {k: v for k, v in arguments.items() if k not in _HOLD_NO_GROUP}
    return TrainingObjects(arguments["model"], arguments["optimizer"],
                           arguments["opt_param_scheduler"], arguments["config"],
                           held=[held])


def left_train(iteration: int, arguments: dict[str, Any]) -> None:
    """What a train() left in the middle of an iteration leaves behind, put back as at the
    start of iteration `iteration` + 1 (called before every entry of train(), the first
    too): its timers running (a timer started twice asserts; Megatron's Timers has no
    public list of them); the rerun state machine inside a forward-backward pass (it would
    skip the next one); the overlap functions train() puts in the model's config (it asserts
    they are unset); DDP's overlapped communication (ddp_overlap.py)."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
    from megatron.training import get_args, get_timers

    for timer in getattr(get_timers(), "_timers", {}).values():
        if getattr(timer, "_started", False):
            timer.reset()
    machine = get_rerun_state_machine()
    machine.state = RerunState.NOT_RUNNING_YET
    machine.current_iteration = iteration  # as train() sets it from args.iteration
    margs, config, model = get_args(), arguments["config"], arguments["model"]
    if getattr(margs, "overlap_grad_reduce", False):
        config.no_sync_func = None
        if getattr(margs, "align_grad_reduce", False):
            config.grad_sync_func = None
    if getattr(margs, "overlap_param_gather", False) and \
            getattr(margs, "align_param_gather", False):
        config.param_sync_func = None
    ddp_overlap.put_back(model)
    ddp_overlap.gather_params(model)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class Accumulated:
    """What the running iteration's micro-batches left besides their gradients: Megatron's
    per-micro-batch loss outputs (last pipeline stage) and the token count the reduction
    takes. A replica that keeps its gradients after a failure hands them to Megatron in
    place of a forward_backward_func it does not run, so the loss all-reduce and the
    reduction see what a failure-free iteration gives them."""

    iteration: int = -1
    losses: list[Any] = field(default_factory=list)
    num_tokens: Any = None

    def reset(self, iteration: int) -> None:
        self.iteration, self.losses, self.num_tokens = iteration, [], None


class MegatronLoop(NotWalked):
    """What the patched loop calls; holds the LoopState the hooks read. `work`: the
    replay's, per iteration (hot-swap); `accumulated` lives as long as the worker.
    Megatron's config reaches it (the wrapped reduction's closure); the rebind does not
    walk it: its hooks hold no group of the training (the snapshot engine makes its own
    at every generation), and walking them cost half a second a recovery."""

    def __init__(self, hooks: Sequence[TrainingHooks], state: LoopState, config: Any,
                 work: dict[int, Any] | None = None,
                 accumulated: Accumulated | None = None,
                 args: argparse.Namespace | None = None) -> None:
        self.hooks = HookChain(list(hooks))
        self._args = args  # Megatron's, for the evaluation that follows an iteration
        self.state = state
        self.work = work or {}
        self.accumulated = accumulated if accumulated is not None else Accumulated()
        self._current: Any = None  # the running iteration's MicrobatchWork, if any
        self._forwards = 0  # micro-batch forwards of the running iteration
        self._backward_watched = False  # its first backward has a hook
        self._loss_scale: float | None = None  # a spread replay's, on each loss
        self._config = config
        self._finalize: Callable | None = getattr(config, "finalize_model_grads_func", None)
        self._reducing = False  # the running iteration's reduction began
        self._model = list(state.objects.model) if state.objects is not None else []
        self._guard_reduction(config)
        ddp_overlap.watch_bucket_reductions(self._model, self._reduction_begins)

    @classmethod
    def start(cls, args: argparse.Namespace, model: list, optimizer: Any, scheduler: Any,
              config: Any, iteration: int,
              extra_hooks: Sequence[TrainingHooks] = ()) -> "MegatronLoop":
        """Called by the patched train(), before its while loop (each entry, run_train)."""
        from deadpool_megatron.integration.model import TrainingObjects

        session = live.SESSION.get()
        if session is not None:  # hot-swap: the worker's state, this generation's hooks
            loop = cls([*session.hooks(), *extra_hooks], session.member.state, config,
                       session.work, session.accumulated, args)
            loop.hooks.on_train_start(loop.state)
            return loop
        owner, hooks = live.HOOKS.get() or (None, None)
        if owner is not args:  # the first entry; a re-entry (run_train) keeps them
            try:
                hooks = [*fault_tolerance_hooks(args), *extra_hooks]
            except ConfigError as err:
                raise SystemExit(f"error: {err}") from None
            live.HOOKS.set((args, hooks))
        state = LoopState(iteration=iteration,
                          consumed_samples=int(getattr(args, "consumed_train_samples", 0)),
                          valid_consumed=int(getattr(args, "consumed_valid_samples", 0) or 0),
                          objects=TrainingObjects(model, optimizer, scheduler, config))
        loop = cls(hooks, state, config, args=args)
        loop.hooks.on_train_start(state)
        return loop

    def _guard_reduction(self, config: Any) -> None:
        """Megatron's data-parallel reduction runs in config.finalize_model_grads_func, after
        the last micro-batch: the hooks see it begin, as in integration/step.py."""
        original: Callable | None = getattr(config, "finalize_model_grads_func", None)
        if original is None:
            return
        # A train() left by ReenterTrain did not unwrap it: wrap Megatron's, not ours.
        original = getattr(original, "deadpool_original", original)
        self._finalize = original

        @functools.wraps(original)
        def finalize(model: Any, num_tokens: Any = None, *args: Any, **kwargs: Any) -> Any:
            self.accumulated.num_tokens = num_tokens
            self._reduction_begins()
            return original(model, num_tokens, *args, **kwargs)

        finalize.deadpool_original = original  # type: ignore[attr-defined]
        config.finalize_model_grads_func = finalize

    def _reduction_begins(self, accumulated: bool = True) -> None:
        """In finalize_model_grads, or at the first bucket an overlapped reduction starts
        (ddp_overlap.py), whichever comes first. A bucket that starts while the backward
        pass still fills others (`accumulated` False) leaves no gradient to keep: the
        ledger is told the reduction began before the data-parallel barrier."""
        if self._reducing:
            return
        self._reducing = True
        if not accumulated:
            self.hooks.on_phase("reduction", self.state)
            self.hooks.before_grad_reduction(self.state)
            return
        self.hooks.before_grad_reduction(self.state)
        self.hooks.on_phase("reduction", self.state)

    def _keeps(self) -> bool:
        """The running iteration keeps the gradients accumulated before a failure (a
        replica that lost no rank): with local replay it computes nothing more, with
        spread replay some lost micro-batches on top."""
        work = self._current
        return work is not None and work.keep_grads

    def _named(self) -> tuple | None:
        """The micro-batches the running iteration computes when the replay names them
        (`MicrobatchWork.microbatches`: () none, or some of any replica's); None: this
        rank's own, through Megatron's schedule as usual."""
        work = self._current
        return None if work is None else work.microbatches

    def step_functions(self, forward_step_func: Callable,
                       forward_backward_func: Callable) -> tuple[Callable, Callable]:
        """train_step()'s forward step with the micro-batch phases around it (the schedule
        reads its signature: functools.wraps keeps it visible), and its forward_backward_func,
        which an iteration that keeps its gradients does not run."""

        @functools.wraps(forward_step_func)
        def step(*args: Any, **kwargs: Any) -> Any:
            chunk = args[1] if len(args) > 1 else kwargs.get("model")
            if self._is_chunk(chunk, 0):  # a micro-batch begins at the model's first chunk
                first = self._forwards == 0
                self._forwards += 1
                self.hooks.on_phase("forward" if first else "microbatch", self.state)
            result = forward_step_func(*args, **kwargs)
            output = result[0] if isinstance(result, tuple) else result
            # The iteration's first backward is its last chunk's first micro-batch's.
            if not self._backward_watched and self._is_chunk(chunk, -1) and \
                    getattr(output, "requires_grad", False):
                self._backward_watched = True
                output.register_hook(self._backward_started)
            if isinstance(result, tuple) and len(result) == 2 and callable(result[1]):
                return output, self._recorded(result[1])
            return result

        @functools.wraps(forward_backward_func)
        def forward_backward(*args: Any, **kwargs: Any) -> Any:
            named = self._named()
            if named is None:
                return forward_backward_func(*args, **kwargs)
            if named:  # spread replay: these micro-batches, each weighing 1/N
                return self._spread(forward_backward_func, named, args, kwargs)
            model = kwargs["model"]
            model = model if isinstance(model, list) else [model]
            self._reduction_begins()  # every gradient is there: kept (or none: zeroed)
            ddp_overlap.start_grad_syncs(model)  # the backward it skips would have
            self._config.finalize_model_grads_func(
                model, self.accumulated.num_tokens,
                pg_collection=kwargs.get("pg_collection"),
                force_all_reduce=kwargs.get("force_all_reduce", False))
            return list(self.accumulated.losses)

        return step, forward_backward

    def _spread(self, forward_backward_func: Callable, named: tuple, args: tuple,
                kwargs: dict[str, Any]) -> Any:
        """Megatron's schedule over the named micro-batches (data-parallel rank, index) of
        the running iteration, read from this rank's dataset; each loss scaled so that it
        weighs 1/N of the iteration (the schedule divides by the count it runs). A replica
        that kept its gradients adds them on top and reports every loss it holds."""
        from megatron.core import parallel_state
        from megatron.training import get_args

        from deadpool_megatron.integration.megatron_data import spread_iterator

        count = int(kwargs["num_microbatches"])
        kwargs = {**kwargs, "num_microbatches": len(named),
                  "data_iterator": spread_iterator(
                      kwargs["data_iterator"], self.state.consumed_samples, named,
                      int(get_args().micro_batch_size),
                      parallel_state.get_data_parallel_world_size())}
        self._loss_scale = len(named) / count
        try:
            result = forward_backward_func(*args, **kwargs)
        finally:
            self._loss_scale = None
        return list(self.accumulated.losses) if self._keeps() else result

    def _is_chunk(self, chunk: Any, index: int) -> bool:
        """`chunk` is the model's chunk `index` (with a virtual pipeline each micro-batch
        passes through every chunk of a rank; without one there is one)."""
        return len(self._model) < 2 or chunk is self._model[index]

    def _recorded(self, loss_func: Callable) -> Callable:
        """The micro-batch's loss function, its reported values kept (Accumulated)."""

        @functools.wraps(loss_func)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            outputs = loss_func(*args, **kwargs)
            reported = outputs[-1] if isinstance(outputs, tuple) else None
            if isinstance(reported, dict):
                self.accumulated.losses.append(
                    {k: v.detach().clone() if hasattr(v, "detach") else v
                     for k, v in reported.items()})
            if self._loss_scale is not None and isinstance(outputs, tuple):
                outputs = (outputs[0] * self._loss_scale, *outputs[1:])
            return outputs

        return recorded

    def zero_grad_buffer(self, chunk: Any) -> None:
        """train_step()'s zeroing of a model chunk's gradient buffer, skipped in an
        iteration that keeps its gradients."""
        if not self._keeps():
            chunk.zero_grad_buffer()

    def _backward_started(self, grad: Any) -> None:
        self.hooks.on_phase("backward", self.state)

    def iteration_start(self, iteration: int, consumed_samples: int) -> None:
        self.state.iteration, self.state.consumed_samples = iteration, consumed_samples
        self._forwards = 0
        self._backward_watched = False
        self._reducing = False
        self._current = self.work.get(iteration + 1)
        if not self._keeps():
            self.accumulated.reset(iteration + 1)
            self.state.microbatch_losses.clear()
        self.hooks.on_iteration_start(self.state)

    def before_optimizer_step(self) -> None:
        self.hooks.before_optimizer_step(self.state)
        self.hooks.on_phase("step", self.state)

    def after_iteration(self, iteration: int, consumed_samples: int) -> None:
        self.state.iteration, self.state.consumed_samples = iteration, consumed_samples
        args = self._args
        if args is not None:
            # The snapshot of this iteration counts the evaluation that follows it: train()
            # is entered again after it, never before.
            self.state.valid_consumed = int(getattr(args, "consumed_valid_samples", 0) or 0) \
                + evaluated(args, iteration)
        self.hooks.after_iteration(self.state)

    def end(self) -> None:
        """After train()'s loop: on_train_end, Megatron's reduction unwrapped (a later
        train() call wraps it again, never twice), and the job's state fingerprint, the
        line our pretrain_gpt.py ends with: runs that must be bit-identical (a resumed or
        recovered one and the same run without interruption) print the same."""
        self.hooks.on_train_end(self.state)
        if self._finalize is not None:
            self._config.finalize_model_grads_func = self._finalize
        ddp_overlap.unwatch_bucket_reductions(self._model)
        import torch.distributed as dist

        if dist.is_initialized():
            from deadpool_megatron.integration.fingerprint import (job_fingerprint,
                                                                   job_param_norm)

            objs = self.state.objects
            # With --overlap-param-gather the last step's parameters reach the ranks that do
            # not own them in a next forward that never comes: gathered here, the job's
            # state is the same with and without the overlap.
            ddp_overlap.gather_params(objs.model)
            fingerprint = job_fingerprint(objs.model, objs.optimizer, objs.scheduler)
            norm = job_param_norm(objs.model)  # what a spread replay is compared by
            if dist.get_rank() == 0:
                print(f"state fingerprint: {fingerprint}\nparameter norm: {norm!r}",
                      flush=True)
