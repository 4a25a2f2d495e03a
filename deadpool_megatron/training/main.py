"""Entry point shared by pretrain_scripts/pretrain_gpt.py: parse, set up, train, fingerprint."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Callable, ContextManager, Sequence

import torch

from deadpool_megatron.config import ConfigError, TrainConfig, parse_configs
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.integration.plain_gather import collective_device

if TYPE_CHECKING:
    from deadpool_megatron.integration.device import ProcessDevice
    from deadpool_megatron.rehearsal import CpuRehearsal


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        format=f"[%(asctime)s rank{rank}] %(message)s",
        stream=sys.stdout,
        force=True,
    )
    # Megatron-Core logs every bucket and config field at INFO; keep its warnings only.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # `kill -USR1 <pid>` prints every thread's stack: how to see where a worker is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def main(argv: Sequence[str] | None = None) -> int:
    _setup_logging()
    cfg, ft = parse_configs([TrainConfig, DeadPoolConfig], argv, prog="pretrain_gpt.py")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg.validate(world)
        ft.validate(world)
    except ConfigError as err:
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        return 2
    from deadpool_megatron.integration.device import DeviceLayoutError, ProcessDevice

    try:  # once per process; every thread that touches CUDA sets it (device.py)
        device = ProcessDevice.choose(cfg.distributed_backend)
    except DeviceLayoutError as err:
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        return 2
    device.bind()
    torch.set_num_threads(cfg.num_threads)
    from deadpool_megatron.control.client import ControlClient

    # Under deadpool-launch: join the control plane before the long imports.
    ctl = ControlClient.from_env() if ft.deadpool else None
    if ctl is not None:
        from deadpool_megatron.training.driver import leave_sigterm_to_the_launcher

        leave_sigterm_to_the_launcher()
    if ctl is not None and cfg.distributed_backend == "nccl":
        from deadpool_megatron.reconstruct.abort import configure_nccl_error_handling

        overridden = configure_nccl_error_handling(os.environ)  # before any group exists
        if overridden:
            logging.getLogger("deadpool_megatron.train").warning("%s", overridden)

    from deadpool_megatron.rehearsal import CpuRehearsal, prepare_megatron_import, rehearsal_needed

    cpu_rehearsal = rehearsal_needed(cfg.distributed_backend)
    prepare_megatron_import(cpu_rehearsal)
    from deadpool_megatron.faults.megatron_faults import install_from_env

    install_from_env()  # tests only: a failure raised inside Megatron-Core itself
    rehearsal = CpuRehearsal() if cpu_rehearsal else None
    with rehearsal or contextlib.nullcontext():
        if ctl is not None:
            return _run_elastic(cfg, ft, ctl, rehearsal is not None,
                                thread_context(device, rehearsal), device)
        return _run(cfg, ft, world, rehearsal is not None, device)


def thread_context(device: "ProcessDevice",
                   rehearsal: "CpuRehearsal | None") -> Callable[[], ContextManager]:
    """What a training thread enters first: the process's device (CUDA's current device is
    per thread) and, in CPU rehearsal, its own torch function mode (also per thread)."""

    def enter() -> ContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(device.thread())
        if rehearsal is not None:
            stack.enter_context(rehearsal.thread_mode())
        return stack

    return enter


def _run_elastic(cfg: TrainConfig, ft: DeadPoolConfig, ctl, cpu_rehearsal: bool,
                 thread_context: Callable[[], ContextManager], device: "ProcessDevice") -> int:
    from deadpool_megatron.control.progress import ProgressBoard
    from deadpool_megatron.integration.data import build_train_dataset
    from deadpool_megatron.training.elastic import run_elastic

    progress = ProgressBoard.from_env(ft.deadpool_progress_timeout, ft.deadpool_startup_timeout)
    if progress is not None:
        progress.start_monitor()
    dataset = build_train_dataset(cfg, cfg.train_iters * cfg.global_batch_size)
    rc = run_elastic(cfg, ft, ctl, dataset, cpu_rehearsal, finish=_finish,
                     thread_context=thread_context, progress=progress, device=device)
    ctl.close()
    # Threads of broken generations may still sit in gloo; their groups' destructors would
    # block interpreter shutdown, so leave now that everything is flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _finish(state) -> None:
    from deadpool_megatron.integration.fingerprint import job_fingerprint, job_param_norm

    objs = state.objects
    fingerprint = job_fingerprint(objs.model, objs.optimizer, objs.scheduler)
    norm = job_param_norm(objs.model)
    if torch.distributed.get_rank() == 0:
        print(f"state fingerprint: {fingerprint}\nparameter norm: {norm!r}", flush=True)


def _run(cfg: TrainConfig, ft: DeadPoolConfig, world: int, cpu_rehearsal: bool,
         device: "ProcessDevice") -> int:
    from deadpool_megatron.integration.checkpoint import Checkpointer
    from deadpool_megatron.integration.data import build_train_dataset
    from deadpool_megatron.integration.distributed import (
        destroy_process_groups,
        init_process_groups,
        set_seeds,
    )
    from deadpool_megatron.integration.model import build_training_objects
    from deadpool_megatron.hooks import LoopState
    from deadpool_megatron.training.loop import train

    log = logging.getLogger("deadpool_megatron.train")
    dataset = build_train_dataset(cfg, cfg.train_iters * cfg.global_batch_size)
    init_process_groups(cfg, device)
    try:
        set_seeds(cfg.seed)
        objs = build_training_objects(cfg, cpu_rehearsal)
        state = LoopState(iteration=0, consumed_samples=0, objects=objs)
        checkpointer = Checkpointer(cfg)
        if cfg.load:
            checkpointer.load(state)
        if torch.distributed.get_rank() == 0:
            log.info(
                "training GPT: world %d = TP %d x PP %d x DP %d, %d micro-batches per "
                "iteration, backend %s%s, from iteration %d",
                world, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                cfg.data_parallel_size(world), cfg.num_microbatches(world),
                cfg.distributed_backend, " (CPU rehearsal)" if cpu_rehearsal else "",
                state.iteration,
            )
        initial = _param_copies(objs) if cfg.log_param_changes else None
        hooks = deadpool_hooks(cfg, ft, world, cpu_rehearsal, device) if ft.deadpool else []
        train(cfg, dataset, state, hooks=hooks, checkpointer=checkpointer)
        if initial is not None:
            _log_param_changes(state.objects, initial)
        _finish(state)
    finally:
        destroy_process_groups()
    return 0


def deadpool_hooks(cfg: TrainConfig, ft: DeadPoolConfig, world: int,
                   cpu_rehearsal: bool, device: "ProcessDevice") -> list:
    """The fault-tolerance layer, as the hooks it adds to the training loop."""
    from deadpool_megatron.faults.injector import FaultInjector
    from deadpool_megatron.faults.spec import parse_fault, target_ranks
    from deadpool_megatron.integration.model import build_training_objects
    from deadpool_megatron.metrics.events import EventLog
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.snapshot.verify_restore import RestoreCheck
    from deadpool_megatron.topology import ParallelSizes

    rank = torch.distributed.get_rank()
    sizes = ParallelSizes.from_world(world, cfg.tensor_model_parallel_size,
                                     cfg.pipeline_model_parallel_size)
    faults = [parse_fault(s) for s in ft.deadpool_inject]
    mine = [f for f in faults if rank in target_ranks(f, sizes, ft.ranks_per_node(world))]
    events = EventLog(ft.deadpool_events, rank)
    injector = FaultInjector(mine, rank, events)
    engine = SnapshotEngine(cfg, ft, injector, events, device)
    hooks: list = [engine, injector.hooks()]
    if ft.deadpool_verify_restore_at is not None:
        hooks.append(RestoreCheck(
            engine, ft.deadpool_verify_restore_at,
            lambda: build_training_objects(cfg, cpu_rehearsal), cfg.use_distributed_optimizer))
    return hooks


def _param_copies(objs) -> list:
    return [p.detach().clone() for chunk in objs.model for p in chunk.parameters()]


def _log_param_changes(objs, initial: list) -> None:
    """Count, over all ranks, the parameter tensors that differ from their initial values."""
    current = [p.detach() for chunk in objs.model for p in chunk.parameters()]
    counts = torch.tensor([sum(not torch.equal(a, b) for a, b in zip(initial, current)),
                           len(current)], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(counts)
    if torch.distributed.get_rank() == 0:
        print(f"parameters changed: {int(counts[0])} of {int(counts[1])}", flush=True)
