"""Our pretrain_gpt.py's training loop (training/loop.py) under deadpool-launch: the
`TrainingLoop` the one generation loop (training/driver.py) drives.

Its objects are built with our builder (integration/model.py): every rank together at the
job's start (seeded initialisation, or the --load checkpoint), or a spare alone at the
failed rank's coordinates (no initialisation: the restore overwrites the parameters).
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Callable, ContextManager

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.control.client import ControlClient
from deadpool_megatron.control.progress import ProgressBoard
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.hooks import LoopState
from deadpool_megatron.integration.device import CPU, ProcessDevice
from deadpool_megatron.reconstruct.member import LoopTraits, Member
from deadpool_megatron.training.driver import generation_hooks, run_worker
from deadpool_megatron.training.training_thread import TrainingThread, Work


class OwnLoop:
    """training/loop.py's `train`, as a `TrainingLoop`."""

    def __init__(self, cfg: TrainConfig, dataset: object, cpu_rehearsal: bool,
                 finish: Callable[[LoopState], None]) -> None:
        self.cfg, self.dataset, self.cpu_rehearsal = cfg, dataset, cpu_rehearsal
        self.finish = finish

    def groups_patched(self, timeout: timedelta) -> contextlib.AbstractContextManager:
        from deadpool_megatron.integration.distributed import megatron_groups_patched

        return megatron_groups_patched(self.cfg)

    def make_groups(self, timeout: timedelta) -> None:
        from deadpool_megatron.integration.distributed import make_megatron_groups

        make_megatron_groups(self.cfg, timeout=timeout)

    def prepare_spare(self) -> None:
        from deadpool_megatron.reconstruct.spare import warm_up_imports

        warm_up_imports()

    def body(self, member: Member, thread: TrainingThread) -> None:
        work = thread.built(self._build(member, thread.spare))

        def train_once(work: Work) -> None:
            from deadpool_megatron.training.loop import train

            train(self.cfg, self.dataset, member.state,
                  hooks=generation_hooks(member, thread.stops, work),
                  checkpointer=member.checkpointer(), replay=work)
            self.finish(member.state)

        try:
            thread.generations(train_once, work)
        finally:
            if member.progress is not None:  # a later thread may reuse this one's id
                member.progress.training_thread = None

    def _build(self, member: Member, spare: bool) -> LoopState:
        """A spare's parameters are left uninitialised: its restore overwrites them."""
        from deadpool_megatron.integration.distributed import set_seeds
        from deadpool_megatron.integration.model import build_training_objects

        set_seeds(self.cfg.seed)  # also registers the tensor-parallel RNG streams
        objects = build_training_objects(self.cfg, self.cpu_rehearsal, initialize=not spare)
        state = LoopState(iteration=0, consumed_samples=0, objects=objects)
        if self.cfg.load and not spare:
            member.checkpointer().load(state)
        return state


def run_elastic(cfg: TrainConfig, ft: DeadPoolConfig, ctl: ControlClient, dataset: object,
                cpu_rehearsal: bool, finish: Callable[[LoopState], None],
                thread_context: Callable[[], ContextManager],
                progress: ProgressBoard | None = None, device: ProcessDevice = CPU) -> int:
    """Our loop's worker under deadpool-launch; its exit code."""
    world = int(os.environ["WORLD_SIZE"])
    loop = OwnLoop(cfg, dataset, cpu_rehearsal, finish)

    def new_member(rank: int, generation: int) -> Member:
        return new_worker_member(cfg, ft, ctl, rank, generation, world, progress, device,
                                 LoopTraits(make_groups=loop.make_groups,
                                            groups_patched=loop.groups_patched))

    return run_worker(ctl, new_member, loop, thread_context)


def new_worker_member(cfg: TrainConfig, ft: DeadPoolConfig, ctl: ControlClient, rank: int,
                      generation: int, world: int, progress: ProgressBoard | None,
                      device: ProcessDevice, loop: LoopTraits) -> Member:
    """What a worker carries from generation to generation (either loop)."""
    from deadpool_megatron.metrics.events import EventLog
    from deadpool_megatron.replay.ledger import MicrobatchLedger
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.topology import ParallelSizes
    from deadpool_megatron.training.driver import member_injector

    events = EventLog(ft.deadpool_events, rank)
    sizes = ParallelSizes.from_world(world, cfg.tensor_model_parallel_size,
                                     cfg.pipeline_model_parallel_size)
    injector = member_injector(ft, ctl, rank, sizes, world, events)
    return Member(cfg=cfg, ft=ft, ctl=ctl, rank=rank, world=world, events=events,
                  engine=SnapshotEngine(cfg, ft, injector, events, device),
                  ledger=MicrobatchLedger(), injector=injector, loop=loop,
                  progress=progress, device=device, generation=generation)
