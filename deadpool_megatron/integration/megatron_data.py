"""Megatron-LM's data positions across a re-entry of train(): the training iterator moved to
the restored sample count on a rank that recomputes, the validation iterator to where the
evaluations up to the restored iteration left it. Moved in place, built locally over the
same dataset: no collective, no dataset rebuilt."""

from __future__ import annotations

import argparse
from typing import Any, Sequence


def data_iterator_at(iterator: Any, consumed_samples: int) -> Any:
    """Megatron's data iterator (training or validation) moved to `consumed_samples`, in
    place: the same object reads a loader built locally over the same dataset, so every
    holder of it (pretrain() keeps the validation iterator for its final evaluation) reads
    from there on. The random streams are left as they were (making a DataLoader's iterator
    draws its workers' base seed from torch's default generator, which on CPU dropout reads
    too)."""
    import torch
    from megatron.training import get_args
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    if iterator is None:  # a rank that reads no data (Megatron gives it no iterator)
        return None
    if isinstance(iterator, list):  # a virtual pipeline: one iterator per model chunk
        return [data_iterator_at(each, consumed_samples) for each in iterator]
    dataset = getattr(getattr(iterator, "iterable", None), "_dataset", None)
    if dataset is None or get_args().dataloader_type != "single":
        raise RuntimeError("only Megatron's 'single' data loader can be moved to a restored "
                           "position: drop --dataloader-type "
                           f"{get_args().dataloader_type}")
    loader = build_pretraining_data_loader(dataset, consumed_samples)
    with torch.random.fork_rng(devices=[]):
        if not _reseated(iterator.iterable, loader):
            iterator.iterable = iter(loader)
    # Nothing of the old position replays (RerunDataIterator's own record of it).
    iterator.saved_microbatches, iterator.replaying, iterator.replay_pos = [], False, 0
    return iterator


def workers_serve(running: Any, loader: Any) -> bool:
    """Whether `running`, a DataLoader iterator with persistent worker processes, can read
    `loader`'s batches with its workers: a worker reads whatever indices it is sent, so it
    serves any sampler over the same dataset, collated the same way. False where torch's
    iterator does not keep these as torch 2.13's does (the caller makes a new one)."""
    try:
        return bool(running._persistent_workers and not running._shutdown
                    and callable(running._reset)
                    and running._dataset is loader.dataset
                    and running._num_workers == loader.num_workers
                    and running._auto_collation == loader._auto_collation
                    and running._drop_last == loader.drop_last
                    and running._collate_fn is loader.collate_fn)
    except AttributeError:
        return False


def _reseated(running: Any, loader: Any) -> bool:
    """Whether `running` now reads `loader`'s batches (`workers_serve`): its workers kept, as
    torch keeps them from one epoch to the next, only the sampler replaced. Measured at 8
    ranks with Megatron's default 2 workers a loader, making new ones instead (forking the
    workers, then shutting the old ones down) was 0.2-0.3 s of a recovery. False (nothing
    changed) for any other iterator: the caller makes a new one."""
    if not workers_serve(running, loader):
        return False
    running._index_sampler = loader._index_sampler
    running._reset(loader)  # the old epoch's prefetched batches are received and dropped
    return True


class FirstReadResets:
    """A persistent-worker DataLoader iterator that a loader takes over (`DataLoader.__iter__`
    resets it), reset to that loader's position only when first read: a spare's loaders,
    started while it waited (integration/spare_loaders.py), are moved to the restored
    position before they are read, so their workers compute no batch of the position
    pretrain() built them at. Reads as the running iterator does (`workers_serve` and
    spread_iterator read through it)."""

    def __init__(self, running: Any) -> None:
        self.running, self.pending = running, None

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        self.pending = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["running"], name)

    def __iter__(self) -> "FirstReadResets":
        return self

    def __next__(self) -> Any:
        if self.pending is not None:
            loader, self.pending = self.pending, None
            if not _reseated(self.running, loader):
                raise RuntimeError("a spare's data-loader workers cannot read its loader's "
                                   "batches (another dataset or loader settings)")
        return next(self.running)


