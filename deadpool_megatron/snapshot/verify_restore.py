"""`--deadpool-verify-restore-at K`: every rank swaps its live state for a fresh model
restored from the copy in its buddy's memory, then training goes on.

A run with it must end with the same fingerprint as a run without it: that proves the
committed snapshots hold the exact state (parameters, optimizer, scheduler, RNG, data
position) and that restoring into freshly built objects works, before any failure needs it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from deadpool_megatron.integration.model import TrainingObjects
from deadpool_megatron.snapshot.engine import SnapshotEngine
from deadpool_megatron.snapshot.restore import restore_shard
from deadpool_megatron.hooks import LoopState, TrainingHooks

log = logging.getLogger("deadpool_megatron.snapshot")


class RestoreCheck(TrainingHooks):
    def __init__(self, engine: SnapshotEngine, at_iteration: int,
                 build: Callable[[], TrainingObjects], distributed_optimizer: bool) -> None:
        self.engine = engine
        self.at = at_iteration
        self.build = build
        self.distributed_optimizer = distributed_optimizer

    def after_iteration(self, state: LoopState) -> None:
        if state.iteration != self.at:
            return
        t0 = time.perf_counter()
        slot = self.engine.fetch_own_from_buddy()
        fresh = self.build()
        objects = restore_shard(fresh, slot, self.distributed_optimizer)
        if objects["iteration"] != state.iteration:
            raise RuntimeError(f"buddy returned snapshot {objects['iteration']}, "
                               f"expected {state.iteration}")
        state.objects = fresh
        state.iteration = objects["iteration"]
        state.consumed_samples = objects["consumed_samples"]
        self.engine.attach(fresh)
        if torch.distributed.get_rank() == 0:
            log.info("restore check: every rank now runs on a fresh model restored from "
                     "its buddy's copy of snapshot %d (%.0f ms)", state.iteration,
                     1e3 * (time.perf_counter() - t0))
