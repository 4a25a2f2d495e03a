"""A training iterator with Megatron's persistent data-loader workers moved to a restored
position keeps its workers (integration/megatron_data._reseated): the batches are those of
a loader made fresh at that position, and no worker process is made or lost."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deadpool_megatron.integration.megatron_data import FirstReadResets, _reseated

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


@pytest.fixture
def start_workers() -> Any:
    """Starts a loader's iterator whose workers are shut down after the test, passed or
    failed (none left to the garbage collector)."""
    started: list[Any] = []

    def start(loader: torch.utils.data.DataLoader) -> Any:
        started.append(iter(loader))
        return started[-1]

    yield start
    for it in started:
        it._shutdown_workers()


def test_a_running_iterator_reads_from_the_new_position_with_the_same_workers(
        start_workers: Any) -> None:
    dataset = Numbers()
    running = start_workers(loader_at(dataset, 0))
    first(running, 3)  # mid-epoch, with batches prefetched past this point
    pids = sorted(w.pid for w in running._workers)
    # Back to an earlier position (a rank that recomputes) and on to a later one.
    for consumed in (4, 40):
        assert _reseated(running, loader_at(dataset, consumed))
        expected = first(iter(loader_at(dataset, consumed, workers=0)), 4)
        assert first(running, 4) == expected
        assert sorted(w.pid for w in running._workers) == pids
        assert all(w.is_alive() for w in running._workers)


def test_an_iterator_it_cannot_reuse_is_left_as_it_was(start_workers: Any) -> None:
    dataset = Numbers()
    in_process = iter(loader_at(dataset, 0, workers=0))
    assert not _reseated(in_process, loader_at(dataset, 8, workers=0))
    assert first(in_process, 1) == [[2, 3]]  # DP rank 1 of 2: its first micro-batch
    not_persistent = start_workers(loader_at(dataset, 0, persistent=False))
    assert not _reseated(not_persistent, loader_at(dataset, 8, persistent=False))
    other = start_workers(loader_at(dataset, 0))
    assert not _reseated(other, loader_at(Numbers(), 8))  # another dataset
    assert not _reseated(other, loader_at(dataset, 8, workers=1))  # other workers
    assert first(other, 1) == [[2, 3]]


def test_a_loader_handed_running_workers_reads_them_where_it_is_moved_first(
        start_workers: Any) -> None:
    """A spare's loader (integration/spare_loaders.py): iterating it resets nothing yet;
    moved to the restored position, its first read resets the workers there."""
    dataset = Numbers()
    warm = start_workers(loader_at(dataset, 0))
    pids = sorted(w.pid for w in warm._workers)
    built = loader_at(dataset, 0)  # as pretrain() builds it, at sample 0
    built._iterator = FirstReadResets(warm)
    handed = iter(built)
    assert isinstance(handed, FirstReadResets) and handed.pending is built
    assert _reseated(handed, loader_at(dataset, 24))  # the recovery moves it
    assert first(handed, 3) == first(iter(loader_at(dataset, 24, workers=0)), 3)
    assert sorted(w.pid for w in warm._workers) == pids
    # Read without a move, it reads where it was built.
    again = loader_at(dataset, 8)
    again._iterator = FirstReadResets(warm)
    assert first(iter(again), 2) == first(iter(loader_at(dataset, 8, workers=0)), 2)
    with pytest.raises(RuntimeError, match="cannot read its loader's batches"):
        other = loader_at(Numbers(), 0)
        other._iterator = FirstReadResets(warm)
        next(iter(other))


def test_an_iterator_without_torchs_internals_is_made_anew() -> None:
    """Another torch's iterator (no persistent-worker fields as 2.13 keeps them): not
    reused, no error: the caller makes a new one."""
    elsewhere = SimpleNamespace(_persistent_workers=True)  # and nothing else 2.13 keeps
    assert not _reseated(elsewhere, loader_at(Numbers(), 0, workers=0))