def spread_iterator(iterator: Any, consumed_samples: int, items: Sequence[tuple[int, int]],
                    micro_batch_size: int, dp_size: int) -> Any:
    """The micro-batches `items` ((data-parallel rank, index) pairs of the global batch
    that starts at `consumed_samples`) read from the dataset of Megatron's training
    `iterator` and collated as its loader collates: a spread replay computes some of
    another replica's micro-batches. Made locally, without worker processes; the random
    streams untouched (see data_iterator_at)."""
    import torch
    from megatron.training import get_args

    from deadpool_megatron.integration.data import microbatch_sample_indices

    if iterator is None:  # a rank that reads no data
        return None
    loader = getattr(iterator, "iterable", None)
    dataset, collate = getattr(loader, "_dataset", None), getattr(loader, "_collate_fn", None)
    if dataset is None or collate is None or get_args().dataloader_type != "single":
        raise RuntimeError("a spread replay reads micro-batches from Megatron's 'single' "
                           "data loader only: drop --deadpool-replay spread or "
                           f"--dataloader-type {get_args().dataloader_type}")
    batches = [list(microbatch_sample_indices(consumed_samples, index, micro_batch_size,
                                              dp_rank, dp_size)) for dp_rank, index in items]
    with torch.random.fork_rng(devices=[]):
        return iter(torch.utils.data.DataLoader(dataset, batch_sampler=batches,
                                                collate_fn=collate))


def evaluated(args: argparse.Namespace, iteration: int) -> int:
    """The validation samples train() consumes evaluating after `iteration` (0: no
    evaluation then), by train()'s own condition and evaluate()'s batch."""
    interval = getattr(args, "eval_interval", None)
    start = getattr(args, "start_eval_at_iter", None)
    if not interval or iteration % interval or not getattr(args, "do_valid", False) or \
            (start is not None and iteration < start):
        return 0
    return int(args.eval_iters) * int(getattr(args, "eval_global_batch_size", None)
                                      or args.global_batch_size)


def validation_at(arguments: dict[str, Any], valid_consumed: int) -> None:
    """The validation iterator where the evaluations up to the restored iteration left it
    (a spare's starts at 0; a survivor's is where its last evaluation left it), so the next
    evaluation reads what a failure-free run reads. Megatron's --full-validation reads the
    whole set each time: nothing to move."""
    from megatron.training import get_args

    margs = get_args()
    iterator = arguments.get("valid_data_iterator")
    if iterator is None or getattr(margs, "full_validation", False) or \
            int(getattr(margs, "consumed_valid_samples", 0)) == valid_consumed:
        return
    if getattr(margs, "multiple_validation_sets", False):
        raise RuntimeError("moving several validation sets' iterators to a restored position "
                           "is not supported yet: use one --valid-data-path")
    arguments["valid_data_iterator"] = data_iterator_at(iterator, valid_consumed)
    margs.consumed_valid_samples = valid_consumed


class BatchSchedule:
    """Micro-batches per replica in an iteration under Megatron's batch-size schedule
    (--step-batch-size-schedule): what a recovery plans with when the interrupted
    iteration's batch is not the job's first. Megatron's own calculator is walked from
    the start, as Megatron's update_train_iters walks it, and put back where train() left
    it; the consumed samples before each iteration are kept, so each is walked once."""

    def __init__(self) -> None:
        self._consumed = [0]  # samples consumed before iteration i + 1

    def __call__(self, iteration: int) -> int:
        from megatron.core.num_microbatches_calculator import (
            get_current_global_batch_size, get_num_microbatches, update_num_microbatches)
        from megatron.training import get_args

        try:
            while len(self._consumed) < iteration:
                update_num_microbatches(self._consumed[-1], consistency_check=False)
                self._consumed.append(self._consumed[-1] + get_current_global_batch_size())
            update_num_microbatches(self._consumed[iteration - 1], consistency_check=False)
            return int(get_num_microbatches())
        finally:
            update_num_microbatches(int(get_args().consumed_train_samples),
                                    consistency_check=False)
