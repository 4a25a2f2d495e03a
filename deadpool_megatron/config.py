"""Typed training configuration that also generates Megatron-style command-line flags.

Every field becomes `--field-name` (underscores to dashes), so flag names match Megatron-LM's
(`--tensor-model-parallel-size`, `--micro-batch-size`, ...). Validation errors name the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence, TypeVar, get_type_hints


def flag(help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    """Field metadata: the flag's help text plus any extra argparse settings (choices, ...)."""
    return {"help": help, **argparse_kwargs}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


class ConfigError(ValueError):
    """A bad flag value; the message names the flag and says what to change."""


@dataclass
class TrainConfig:
    """What pretrain_gpt.py needs; defaults give a small CPU rehearsal run."""

    tensor_model_parallel_size: int = field(default=1, metadata=flag("Tensor-parallel size."))
    pipeline_model_parallel_size: int = field(default=1, metadata=flag("Pipeline-parallel size."))
    num_layers: int = field(default=2, metadata=flag("Transformer layers."))
    hidden_size: int = field(default=64, metadata=flag("Hidden size."))
    num_attention_heads: int = field(default=4, metadata=flag("Attention heads."))
    ffn_hidden_size: int | None = field(default=None, metadata=flag("MLP size (4x hidden)."))
    seq_length: int = field(default=32, metadata=flag("Sequence length."))
    max_position_embeddings: int = field(default=32, metadata=flag("Max positions."))
    vocab_size: int = field(default=512, metadata=flag("Vocabulary size (mock/null tokenizer)."))
    micro_batch_size: int = field(default=2, metadata=flag("Micro-batch size per rank."))
    global_batch_size: int = field(default=8, metadata=flag("Global batch size."))
    train_iters: int = field(default=10, metadata=flag("Iterations to train."))
    lr: float = field(default=1e-3, metadata=flag("Peak learning rate."))
    min_lr: float = field(default=0.0, metadata=flag("Minimum learning rate."))
    lr_warmup_iters: int = field(default=0, metadata=flag("Linear warm-up iterations."))
    lr_decay_style: str = field(
        default="cosine", metadata=flag("LR decay.", choices=["constant", "linear", "cosine"])
    )
    weight_decay: float = field(default=0.01, metadata=flag("Weight decay."))
    clip_grad: float = field(default=1.0, metadata=flag("Gradient clipping norm (0: off)."))
    adam_beta1: float = field(default=0.9, metadata=flag("Adam beta1."))
    adam_beta2: float = field(default=0.999, metadata=flag("Adam beta2."))
    hidden_dropout: float = field(default=0.1, metadata=flag("Hidden dropout."))
    attention_dropout: float = field(default=0.1, metadata=flag("Attention dropout."))
    seed: int = field(default=1234, metadata=flag("Random seed."))
    mock_data: bool = field(default=False, metadata=flag("Use Megatron's mock GPT dataset."))
    data_path: str | None = field(
        default=None, metadata=flag("Prefix of a Megatron indexed dataset (.bin/.idx).")
    )
    use_distributed_optimizer: bool = field(
        default=False, metadata=flag("Shard optimizer state across data-parallel ranks.")
    )
    bf16: bool = field(default=False, metadata=flag("bf16 parameters (GPU runs)."))
    distributed_backend: str = field(
        default="nccl", metadata=flag("Process-group backend.", choices=["gloo", "nccl"])
    )
    distributed_timeout_minutes: float = field(
        default=10.0, metadata=flag("Timeout of collectives, in minutes.")
    )
    save: str | None = field(default=None, metadata=flag("Directory for durable checkpoints."))
    load: str | None = field(default=None, metadata=flag("Directory to resume from."))
    save_interval: int | None = field(default=None, metadata=flag("Save every N iterations."))
    exit_interval: int | None = field(
        default=None, metadata=flag("Stop (after saving) once the iteration divides by N.")
    )
    ckpt_fully_parallel_save: bool = field(default=False, metadata=flag(
        "Spread the writing of data-parallel replicas over the data-parallel ranks "
        "(megatron-core's fully parallel save) instead of DP rank 0 writing them all."))
    ckpt_fully_parallel_load: bool = field(default=False, metadata=flag(
        "Each data-parallel rank reads a part of the replicated state and they exchange it "
        "(megatron-core's fully parallel load)."))
    ckpt_assume_constant_structure: bool = field(default=False, metadata=flag(
        "The checkpoint's structure never changes: reuse the first save's plans and "
        "metadata (cached save plans) instead of exchanging them at every save."))
    async_save: bool = field(default=False, metadata=flag(
        "Megatron-LM's asynchronous save: not supported by this script (the validation "
        "says why and what to use)."))
    log_interval: int = field(default=1, metadata=flag("Log every N iterations."))
    log_param_changes: bool = field(
        default=False, metadata=flag("At the end, log how many parameter tensors changed.")
    )
    num_threads: int = field(
        default=1, metadata=flag("torch threads per rank (fixed: bit-identity depends on it).")
    )

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size

    def num_microbatches(self, world_size: int) -> int:
        return self.global_batch_size // (
            self.micro_batch_size * self.data_parallel_size(world_size)
        )

    def validate(self, world_size: int) -> None:
        """Raise ConfigError naming the flag to change; call before any process group."""
        positive = (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers",
            "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
            "vocab_size", "micro_batch_size", "global_batch_size", "train_iters",
            "log_interval", "num_threads",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag_name(name)} must be positive, got {getattr(self, name)}")
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if world_size % (tp * pp) != 0:
            raise ConfigError(
                f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) "
                f"= {tp * pp} does not divide the world size {world_size}; choose sizes whose "
                f"product divides the number of processes."
            )
        dp = self.data_parallel_size(world_size)
        if self.global_batch_size % (self.micro_batch_size * dp) != 0:
            raise ConfigError(
                f"--global-batch-size ({self.global_batch_size}) is not divisible by "
                f"--micro-batch-size ({self.micro_batch_size}) x data-parallel size ({dp}); "
                f"use a multiple of {self.micro_batch_size * dp}."
            )
        if self.num_layers % pp != 0:
            raise ConfigError(
                f"--num-layers ({self.num_layers}) must be divisible by "
                f"--pipeline-model-parallel-size ({pp})."
            )
        if self.num_attention_heads % tp != 0:
            raise ConfigError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})."
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"--hidden-size ({self.hidden_size}) must be divisible by "
                f"--num-attention-heads ({self.num_attention_heads})."
            )
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings})."
            )
        if not self.mock_data and not self.data_path:
            raise ConfigError("no training data: pass --mock-data or --data-path PREFIX.")
        if self.mock_data and self.data_path:
            raise ConfigError("--mock-data and --data-path are exclusive; pass one of them.")
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError(f"--save-interval must be positive, got {self.save_interval}")
        if self.save_interval is not None and not self.save:
            raise ConfigError("--save-interval needs --save DIR to write checkpoints to.")
        if self.async_save:
            raise ConfigError(
                "--async-save is not supported by pretrain_gpt.py: its saves are synchronous "
                "(megatron-core's asynchronous save hands the write to a forked writer process "
                "that must be finalized by a collective every iteration). Use "
                "--ckpt-assume-constant-structure (cached save plans) and "
                "--ckpt-fully-parallel-save to shorten the blocking save, or --deadpool, whose "
                "snapshots make frequent durable saves unnecessary.")
        if self.exit_interval is not None and self.exit_interval <= 0:
            raise ConfigError(f"--exit-interval must be positive, got {self.exit_interval}")


