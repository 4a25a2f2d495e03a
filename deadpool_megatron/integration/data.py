"""Training data: Megatron's GPT datasets with a deterministic per-data-parallel-rank sampler.

The data position is one integer, `consumed_samples` (as in Megatron). Which samples a rank
reads for a micro-batch is a pure function of it, so any rank (a spare included) can resume
the stream exactly from a snapshot or checkpoint.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from deadpool_megatron.config import TrainConfig


def microbatch_sample_indices(
    consumed_samples: int, microbatch: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> range:
    """Global sample indices of one micro-batch, laid out like Megatron's pretraining sampler.

    A global batch starting at `consumed_samples` is read in rounds of micro_batch_size * dp
    samples; data-parallel rank d takes the d-th slice of each round.
    """
    start = consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
    return range(start, start + micro_batch_size)


def build_train_dataset(cfg: TrainConfig, num_samples: int) -> Any:
    """Build Megatron's (mock or indexed) GPT dataset in-process, with no cache directory.

    It is built before the process group exists, so no rank waits on another and a spare
    joining later builds the very same dataset on its own.
    """
    assert not torch.distributed.is_initialized(), "build the dataset before process groups"
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    config = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=None if cfg.mock_data else ([cfg.data_path], None),
        split="1,0,0",
        tokenizer=NullTokenizer(vocab_size=cfg.vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,
    )
    cls = MockGPTDataset if cfg.mock_data else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        cls, [num_samples, 0, 0], lambda: True, config
    ).build()
    return train


class MicrobatchIterator:
    """Yields the given micro-batches of one global batch, then stops.

    A fresh iterator per iteration keeps the position explicit: replaying an iteration is
    building this iterator again from the same `consumed_samples`. `items` lists
    (data-parallel rank, micro-batch index) pairs: a rank's own are (dp_rank, 0..N-1); a
    spread replay hands a replica some of another replica's.
    """

    def __init__(self, dataset: Any, consumed_samples: int,
                 items: Sequence[tuple[int, int]], micro_batch_size: int, dp_size: int) -> None:
        self._dataset = dataset
        self._consumed = consumed_samples
        self._items = list(items)
        self._mbs = micro_batch_size
        self._dp_size = dp_size
        self._next = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._next >= len(self._items):
            raise StopIteration
        dp_rank, index = self._items[self._next]
        indices = microbatch_sample_indices(self._consumed, index, self._mbs, dp_rank,
                                            self._dp_size)
        self._next += 1
        samples = [self._dataset[i] for i in indices]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
