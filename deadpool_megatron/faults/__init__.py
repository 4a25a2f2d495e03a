"""Scripted fault injection, built into the training hooks (`--deadpool-inject`)."""

from deadpool_megatron.faults.spec import FaultSpec, parse_fault, target_ranks

__all__ = ["FaultSpec", "parse_fault", "target_ranks"]
