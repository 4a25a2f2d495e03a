"""What each fault-tolerance strategy pays, failure-free and per failure, as plain data.

N is the job's GPUs, P its parameters, mp = tp x pp; every figure is in params.py with its
source. The phases and their scaling in N:
- detect(class): a process exit (gpu, software): the measured exit detection; a lost host:
  DeadPool's heartbeat timeout (launcher-based strategies) or Slurm's node timeout
  (checkpoint-restart); a hang: the progress timeout or NCCL's watchdog timeout; torchft:
  its collective timeout for every class. Constant in N.
- control_plane(N) = c_cp x N (declaration to every rank joined, tools/bench_scale.py's
  measured figure at 16,384 ranks).
- nccl_init(N) = i0 + i100k x (N / 100,000)^2 (every group of a new generation or job).
- worker_start: constant (every rank in parallel); scheduler requeue: constant.
- save (durable, fully parallel) = c0 + 14 P / N / storage_bw_per_gpu; load = the same read
  + 2 P / mp / nic (weights exchanged among replicas).
- snapshot (in host memory) = cost x iteration (per snapshot); DeadPool's and the in-memory
  restart's state transfer: (2 P / mp + 12 P / N) / nic; a flush writes and reads the same
  bytes at storage speed.
- interval: Young/Daly's sqrt(2 x save x MTBF), in whole iterations.
- lost work: the work since the newest save, plus for DeadPool the failed iteration's replay
  (calibration.py): local, the failed replica recomputes its micro-batches; spread, they are
  dealt over every replica (JobShape.spread_fraction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deadpool_megatron.goodput import analytic, calibration
from deadpool_megatron.goodput.params import FailureRates, JobShape, Params

CLASSES = FailureRates.CLASSES


@dataclass(frozen=True)
class Rollback:
    """A strategy that, on a failure, rolls the job back to its newest save and goes on
    after a downtime (every strategy here but the replica drop)."""

    name: str
    summary: str
    save_s: float  # blocking cost of one save or snapshot
    interval_s: float  # computing between two saves; math.inf: none
    downtime_s: tuple[float, ...]  # per class: failure to training again, a spare at hand
    fallback_s: tuple[float, ...]  # per class: the same with the spare pool empty
    take: dict[str, tuple[int, float]] = field(default_factory=dict)  # class: (GPUs, held s)
    replay: str = "rollback"  # rollback | local | spread
    iteration_s: float = 0.0
    replay_ratio: float = 1.0
    spread_fraction: float = 1.0
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # per class, for reports

    def lost_s(self, since_s: float) -> float:
        """Work to redo after a failure `since_s` of computing after the newest save. DeadPool:
        the failed iteration is done again in replay_ratio iterations (local) or that times
        the spread fraction (spread, only when the failure struck in the iteration right
        after the snapshot: the intact replicas kept their micro-batches)."""
        if self.replay == "rollback":
            return since_s
        factor = self.replay_ratio
        if self.replay == "spread" and since_s < self.iteration_s:
            factor *= self.spread_fraction
        return since_s + (factor - 1.0) * self.iteration_s


@dataclass(frozen=True)
class ReplicaDrop:
    """torchft-like: a failure drops the struck data-parallel replica (the step is dropped on
    every replica), the others go on at (replicas - out) / replicas of the throughput until a
    replacement has started and healed from a peer."""

    name: str
    summary: str
    detect_s: tuple[float, ...]  # per class: the job waits this long (its collective blocks)
    reconfig_s: float  # a new quorum and cross-replica groups (on a loss and on a rejoin)
    dropped_step_s: float
    back_after_s: tuple[float, ...]  # per class: failure to the replacement healed
    replicas: int
    nodes_per_replica: int


@dataclass(frozen=True)
class Context:
    job: JobShape
    params: Params
    measured: calibration.MeasuredPhases  # DeadPool's reference recovery
    mtbf_s: float  # the whole job's


def _detect(ctx: Context, kind: str) -> tuple[float, ...]:
    """Per class. launcher: DeadPool's detection (also given to the hot-spare and in-memory
    restarts); scheduler: Slurm and NCCL defaults, a process exit seen by the launcher that
    then ends the job; torchft: its collective timeout for every class (the survivors go on,
    no launcher ends them, and NCCL over InfiniBand does not see a peer process die)."""
    c, d, exit_s = ctx.params.cluster, ctx.params.deadpool, ctx.measured.durations["detect"]
    if kind == "torchft":
        return tuple(c.torchft_timeout_s.value for _ in CLASSES)
    host, hang = {
        "launcher": (d.heartbeat_timeout_s.value, d.progress_timeout_s(ctx.job.iteration_s)),
        "scheduler": (c.node_down_detect_s.value, c.nccl_timeout_s.value),
    }[kind]
    by = {"gpu": exit_s, "host": host, "software": exit_s, "hang": hang}
    return tuple(by[k] for k in CLASSES)


def _restart_s(ctx: Context) -> float:
    """Every worker started again: process start, rendezvous, NCCL communicators."""
    c, n = ctx.params.cluster, ctx.job.gpus
    return c.worker_start_s.value + c.control_plane_s(n) + c.nccl_init_s(n)


def _durable(ctx: Context) -> tuple[float, float]:
    """(save s, load s) of a fully parallel Megatron checkpoint."""
    c, job = ctx.params.cluster, ctx.job
    io = job.checkpoint_bytes_per_gpu / c.storage_bps_per_gpu.value
    return c.save_fixed_s.value + io, io + job.weights_per_gpu_bytes / c.nic_bps_per_gpu.value


def _interval(ctx: Context, save_s: float) -> float:
    yd = analytic.young_daly_interval(save_s, ctx.mtbf_s)
    return analytic.whole_iterations(yd, ctx.job.iteration_s)


def _node_take(ctx: Context) -> dict[str, tuple[int, float]]:
    """Hot-spare nodes: a GPU or host failure takes a whole node until it is repaired."""
    node, repair = int(ctx.params.rates.gpus_per_node.value), ctx.params.rates.repair_s.value
    return {"gpu": (node, repair), "host": (node, repair)}


def checkpoint_restart(ctx: Context) -> Rollback:
    save, load = _durable(ctx)
    requeue = ctx.params.cluster.scheduler_requeue_s.value
    down = tuple(d + requeue + _restart_s(ctx) + load for d in _detect(ctx, "scheduler"))
    return Rollback("checkpoint_restart", "durable checkpoints at the Young/Daly interval; "
                    "any failure: the scheduler requeues the job, every rank loads the newest",
                    save, _interval(ctx, save), down, down)


def hot_spare_restart(ctx: Context) -> Rollback:
    save, load = _durable(ctx)
    requeue = ctx.params.cluster.scheduler_requeue_s.value
    down = tuple(d + _restart_s(ctx) + load for d in _detect(ctx, "launcher"))
    return Rollback("hot_spare_restart", "NVRx ft_launcher-like: a hot-spare node joins, "
                    "every rank restarts from the newest durable checkpoint",
                    save, _interval(ctx, save), down, tuple(x + requeue for x in down),
                    _node_take(ctx))


def inmemory_restart(ctx: Context) -> Rollback:
    c, job = ctx.params.cluster, ctx.job
    save = ctx.params.deadpool.snapshot_cost_gpu.value * job.iteration_s
    load = job.shard_bytes / c.nic_bps_per_gpu.value
    down = tuple(d + _restart_s(ctx) + load for d in _detect(ctx, "launcher"))
    return Rollback("inmemory_restart", "Gemini-like: in-memory snapshots to peers at the "
                    "Young/Daly interval; any failure restarts every rank (spare node) and "
                    "loads from host memory", save, _interval(ctx, save), down,
                    tuple(x + c.scheduler_requeue_s.value for x in down), _node_take(ctx))


def deadpool_phases(ctx: Context, cls: str, replay: str) -> dict[str, float]:
    """DeadPool's recovery on the cluster: the reference phases (contention 1) plus the
    stated formulas in N (calibration.py's docstring)."""
    c, job, n = ctx.params.cluster, ctx.job, ctx.job.gpus
    extra = {"declare": c.control_plane_s(n) - c.control_plane_s(ctx.measured.ranks),
             "leave": c.nccl_abort_s.value, "rebuild": c.nccl_init_s(n),
             "restore": job.shard_bytes / c.nic_bps_per_gpu.value}
    platform = calibration.Platform(
        detect_s=_detect(ctx, "launcher")[CLASSES.index(cls)], iteration_s=job.iteration_s,
        replay_fraction=job.spread_fraction() if replay == "spread" else 1.0, extra_s=extra)
    return calibration.recovery_phases(ctx.measured, platform)


def deadpool(ctx: Context, replay: str, snapshot_cost: float, name: str) -> Rollback:
    c, job, rates = ctx.params.cluster, ctx.job, ctx.params.rates
    save = snapshot_cost * job.iteration_s
    phases = {k: deadpool_phases(ctx, k, replay) for k in CLASSES}
    down = tuple(sum(v for p, v in phases[k].items() if p != "replay") for k in CLASSES)
    flush = job.shard_bytes / c.storage_bps_per_gpu.value  # written, later read back
    fallback = tuple(d + 2 * flush + c.scheduler_requeue_s.value + _restart_s(ctx)
                     for d in _detect(ctx, "launcher"))
    repair, restart = rates.repair_s.value, c.worker_start_s.value
    take = {"gpu": (1, repair), "host": (int(rates.gpus_per_node.value), repair),
            "software": (1, restart), "hang": (1, restart)}
    return Rollback(name, f"hot swap of the failed ranks onto spare GPUs, {replay} replay, "
                    f"snapshots at the Young/Daly interval ({snapshot_cost:g} iteration each); "
                    "pool empty: flush, requeue, restart from the flush", save,
                    _interval(ctx, save), down, fallback, take, replay, job.iteration_s,
                    ctx.measured.replay_ratio, job.spread_fraction(), phases)


def replica_drop(ctx: Context) -> ReplicaDrop:
    c, job = ctx.params.cluster, ctx.job
    heal = (job.weights_per_gpu_bytes + job.optimizer_bytes.value * job.model_params
            / job.model_parallel) / c.torchft_heal_bps.value
    hardware = c.scheduler_requeue_s.value + c.worker_start_s.value + heal
    back = {"gpu": hardware, "host": hardware, "software": c.worker_start_s.value + heal,
            "hang": c.worker_start_s.value + heal}
    r = job.replicas
    return ReplicaDrop("replica_drop", "torchft-like: the struck replica's step is dropped, "
                       "the rest go on without it until its replacement heals from a peer",
                       _detect(ctx, "torchft"), c.control_plane_s(r) + c.nccl_init_s(r),
                       job.iteration_s, tuple(back[k] for k in CLASSES), r,
                       math.ceil(job.model_parallel / int(ctx.params.rates.gpus_per_node.value)))


def all_strategies(ctx: Context) -> list[Rollback | ReplicaDrop]:
    d = ctx.params.deadpool
    return [checkpoint_restart(ctx), inmemory_restart(ctx), hot_spare_restart(ctx),
            replica_drop(ctx),
            deadpool(ctx, "local", d.snapshot_cost_gpu.value, "deadpool_local"),
            deadpool(ctx, "spread", d.snapshot_cost_gpu.value, "deadpool_spread"),
            deadpool(ctx, "local", d.snapshot_cost_cpu.value, "deadpool_local_cpu_snapshot")]
