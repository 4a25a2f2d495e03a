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
the same across entries (`args.deadpool_hooks`). Under deadpool-launch, hot-swap enters
the whole of pretrain() again per generation (megatron_lm_elastic.py), which sets
`args.deadpool_hooks` each time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
from typing import Any, Callable, Sequence

from deadpool_megatron.config import ConfigError, TrainConfig, add_arguments, from_namespace
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.hooks import HookChain, LoopState, TrainingHooks


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

        # The hot-swap wrapper sets args.deadpool_hooks; it is not there.
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
    # Our loop's restore rehearsal builds a fresh model with our builder; here the rehearsal
    # restores the live objects and re-enters Megatron's train() (RewindRehearsal).
    hooks = deadpool_hooks(cfg, dataclasses.replace(ft, deadpool_verify_restore_at=None),
                           world, cpu_rehearsal=backend == "gloo",
                           device=ProcessDevice.choose(backend))
    if ft.deadpool_verify_restore_at is not None:
        engine = next(h for h in hooks if isinstance(h, SnapshotEngine))
        hooks.append(RewindRehearsal(engine, ft.deadpool_verify_restore_at,
                                     cfg.use_distributed_optimizer))
    return hooks


class RewindRehearsal(TrainingHooks):
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
        slot = self._fetch_previous_from_buddy(state.iteration)

        def restore(objects: Any) -> dict[str, Any]:
            from deadpool_megatron.snapshot.restore import restore_shard

            restored = restore_shard(objects, slot, self.distributed_optimizer)
            self.engine.commit_recovered(restored["iteration"])
            return restored

        raise ReenterTrain(restore, f"restore rehearsal: snapshot {slot.iteration} from the "
                                    f"buddy, iteration {self.at} again")

    def _fetch_previous_from_buddy(self, iteration: int) -> Any:
        """Every rank at once: send the ward its copy of the snapshot before `iteration`,
        receive ours from the buddy (the way a spare receives its shard)."""
        from deadpool_megatron.snapshot.transport import exchange

        engine = self.engine
        engine.drain()
        held = [i for i in engine.ward_buffer.available() if i < iteration]
        if not held:
            raise RuntimeError(f"rank {engine.rank}: no snapshot before iteration {iteration} "
                               f"held for rank {engine.ward}")
        outgoing = engine.ward_buffer.find(max(held))
        incoming = engine.own.loose_slot()
        exchange(engine.links, outgoing, engine.ward, incoming, engine.buddy,
                 chunk_bytes=engine.chunk_bytes)
        engine.complete_locally(incoming)
        if not incoming.check() or incoming.iteration != max(held):
            raise RuntimeError(f"rank {engine.rank}: the buddy's copy of snapshot {max(held)} "
                               f"did not arrive whole")
        return incoming


def run_train(train: Callable, datasets_provider: Callable, *args: Any, **kwargs: Any) -> Any:
    """The patched pretrain()'s call of Megatron's train(args...): when a hook raises
    ReenterTrain, leave train(), restore the objects, put Megatron's position (args.iteration,
    args.consumed_train_samples) there, rebuild the data iterators from that position
    (Megatron's sampler starts at consumed_train_samples) and enter train() again."""
    from megatron.training import get_args, get_timers

    call = inspect.signature(train).bind(*args, **kwargs)
    margs = get_args()
    while True:
        try:
            return train(*call.args, **call.kwargs)
        except ReenterTrain as again:
            reason = str(again)
            restore = again.restore
        # Outside the except block: the error (and the left train()'s frames) is gone.
        if getattr(margs, "virtual_pipeline_model_parallel_size", None) is not None:
            raise RuntimeError("re-entering Megatron's train() with a virtual pipeline "
                               "(one data iterator per stage) is not supported yet: drop "
                               "--num-layers-per-virtual-pipeline-stage with it")
        objects = _train_objects(call.arguments)
        restored = restore(objects)
        margs.iteration = margs.curr_iteration = int(restored["iteration"])
        margs.consumed_train_samples = int(restored["consumed_samples"])
        call.arguments["train_data_iterator"], call.arguments["valid_data_iterator"] = \
            _data_iterators_at(datasets_provider)
        _stop_timers(get_timers())
        if _rank() == 0:  # printed, as Megatron's own lines are (its logging stays quiet)
            print(f"{reason}: Megatron's train() entered again at iteration {margs.iteration} "
                  f"({margs.consumed_train_samples} samples consumed)", flush=True)


def _train_objects(arguments: dict[str, Any]) -> Any:
    """train()'s model, optimizer and scheduler, as the snapshot code reads them."""
    from deadpool_megatron.integration.model import TrainingObjects

    return TrainingObjects(arguments["model"], arguments["optimizer"],
                           arguments["opt_param_scheduler"], arguments["config"])


