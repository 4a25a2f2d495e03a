"""A waiting spare starts its data loaders' workers with Megatron's own builder
(integration/spare_loaders.py), with this process's device current: a loader that pins
memory starts its pin-memory thread on the device current when its iterator is made, and a
spare keeps its slot's device at any rank. Here on CPU the device is a stand-in that says
when it is bound; the loaders, their workers and Megatron's builder are real."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from deadpool_megatron.integration.spare_loaders import SpareLoaders

SAMPLES = 32


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class StandInDevice:
    """Says whether the calling code is inside its `thread()`, as ProcessDevice binds."""

    def __init__(self) -> None:
        self.bound = False

    @contextlib.contextmanager
    def thread(self) -> Iterator[None]:
        self.bound = True
        try:
            yield
        finally:
            self.bound = False


@pytest.fixture
def megatron_args(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Megatron's global arguments as its loader builder reads them, for these tests."""
    from deadpool_megatron.rehearsal import prepare_megatron_import
    from deadpool_megatron.rehearsal.imports import provide_typing_override

    prepare_megatron_import(True)  # as the CPU rehearsal imports Megatron's training package
    provide_typing_override()
    import megatron.training
    from megatron.training.datasets import data_samplers

    margs = SimpleNamespace(num_workers=2, dataloader_type="single", micro_batch_size=2,
                            global_batch_size=8, full_validation=False,
                            hybrid_context_parallel=False, exit_signal_handler=False)
    monkeypatch.setattr(megatron.training, "get_args", lambda: margs)
    monkeypatch.setattr(data_samplers, "get_args", lambda: margs)
    return margs


def test_a_spares_loaders_start_with_its_device_current(
        megatron_args: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    device, current_at_start = StandInDevice(), []
    make_iterator = torch.utils.data.DataLoader._get_iterator

    def noting(loader: torch.utils.data.DataLoader) -> Any:
        current_at_start.append(device.bound)
        return make_iterator(loader)

    monkeypatch.setattr(torch.utils.data.DataLoader, "_get_iterator", noting)
    train, valid = Numbers(), Numbers()
    loaders = SpareLoaders.start((train, [valid], None), device)  # type: ignore[arg-type]
    try:
        assert current_at_start == [True, True]
        assert not device.bound
        assert sorted(loaders.running) == sorted([id(train), id(valid)])
        for running in loaders.running.values():
            assert running._num_workers == 2 and running._workers_status == [True, True]
    finally:
        loaders.close()
    assert not loaders.running


def test_loaders_without_workers_are_not_started(megatron_args: SimpleNamespace) -> None:
    megatron_args.num_workers = 0
    loaders = SpareLoaders.start((Numbers(), None, None), StandInDevice())  # type: ignore[arg-type]
    assert loaders.running == {}
