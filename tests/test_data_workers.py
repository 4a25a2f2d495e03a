"""A training iterator with Megatron's persistent data-loader workers moved to a restored
position keeps its workers (integration/megatron_data._reseated): the batches are those of
a loader made fresh at that position, and no worker process is made or lost."""

from __future__ import annotations

from typing import Any

import torch

from deadpool_megatron.integration.megatron_data import _reseated

SAMPLES, MICRO_BATCH, DP_RANK, DP_SIZE = 64, 2, 1, 2


class Numbers(torch.utils.data.Dataset):
    """Sample i is the tensor [i]: a batch names its indices."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def _megatron_sampler() -> Any:
    from deadpool_megatron.rehearsal import prepare_megatron_import
    from deadpool_megatron.rehearsal.imports import provide_typing_override

    prepare_megatron_import(True)  # as the CPU rehearsal imports Megatron's training package
    provide_typing_override()
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    return MegatronPretrainingSampler


def loader_at(dataset: Numbers, consumed: int, workers: int = 2,
              persistent: bool = True) -> torch.utils.data.DataLoader:
    """As Megatron's build_pretraining_data_loader makes it (without its global args)."""
    sampler = _megatron_sampler()(SAMPLES, consumed, MICRO_BATCH, DP_RANK, DP_SIZE)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                       persistent_workers=persistent and workers > 0)


def first(iterator, n: int) -> list[list[int]]:
    return [next(iterator).flatten().tolist() for _ in range(n)]


def test_a_running_iterator_reads_from_the_new_position_with_the_same_workers() -> None:
    dataset = Numbers()
    running = iter(loader_at(dataset, 0))
    first(running, 3)  # mid-epoch, with batches prefetched past this point
    pids = sorted(w.pid for w in running._workers)
    # Back to an earlier position (a rank that recomputes) and on to a later one.
    for consumed in (4, 40):
        assert _reseated(running, loader_at(dataset, consumed))
        expected = first(iter(loader_at(dataset, consumed, workers=0)), 4)
        assert first(running, 4) == expected
        assert sorted(w.pid for w in running._workers) == pids
        assert all(w.is_alive() for w in running._workers)
    running._shutdown_workers()


def test_an_iterator_it_cannot_reuse_is_left_as_it_was() -> None:
    dataset = Numbers()
    in_process = iter(loader_at(dataset, 0, workers=0))
    assert not _reseated(in_process, loader_at(dataset, 8, workers=0))
    assert first(in_process, 1) == [[2, 3]]  # DP rank 1 of 2: its first micro-batch
    not_persistent = iter(loader_at(dataset, 0, persistent=False))
    assert not _reseated(not_persistent, loader_at(dataset, 8, persistent=False))
    other = iter(loader_at(dataset, 0))
    assert not _reseated(other, loader_at(Numbers(), 8))  # another dataset
    assert not _reseated(other, loader_at(dataset, 8, workers=1))  # other workers
    assert first(other, 1) == [[2, 3]]
    for it in (not_persistent, other):
        it._shutdown_workers()