def _data_iterators_at(datasets_provider: Callable) -> tuple[Any, Any]:
    """Megatron's train and valid iterators, built again from args.consumed_train_samples
    (collective over the world, as in pretrain()). The RNG streams are left as the restore
    set them: building a DataLoader's iterator draws from torch's default generator."""
    import megatron.training.training as training

    from deadpool_megatron.integration.rng_state import get_rng_state, set_rng_state

    rng = get_rng_state()
    iterators = training.build_train_valid_test_data_iterators(datasets_provider)
    set_rng_state(rng)
    return iterators[0], iterators[1]


def _stop_timers(timers: Any) -> None:
    """The left train() leaves its timers running (interval-time among them); a timer
    started twice asserts. Megatron's Timers has no public list of them."""
    for timer in getattr(timers, "_timers", {}).values():
        if getattr(timer, "_started", False):
            timer.reset()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class MegatronLoop:
    """What the patched loop calls; holds the LoopState the hooks read."""

    def __init__(self, hooks: Sequence[TrainingHooks], state: LoopState, config: Any) -> None:
        self.hooks = HookChain(list(hooks))
        self.state = state
        self._forwards = 0  # forward steps of the running iteration
        self._config = config
        self._finalize: Callable | None = getattr(config, "finalize_model_grads_func", None)
        self._guard_reduction(config)

    @classmethod
    def start(cls, args: argparse.Namespace, model: list, optimizer: Any, scheduler: Any,
              config: Any, iteration: int,
              extra_hooks: Sequence[TrainingHooks] = ()) -> "MegatronLoop":
        """Called by the patched train(), before its while loop (each entry, run_train)."""
        from deadpool_megatron.integration.model import TrainingObjects

        hooks = getattr(args, "deadpool_hooks", None)
        if hooks is None:  # the first entry; a re-entry (run_train) keeps them
            try:
                hooks = [*fault_tolerance_hooks(args), *extra_hooks]
            except ConfigError as err:
                raise SystemExit(f"error: {err}") from None
            args.deadpool_hooks = hooks
        state = LoopState(iteration=iteration,
                          consumed_samples=int(getattr(args, "consumed_train_samples", 0)),
                          objects=TrainingObjects(model, optimizer, scheduler, config))
        loop = cls(hooks, state, config)
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
        def finalize(*args: Any, **kwargs: Any) -> Any:
            self.hooks.before_grad_reduction(self.state)
            self.hooks.on_phase("reduction", self.state)
            return original(*args, **kwargs)

        finalize.deadpool_original = original  # type: ignore[attr-defined]
        config.finalize_model_grads_func = finalize

    def forward_step(self, forward_step_func: Callable) -> Callable:
        """Megatron's forward_step_func with the micro-batch phases around it (the schedule
        reads its signature: functools.wraps keeps it visible)."""

        @functools.wraps(forward_step_func)
        def step(*args: Any, **kwargs: Any) -> Any:
            first = self._forwards == 0
            self._forwards += 1
            self.hooks.on_phase("forward" if first else "microbatch", self.state)
            result = forward_step_func(*args, **kwargs)
            output = result[0] if isinstance(result, tuple) else result
            if first and getattr(output, "requires_grad", False):
                output.register_hook(self._backward_started)
            return result

        return step

    def _backward_started(self, grad: Any) -> None:
        self.hooks.on_phase("backward", self.state)

    def iteration_start(self, iteration: int, consumed_samples: int) -> None:
        self.state.iteration, self.state.consumed_samples = iteration, consumed_samples
        self._forwards = 0
        self.state.microbatch_losses.clear()
        self.hooks.on_iteration_start(self.state)

    def before_optimizer_step(self) -> None:
        self.hooks.before_optimizer_step(self.state)
        self.hooks.on_phase("step", self.state)

    def after_iteration(self, iteration: int, consumed_samples: int) -> None:
        self.state.iteration, self.state.consumed_samples = iteration, consumed_samples
        self.hooks.after_iteration(self.state)

    def end(self) -> None:
        """After train()'s loop: on_train_end, Megatron's reduction unwrapped (a later
        train() call wraps it again, never twice), and the job's state fingerprint, the
        line our pretrain_gpt.py ends with: runs that must be bit-identical (a resumed or
        recovered one and the same run without interruption) print the same."""
        self.hooks.on_train_end(self.state)
        if self._finalize is not None:
            self._config.finalize_model_grads_func = self._finalize
        import torch.distributed as dist

        if dist.is_initialized():
            from deadpool_megatron.integration.fingerprint import job_fingerprint

            objs = self.state.objects
            fingerprint = job_fingerprint(objs.model, objs.optimizer, objs.scheduler)
            if dist.get_rank() == 0:
                print(f"state fingerprint: {fingerprint}", flush=True)
