"""Durable checkpoints with megatron.core.dist_checkpointing: the fallback of last resort.

Layout follows Megatron-LM: DIR/iter_0000010/ holds one checkpoint and
DIR/latest_checkpointed_iteration.txt names the newest complete one (written last, so a
checkpoint interrupted mid-save is never picked up).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Callable, ContextManager, Iterator

import torch

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.integration.model import TrainingObjects
from deadpool_megatron.integration.plain_gather import all_gather_plain
from deadpool_megatron.integration.rng_state import get_rng_state, set_rng_state
from deadpool_megatron.integration.optimizer_state import (
    allocate_optimizer_state,
    inner_optimizers,
)
from deadpool_megatron.hooks import LoopState

TRACKER = "latest_checkpointed_iteration.txt"
# Megatron-LM's default format for the distributed optimizer: each rank writes its own buffer
# shards with no gather (resharding only along data parallelism).
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
log = logging.getLogger("deadpool_megatron.checkpoint")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} is corrupt (holds {text!r}); delete it or pass another --load")
    return int(text)


def newer_flush(root: str | None, checkpoint: int | None) -> int | None:
    """The iteration of the snapshot a flush committed under `root` (snapshot/flush.py)
    if it is newer than the checkpoint of iteration `checkpoint` (None: no checkpoint);
    otherwise None: the checkpoint is the state to load."""
    from deadpool_megatron.snapshot import flush

    flushed = flush.latest(root) if root else None
    if flushed is not None and (checkpoint is None or flushed > checkpoint):
        return flushed
    return None


def load_flushed(state: LoopState, root: str, iteration: int, distributed_optimizer: bool,
                 instead: str) -> bool:
    """This rank's shard of the snapshot a flush wrote into `state` (its objects, iteration
    and data positions): in our loop and in Megatron's alike, over whatever the loop built
    or loaded before (`instead` says what: Megatron's checkpoint, or nothing). Collective:
    every rank reads and checks its shard before any writes one, and they agree.

    A shard damaged on disk (unreadable, or failing its checksum) on any rank: the flush is
    set aside (flush.set_aside) and every rank keeps `instead`, returning False. The job
    then redoes the iterations since that checkpoint, deterministically, to the same result:
    time is lost, no state. A shard of another layout or model (a relaunch with other
    flags) ends the start on every rank with the reason, and the flush stays: the fix is
    the command line, and the flush holds the newest state."""
    from deadpool_megatron.snapshot import flush
    from deadpool_megatron.snapshot.restore import (
        SnapshotDamaged,
        SnapshotMismatch,
        apply_shard,
        check_shard,
    )

    rank = torch.distributed.get_rank()
    problem: dict[str, str] | None = None
    try:
        slot = flush.read_shard(root, iteration, rank)
        manifest, objects = check_shard(state.objects, slot, distributed_optimizer)
    except (flush.FlushError, SnapshotDamaged) as err:
        problem = {"damaged": str(err)}
    except SnapshotMismatch as err:
        problem = {"mismatch": str(err)}
    problems = {r: p for r, p in enumerate(all_gather_plain(problem)) if p is not None}
    mismatched = {r: p["mismatch"] for r, p in problems.items() if "mismatch" in p}
    if mismatched:
        first = min(mismatched)
        raise flush.FlushError(
            f"rank {first}: {mismatched[first]} (ranks {sorted(mismatched)}); relaunch with "
            f"the parallel layout and model it was flushed with, or delete "
            f"{os.path.join(root, flush.ROOT, flush.LATEST)} to load {instead}")
    if problems:
        if rank == 0:
            aside = flush.set_aside(root, iteration)
            log.error("the snapshot of iteration %d flushed to %s cannot be loaded: %s; "
                      "loading %s instead (the flush is kept as %s)", iteration, root,
                      "; ".join(f"rank {r}: {p['damaged']}" for r, p in problems.items()),
                      instead, aside)
        return False
    apply_shard(state.objects, manifest, slot, objects)
    state.iteration = int(objects["iteration"])
    state.consumed_samples = int(objects["consumed_samples"])
    state.valid_consumed = int(objects.get("valid_consumed", 0))
    if rank == 0:
        log.info("loaded the snapshot of iteration %d flushed to %s", state.iteration,
                 flush.iteration_dir(root, iteration))
    return True


def restore_adam_steps(optimizer: Any, loaded_optimizer_state: dict[str, Any]) -> None:
    """Set every Adam state entry's `step` to the checkpoint's step, each its own tensor.

    Without apex/TE, megatron-core 0.19's DistributedOptimizer.load_state_dict puts one
    shared `step` tensor into every state entry and then overwrites it from the parameter
    state being loaded, which leaves the step of the fresh optimizer (torch's Adam would
    also increment the shared tensor once per parameter). The common state's param groups
    hold the true step.
    """
    common = loaded_optimizer_state.get("optimizer", {})
    steps = {g["step"] for g in common.get("param_groups", []) if "step" in g}
    if len(steps) != 1:
        return  # apex/TE optimizers keep their step elsewhere; nothing to mend
    step = float(steps.pop())
    for inner in inner_optimizers(optimizer):
        for entry in inner.state.values():
            if isinstance(entry.get("step"), torch.Tensor):
                entry["step"] = torch.tensor(step, dtype=entry["step"].dtype)


def results_in_process() -> bool:
    """Keep a synchronous save's write results in this process; True if it applied.

    megatron-core's checkpoint writer hands its write results back through a
    multiprocessing Manager queue (`filesystem_async.get_write_results_queue`), made at
    each process's first save with the "spawn" method: a new interpreter, which imports
    torch and Megatron to unpickle the results. That was the whole cost of the first save:
    3 s for one process here, 26 to 31 s for 8 ranks on 2 cores (later saves: 0.1 s). A
    synchronous save writes with threads in this very process
    (`write_preloaded_data_multithread`), so a plain in-process queue carries the same
    results. Applied only where the queue is still unmade; a release without that global
    is left alone (tests/test_checkpoint_speed.py notices)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return False
    filesystem_async._results_queue = queue.Queue()
    return True


LONG_OPERATION_S = 1800.0  # a save or load is not taken for a hang for this long


@contextlib.contextmanager
def megatron_saves_declared(long_operation: Callable[[float], ContextManager]
                            ) -> Iterator[None]:
    """While inside, Megatron's own saves in its train() (`save_checkpoint_and_time`: the
    interval's, the exit's) are declared long operations, as the Checkpointer declares
    ours: a save outlasts a short progress timeout (8 ranks on 2 cores: over 3 s; at scale,
    minutes), and every rank in it was taken for hung (chaos soak --loop megatron with
    --save-interval)."""
    import megatron.training.training as training

    real = training.save_checkpoint_and_time

    @functools.wraps(real)
    def save_checkpoint_and_time(*args: Any, **kwargs: Any) -> Any:
        with long_operation(LONG_OPERATION_S):
            return real(*args, **kwargs)

    training.save_checkpoint_and_time = save_checkpoint_and_time
    try:
        yield
    finally:
        training.save_checkpoint_and_time = real


class Checkpointer:
    """Saves every --save-interval iterations and loads from --load. Each save and load is
    announced as a long operation (`long_operation(budget_s)`, e.g. to the progress board),
    so a slow one is never mistaken for a hang."""

    def __init__(self, cfg: TrainConfig,
                 long_operation: Callable[[float], ContextManager] | None = None) -> None:
        self.cfg = cfg
        self.long_operation = long_operation or (lambda budget_s: contextlib.nullcontext())
        # The save strategy of the current data-parallel group, kept across saves so that
        # --ckpt-assume-constant-structure can reuse its cached plans (a recovery makes new
        # groups, and with them a new strategy).
        self._save_strategy: tuple[Any, Any] | None = None

    def save_strategy(self) -> tuple[Any, bool]:
        """(strategy, validate): megatron-core's torch_dist strategy as Megatron-LM builds it
        from the same flags; the sharding is validated at the first save of a strategy, and
        at every save unless the structure is assumed constant."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )
        from megatron.core.dist_checkpointing.strategies.torch import (
            TorchDistSaveShardedStrategy,
        )

        cfg = self.cfg
        group = ps.get_data_parallel_group(with_context_parallel=True)
        if self._save_strategy is not None and self._save_strategy[0] is group:
            return self._save_strategy[1], not cfg.ckpt_assume_constant_structure
        strategy: Any = TorchDistSaveShardedStrategy(
            cached_metadata=cfg.ckpt_assume_constant_structure)
        if cfg.ckpt_fully_parallel_save:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, group, cfg.ckpt_assume_constant_structure)
        self._save_strategy = (group, strategy)
        return strategy, True

    def load_strategy(self, path: str) -> Any:
        """None (megatron-core's default) or, with --ckpt-fully-parallel-load, the default
        wrapped to spread the reads over the data-parallel group."""
        if not self.cfg.ckpt_fully_parallel_load:
            return None
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        return FullyParallelLoadStrategyWrapper(
            get_default_load_sharded_strategy(path),
            ps.get_data_parallel_group(with_context_parallel=True))

    def _sharded_state_dict(self, state: LoopState, is_loading: bool) -> dict[str, Any]:
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        objs: TrainingObjects = state.objects
        model_sd = objs.model[0].module.sharded_state_dict()
        coords = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                  ps.get_data_parallel_rank())
        sizes = (ps.get_pipeline_model_parallel_world_size(),
                 ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size())
        return {
            "model": model_sd,
            "optimizer": objs.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=METADATA),
            "opt_param_scheduler": objs.scheduler.state_dict(),
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "rng_state": ShardedObject("rng_state", get_rng_state(), sizes, coords, replica_id=0),
        }

    def save(self, state: LoopState) -> str:
        with self.long_operation(LONG_OPERATION_S):
            return self._save(state)

    def _save(self, state: LoopState) -> str:
        from megatron.core import dist_checkpointing

        root = self.cfg.save
        assert root is not None
        results_in_process()  # our saves are synchronous
        path = iteration_dir(root, state.iteration)
        if torch.distributed.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        torch.distributed.barrier()
        strategy, validate = self.save_strategy()
        dist_checkpointing.save(self._sharded_state_dict(state, is_loading=False), path,
                                strategy, validate_access_integrity=validate,
                                content_metadata=METADATA)
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            tmp = os.path.join(root, TRACKER + ".tmp")
            with open(tmp, "w") as f:
                f.write(str(state.iteration))
            os.replace(tmp, os.path.join(root, TRACKER))
            log.info("saved checkpoint at iteration %d to %s", state.iteration, path)
        torch.distributed.barrier()
        return path

    def load(self, state: LoopState) -> bool:
        """Restore from the newest checkpoint under --load; False if there is none."""
        with self.long_operation(LONG_OPERATION_S):
            return self._load(state)

    def _load(self, state: LoopState) -> bool:
        from megatron.core import dist_checkpointing

        root = self.cfg.load
        assert root is not None
        iteration = latest_iteration(root)
        flushed = newer_flush(root, iteration)
        instead = f"the checkpoint of iteration {iteration}" if iteration is not None \
            else "nothing (training starts from scratch)"
        if flushed is not None and load_flushed(state, root, flushed,
                                                self.cfg.use_distributed_optimizer, instead):
            return True
        if iteration is None:
            if torch.distributed.get_rank() == 0:
                log.info("no checkpoint under %s; starting from scratch", root)
            return False
        path = iteration_dir(root, iteration)
        objs: TrainingObjects = state.objects
        allocate_optimizer_state(objs.optimizer)
        loaded = dist_checkpointing.load(self._sharded_state_dict(state, is_loading=True), path,
                                         self.load_strategy(path))
        with torch.no_grad():  # fp32 main-param shards are views of the model's leaf params
            objs.model[0].module.load_state_dict(loaded["model"])
            objs.optimizer.load_state_dict(loaded["optimizer"])
        restore_adam_steps(objs.optimizer, loaded["optimizer"])
        objs.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        set_rng_state(loaded["rng_state"])
        state.iteration = int(loaded["iteration"])
        state.consumed_samples = int(loaded["consumed_samples"])
        if torch.distributed.get_rank() == 0:
            log.info("loaded checkpoint of iteration %d from %s", state.iteration, path)
        return True

    def after_iteration(self, state: LoopState) -> bool:
        """Save when due; True when --exit-interval says to stop now."""
        cfg = self.cfg
        due = cfg.save_interval is not None and state.iteration % cfg.save_interval == 0
        stop = cfg.exit_interval is not None and state.iteration % cfg.exit_interval == 0
        if cfg.save and (due or stop):
            self.save(state)
        return stop and state.iteration < cfg.train_iters
