"""launch/worker_flags.py: the launcher reads the training script's flags as the worker's
own parser does, not by searching strings."""

from __future__ import annotations

import pytest

from deadpool_megatron.config import ConfigError
from deadpool_megatron.launch.worker_flags import worker_flags


def test_every_spelling_the_worker_accepts_means_the_same_here() -> None:
    flags = worker_flags(["--num-layers", "2", "--deadpool", "--deadpool-ranks-per-node=4",
                          "--deadpool-events=/runs/ev", "--save=/ckpt",
                          "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size=2", "--deadpool-allow-same-node-buddy",
                          "--deadpool-inject", "kill rank=1 iter=2",
                          "--deadpool-inject", "kill rank=2 iter=3"])
    ft = flags.deadpool
    assert ft.deadpool and ft.deadpool_ranks_per_node == 4 and ft.deadpool_allow_same_node_buddy
    assert ft.deadpool_events == "/runs/ev" and flags.save == "/ckpt"
    assert ft.deadpool_inject == ["kill rank=1 iter=2", "kill rank=2 iter=3"]
    assert (flags.tp, flags.pp, flags.cp, flags.backend) == (2, 2, 1, "nccl")


def test_a_flag_that_only_starts_like_ours_is_not_ours() -> None:
    """String search took `--deadpool-events X` for --deadpool, and a value equal to a flag's
    name for the flag."""
    assert not worker_flags(["--deadpool-events", "ev"]).deadpool.deadpool
    assert worker_flags(["--deadpool-events=--deadpool"]).deadpool.deadpool_events == \
        "--deadpool"
    assert not worker_flags(["--deadpool-events=--deadpool"]).deadpool.deadpool


def test_a_value_the_worker_would_refuse_is_refused_here_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--deadpool-ranks-per-node"):
        worker_flags(["--deadpool", "--deadpool-ranks-per-node", "four"])


def test_no_deadpool_flags_give_the_defaults() -> None:
    flags = worker_flags(["--lr", "1e-3", "--mock-data"])
    assert not flags.deadpool.deadpool and flags.save is None
    assert flags.deadpool.deadpool_ranks_per_node is None
