"""What the launcher needs of the training script's flags, read with the same config the
worker parses them with (ft_config.DeadPoolConfig), so that `--flag=value`, a repeated
flag or a value that looks like a flag mean here what they mean there."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from deadpool_megatron.config import ConfigError, add_arguments, from_namespace
from deadpool_megatron.ft_config import DeadPoolConfig


@dataclass(frozen=True)
class WorkerFlags:
    deadpool: DeadPoolConfig
    save: str | None  # Megatron's --save: where a restart resumes from
    backend: str  # --distributed-backend (Megatron's default: nccl)
    tp: int = 1  # the parallel sizes deadpool-inject resolves coordinates with
    pp: int = 1
    cp: int = 1


def worker_flags(script_args: Sequence[str]) -> WorkerFlags:
    """The --deadpool... group, --save, --distributed-backend and the parallel sizes of
    `script_args`; every other flag is the script's own and left alone. A value this parser
    refuses raises ConfigError (the worker would refuse it too)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_arguments(parser, DeadPoolConfig, "deadpool")
    parser.add_argument("--save", default=None)
    parser.add_argument("--distributed-backend", default="nccl")
    for size in ("tensor-model", "pipeline-model", "context"):
        parser.add_argument(f"--{size}-parallel-size", type=int, default=1)
    try:
        ns, _ = parser.parse_known_args(list(script_args))
    except argparse.ArgumentError as err:
        raise ConfigError(f"the training script's flags: {err}") from None
    return WorkerFlags(from_namespace(DeadPoolConfig, ns), ns.save, ns.distributed_backend,
                       ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size,
                       ns.context_parallel_size)