C = TypeVar("C")


def add_arguments(parser: argparse.ArgumentParser, config_cls: type, group: str) -> None:
    """Add one flag per dataclass field of `config_cls` to `parser`."""
    hints = get_type_hints(config_cls)
    arg_group = parser.add_argument_group(group)
    for f in dataclasses.fields(config_cls):
        meta = dict(f.metadata)
        help_text = meta.pop("help", "")
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if hint is bool:
            arg_group.add_argument(flag_name(f.name), dest=f.name, action="store_true",
                                   default=default, help=help_text)
            continue
        base = _base_type(hint)
        if meta.pop("repeatable", False):
            arg_group.add_argument(flag_name(f.name), dest=f.name, action="append", type=base,
                                   default=None, help=help_text, **meta)
            continue
        arg_group.add_argument(flag_name(f.name), dest=f.name, type=base, default=default,
                               help=f"{help_text} (default: {default})", **meta)


def _base_type(hint: Any) -> type:
    args = getattr(hint, "__args__", None)
    if args:  # `X | None`
        return next(a for a in args if a is not type(None))
    return hint


def from_namespace(config_cls: type[C], ns: argparse.Namespace) -> C:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(config_cls)}  # type: ignore[arg-type]
    for f in dataclasses.fields(config_cls):  # type: ignore[arg-type]
        if f.metadata.get("repeatable") and values[f.name] is None:
            values[f.name] = f.default_factory()  # type: ignore[misc]
    return config_cls(**values)


def parse_configs(config_classes: Sequence[type], argv: Sequence[str] | None,
                  prog: str) -> list[Any]:
    """One parser for several config dataclasses; returns one instance of each."""
    parser = argparse.ArgumentParser(prog=prog)
    for cls in config_classes:
        add_arguments(parser, cls, cls.__name__)
    ns = parser.parse_args(argv)
    return [from_namespace(cls, ns) for cls in config_classes]
