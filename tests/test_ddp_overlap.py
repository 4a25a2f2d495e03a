"""integration/ddp_overlap.py: which start of an overlapped bucket reduction finds every
gradient in place (a replica stopped there may keep them) and which does not."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deadpool_megatron.integration.ddp_overlap import (unwatch_bucket_reductions,
                                                       watch_bucket_reductions)


class BucketGroup:
    def __init__(self, started: list[str], name: str) -> None:
        self.started, self.name = started, name

    def start_grad_sync(self) -> None:
        self.started.append(self.name)


def _chunks(count: int, started: list[str]) -> list[SimpleNamespace]:
    return [SimpleNamespace(ddp_config=SimpleNamespace(overlap_grad_reduce=True),
                            bucket_groups=[BucketGroup(started, f"chunk{c}")])
            for c in range(count)]


def _start_inside_a_backward(group: BucketGroup) -> None:
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: group.start_grad_sync())
    y.sum().backward()


def test_one_chunk_keeps_gradients_only_for_a_start_after_its_backward() -> None:
    started: list[str] = []
    accumulated: list[bool] = []
    model = _chunks(1, started)
    watch_bucket_reductions(model, accumulated.append)
    model[0].bucket_groups[0].start_grad_sync()  # the schedule's grad_sync_func, finalize
    _start_inside_a_backward(model[0].bucket_groups[0])  # DDP's gradient hook
    assert accumulated == [True, False] and started == ["chunk0", "chunk0"]
    unwatch_bucket_reductions(model)
    model[0].bucket_groups[0].start_grad_sync()
    assert accumulated == [True, False] and len(started) == 3  # unwatched


def test_a_virtual_pipelines_chunk_never_finds_every_gradient_in_place() -> None:
    """The interleaved schedule starts chunk 1's reduction after its last backward, outside
    autograd, while chunk 0's backward is still to run: a replica stopped there must
    recompute (kept, chunk 0's gradients would be partial)."""
    started: list[str] = []
    accumulated: list[bool] = []
    model = _chunks(2, started)
    watch_bucket_reductions(model, accumulated.append)
    model[1].bucket_groups[0].start_grad_sync()
    model[0].bucket_groups[0].start_grad_sync()
    assert accumulated == [False, False] and started == ["chunk1", "chunk0"]
