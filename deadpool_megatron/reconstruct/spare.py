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
survivor's old groups are (rebind.py). No optimizer step: the optimizer state is allocated as
its first step would (snapshot/engine.py's attach). The build itself is the training loop's
(training/driver.py): ours, or Megatron-LM's own `setup_model_and_optimizer`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist


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
    collective is answered locally. Every group made in it is local too, whatever backend
    its maker names (Megatron-LM makes gloo duplicates of some groups)."""
    _register_local_backend()
    dist.init_process_group(dist.Backend.FAKE, store=dist.HashStore(), rank=rank,
                            world_size=world_size)
    new_group = dist.new_group

    def local_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("backend", None)
        kwargs.pop("pg_options", None)
        return new_group(*args, **kwargs)

    dist.new_group = local_group  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.new_group = new_group  # type: ignore[assignment]
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()


def warm_up_imports() -> None:
    """What a spare can do before it knows its coordinates: import everything its build
    will need, so that the build itself runs no import."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.mimo  # noqa: F401 - get_megatron_optimizer imports it
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.optimizer_param_scheduler  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    from deadpool_megatron.integration import model  # noqa: F401

    _register_local_backend()
