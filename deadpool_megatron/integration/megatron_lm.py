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
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from typing import Any, Callable, Sequence

from deadpool_megatron.config import ConfigError, TrainConfig, add_arguments, from_namespace
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.hooks import HookChain, LoopState, TrainingHooks


class HotSwapUnavailable(RuntimeError):
    """--deadpool under deadpool-launch asks for hot-swap, which Megatron-LM's own loop does
    not have yet; say so before any training rather than fail at the first failure."""


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
        raise HotSwapUnavailable(
            "--deadpool under deadpool-launch (hot-swap) is not available for Megatron-LM's "
            "own train() yet: launch pretrain_scripts/pretrain_gpt.py for hot-swap, or drop "
            "--deadpool here (deadpool-launch then restarts the job from --save on a failure).")
    if ft.deadpool_verify_restore_at is not None:
        raise ConfigError(
            "--deadpool-verify-restore-at is not available in Megatron-LM's own loop yet (the "
            "rehearsal rebuilds the model with pretrain_scripts/pretrain_gpt.py's builder, "
            "not Megatron's model provider); drop it here.")
    from deadpool_megatron.integration.device import ProcessDevice
    from deadpool_megatron.training.main import deadpool_hooks

    backend = getattr(args, "distributed_backend", "nccl")
    # Megatron set the device from LOCAL_RANK already; the snapshot threads take the same.
    return deadpool_hooks(train_config(args), ft, world, cpu_rehearsal=backend == "gloo",
                          device=ProcessDevice.choose(backend))


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
        """Called once by the patched train(), before its while loop."""
        from deadpool_megatron.integration.model import TrainingObjects

        try:
            hooks = [*fault_tolerance_hooks(args), *extra_hooks]
        except ConfigError as err:
            raise SystemExit(f"error: {err}") from None
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

        @functools.wraps(original)
        def finalize(*args: Any, **kwargs: Any) -> Any:
            self.hooks.before_grad_reduction(self.state)
            self.hooks.on_phase("reduction", self.state)
            return original(*args, **kwargs)

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
