"""A spare builds the failed rank's training objects alone, before the new generation's
process groups exist.

Megatron's constructors run collectives: the tied-embedding all-reduce between the first and
last pipeline stage, the optimizer's all_gather_object of parameter-group keys. Their results
are overwritten by the restore (parameters) or are the same on every rank (the keys of a
dense model), so the spare answers them itself: it builds inside a world of torch's "fake"
backend, where every collective returns at once with this rank's own data, at the failed
rank's exact coordinates (rank and world size give every Megatron group its size and this
rank its place in it). The survivors never mirror a build, and the spare's build overlaps
their leaving the old generation. Its groups are then swapped for the real ones exactly as a
survivor's old groups are (rebind.py). No random initialisation, no optimizer step: the
parameters are allocated uninitialised and the optimizer state as its first step would.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.integration.model import TrainingObjects
from deadpool_megatron.reconstruct.rebind import GroupKey, group_registry


def _register_local_backend() -> None:
    """torch names the 'fake' backend but registers its factory only in a test module."""
    if dist.Backend.FAKE.upper() in dist.Backend._plugins:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    dist.Backend.register_backend(
        dist.Backend.FAKE,
        lambda common, options: FakeProcessGroup._create_internal(
            common.group_rank, common.group_size, options),
        extended_api=True, devices=["cpu", "cuda"])


@contextlib.contextmanager
def local_world(rank: int, world_size: int) -> Iterator[None]:
    """A process-group world in which this process is `rank` of `world_size` and every
    collective is answered locally."""
    _register_local_backend()
    dist.init_process_group(dist.Backend.FAKE, store=dist.HashStore(), rank=rank,
                            world_size=world_size)
    try:
        yield
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()


def warm_up_imports() -> None:
    """What a spare can do before it knows its coordinates: import everything its build
    will need, so that the build itself runs no import."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.optimizer_param_scheduler  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    from deadpool_megatron.integration import model  # noqa: F401

    _register_local_backend()


def build_for_rank(
    cfg: TrainConfig, rank: int, world_size: int, cpu_rehearsal: bool,
) -> tuple[TrainingObjects, dict[GroupKey, dist.ProcessGroup]]:
    """The objects of `rank`, built without peers, and the local groups they hold (by name,
    for the swap to the real ones)."""
    from deadpool_megatron.integration.distributed import init_megatron_groups, set_seeds
    from deadpool_megatron.integration.model import build_training_objects
    from deadpool_megatron.integration.optimizer_state import allocate_optimizer_state

    with local_world(rank, world_size):
        init_megatron_groups(cfg)
        set_seeds(cfg.seed)  # registers the tensor-parallel RNG streams the restore sets
        objs = build_training_objects(cfg, cpu_rehearsal, initialize=False)
        allocate_optimizer_state(objs.optimizer)
        registry = group_registry()
    return objs, registry
