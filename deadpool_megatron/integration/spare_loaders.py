"""A spare's data-loader worker processes, started while it waits.

Megatron's loaders (`--num-workers`, 2 by default) fork their workers when pretrain() first
iterates them: for a spare that is at its assignment, on the recovery's critical path. At
8 ranks on 2 cores a spare's training, validation and test loaders forked 6 workers there;
its build alone took 0.26-0.32 s against 0.05 s without workers, and every survivor waited
for it in the new groups. A worker reads whatever indices it is sent, so one started over
the same dataset serves any sampler of it: a spare builds its loaders while it waits with
Megatron's own builder (its workers' settings and init function), at a stand-in position,
and hands each to the loader pretrain() builds over the same dataset: its workers are
reset to that loader's position (torch's persistent workers, as between epochs) when it is
first read, after the recovery moved it to the restored position.

A loader that pins memory (Megatron's do, where an accelerator is seen) starts its
pin-memory thread on the device current when its iterator is made: the loaders are started
with this process's device bound, the one its slot gives it and it keeps at whatever rank
it is assigned (integration/device.py), so the thread pins for the device that trains.
"""

from __future__ import annotations

import contextlib
import logging
import time
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

from deadpool_megatron.integration.device import ProcessDevice

log = logging.getLogger("deadpool_megatron.megatron_lm")


class SpareLoaders:
    """Running loader iterators of a waiting spare, one a dataset, until handed over."""

    def __init__(self, running: dict[int, Any]) -> None:
        self.running = running  # id(dataset) -> its loader's running iterator

    @classmethod
    def start(cls, datasets: Iterable[Any] | None, device: ProcessDevice) -> "SpareLoaders":
        """Each dataset's loader built and started (its workers forked, its pin-memory
        thread on `device`); none where the loaders have no workers or are not Megatron's
        'single' loader. `datasets`: a provider's (train, valid, test), validation sets as
        one or a list."""
        import torch
        from megatron.training import get_args
        from megatron.training.datasets import data_samplers

        margs = get_args()
        if margs.num_workers <= 0 or margs.dataloader_type != "single":
            return cls({})
        t0 = time.perf_counter()
        running: dict[int, Any] = {}
        # Megatron's builder asks the sampler's data-parallel coordinates of its groups,
        # which a waiting spare has not joined: it gets the first of one.
        one_replica = SimpleNamespace(get_data_parallel_rank=lambda: 0,
                                      get_data_parallel_world_size=lambda: 1)
        with device.thread(), _replaced(data_samplers, "mpu", one_replica), \
                torch.random.fork_rng(devices=[]):
            for dataset in _flat(datasets):
                if dataset is not None and id(dataset) not in running:
                    loader = data_samplers.build_pretraining_data_loader(dataset, 0)
                    running[id(dataset)] = iter(loader)
        log.info("spare: %d data-loader workers started ahead in %.0f ms",
                 sum(r._num_workers for r in running.values()),
                 1e3 * (time.perf_counter() - t0))
        return cls(running)

    @contextlib.contextmanager
    def handed_over(self) -> Iterator[None]:
        """Within: the loaders pretrain() builds over these datasets use their workers.
        Megatron's builder is put back once the last is handed over (or at the end)."""
        from megatron.training import training

        from deadpool_megatron.integration.megatron_data import FirstReadResets, workers_serve

        build = training.build_pretraining_data_loader

        def adopting(dataset: Any, consumed_samples: int) -> Any:
            loader = build(dataset, consumed_samples)
            running = self.running.pop(id(dataset), None) if dataset is not None else None
            if running is not None and workers_serve(running, loader):
                loader._iterator = FirstReadResets(running)  # read where it is moved to
                log.info("spare: the %s loader took the workers started ahead",
                         _split_name(dataset))
            elif running is not None:
                log.warning("spare: the workers started ahead for the %s loader do not "
                            "serve the loader pretrain() built; it starts its own",
                            _split_name(dataset))
                running._shutdown_workers()
            if not self.running:
                training.build_pretraining_data_loader = build
            return loader

        if self.running:
            training.build_pretraining_data_loader = adopting
        try:
            yield
        finally:
            training.build_pretraining_data_loader = build
            self.close()

    def close(self) -> None:
        """The workers of loaders nobody took, stopped."""
        for running in self.running.values():
            running._shutdown_workers()
        self.running.clear()


def _split_name(dataset: Any) -> str:
    split = getattr(dataset, "index_split", None) or getattr(dataset, "split", None)
    return str(getattr(split, "name", split or "data"))


@contextlib.contextmanager
def _replaced(module: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _flat(datasets: Iterable[Any] | None) -> list:
    """A provider's (train, valid, test), a list of validation sets flattened."""
    flat: list = []
    for each in datasets or ():
        flat += each if isinstance(each, list) else [each]
    return flat
