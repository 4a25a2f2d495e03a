"""The simulator's parameters: every number a `Figure` with where it comes from (our
measurement with the command that produced it, a publication, or a stated assumption).
Plain frozen dataclasses; `sources()` lists every figure for the JSON and the docs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    source: str


LLAMA3 = ("Llama 3 (arXiv 2407.21783), 54-day 16,384-H100 pre-training snapshot, table of "
          "unexpected interruptions")
ASSUMPTION = "assumption (no published or measured figure found; change it here)"
BENCH_RECOVERY = ("ours: tools/bench_recovery.py --ranks 4 8 16 --repeats 3 (CPU, 2 cores), "
                  "deadpool_megatron/goodput/measured/bench_recovery_cpu.json")


@dataclass(frozen=True)
class FailureRates:
    """Unexpected interruptions by class. gpu: one GPU lost; host: a whole node lost;
    software: one process dies, its hardware is fine; hang: a rank stops without exiting."""

    span_s: Figure = Figure(54 * 86400.0, "s", LLAMA3)
    span_gpus: Figure = Figure(16384, "GPUs", LLAMA3)
    gpu: Figure = Figure(268, "interruptions", LLAMA3 + ": faulty GPU 148, GPU HBM3 72, GPU "
                         "SRAM 19, GPU system processor 17, silent data corruption 6, GPU "
                         "thermal interface + sensor 6")
    host: Figure = Figure(88, "interruptions", LLAMA3 + ": network switch/cable 35, host "
                          "maintenance 32, NIC 7, SSD 3, power supply 3, server chassis 2, IO "
                          "expansion board 2, CPU 2, system memory 2")
    software: Figure = Figure(56, "interruptions", LLAMA3 + ": software bug 54, dependency 2")
    hang: Figure = Figure(7, "interruptions", LLAMA3 + ": NCCL watchdog timeouts 7")
    repair_s: Figure = Figure(48 * 3600.0, "s", ASSUMPTION + ": a failed GPU or node is back "
                              "in the spare pool 48 h after its failure")
    gpus_per_node: Figure = Figure(8, "GPUs", "DGX/HGX H100: 8 GPUs a node")

    CLASSES = ("gpu", "host", "software", "hang")

    def per_gpu_rate(self, cls: str, mtbf_scale: float = 1.0) -> float:
        """Failures of class `cls` per GPU-second (host failures spread over the node's GPUs)."""
        return getattr(self, cls).value / (self.span_s.value * self.span_gpus.value) / mtbf_scale


@dataclass(frozen=True)
class JobShape:
    """The training job: model size, parallel layout, iteration time, state sizes."""

    gpus: int
    model_params: float = 65e9
    tp: int = 8
    pp: int = 8
    micro_batches: int = 16
    seq_len: int = 4096
    layout_source: str = (ASSUMPTION + ": TP8 x PP8 (one replica = 64 GPUs = 8 nodes), 16 "
                          "micro-batches of 1 x 4096 tokens per replica per iteration (weak "
                          "scaling: 256 replicas = 16.8M tokens, Llama 3's 16M-token batch)")
    weight_bytes: Figure = Figure(2, "B/param", "bf16 weights (Megatron mixed precision)")
    optimizer_bytes: Figure = Figure(12, "B/param", "fp32 main weights + Adam m and v "
                                     "(Megatron distributed optimizer; 16-18 B/param in GPU "
                                     "memory with gradients, not saved)")
    peak_flops: Figure = Figure(989e12, "FLOP/s", "H100 SXM dense BF16 (NVIDIA datasheet)")
    mfu: Figure = Figure(0.40, "", "Llama 3: 38-43 % BF16 MFU on 8K-16K H100")

    def __post_init__(self) -> None:
        if self.gpus < self.tp * self.pp:
            raise ValueError(f"--gpus must be at least one replica, tp x pp = "
                             f"{self.tp * self.pp}; got {self.gpus}")
        if self.model_params <= 0:
            raise ValueError(f"--model-params must be positive, got {self.model_params}")

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Whole data-parallel replicas (GPUs past the last whole one are counted as used)."""
        return self.gpus // self.model_parallel

    @property
    def iteration_s(self) -> float:
        """6 x params x tokens per replica over the replica's GPUs at peak x MFU."""
        flops = 6.0 * self.model_params * self.micro_batches * self.seq_len
        return flops / (self.model_parallel * self.peak_flops.value * self.mfu.value)

    @property
    def weights_per_gpu_bytes(self) -> float:
        return self.weight_bytes.value * self.model_params / self.model_parallel

    @property
    def optimizer_shard_bytes(self) -> float:
        """A GPU's distributed-optimizer shard: the optimizer state over every GPU."""
        return self.optimizer_bytes.value * self.model_params / self.gpus

    @property
    def checkpoint_bytes_per_gpu(self) -> float:
        """Fully parallel save: the checkpoint (weights + optimizer) spread over all GPUs."""
        per_param = self.weight_bytes.value + self.optimizer_bytes.value
        return per_param * self.model_params / self.gpus

    @property
    def shard_bytes(self) -> float:
        """What one GPU's snapshot holds: its weights and its optimizer shard."""
        return self.weights_per_gpu_bytes + self.optimizer_shard_bytes

    def spread_fraction(self) -> float:
        """A replica's lost micro-batches dealt over all replicas: ceil(m / dp) micro-batches
        through the pipeline's pp stages, over a whole iteration's m + pp - 1 slots."""
        m, pp = self.micro_batches, self.pp
        return (math.ceil(m / self.replicas) + pp - 1) / (m + pp - 1)


@dataclass(frozen=True)
class Cluster:
    """Storage, network, launch and detection figures shared by every strategy."""

    storage_bps_per_gpu: Figure = Figure(2e12 / 16384, "B/s", "Llama 3: Tectonic sustains 2 "
                                         "TB/s (7 TB/s peak) for the 16K-GPU job; per GPU, "
                                         "so the job's share scales with its GPUs")
    nic_bps_per_gpu: Figure = Figure(25e9, "B/s", ASSUMPTION + ": half of a 400 Gb/s NIC per "
                                     "GPU (DGX H100: 8 x ConnectX-7 400 Gb/s)")
    nccl_init_base_s: Figure = Figure(1.0, "s", ASSUMPTION + ": NCCL communicators of a "
                                      "generation at small scale")
    nccl_init_at_100k_s: Figure = Figure(30.0, "s", "NVIDIA/nccl PR #1789 (Meta): O(N^2) "
                                         "ring and transport set-up took 'several dozens of "
                                         "seconds at 100K scale'; init(N) = base + this x "
                                         "(N / 100,000)^2")
    nccl_abort_s: Figure = Figure(0.6, "s", "NVRx docs: destroy_process_group about 0.5 s + "
                                  "0.01 s per pending kernel (10 pending assumed)")
    control_plane_per_rank_s: Figure = Figure(1.66 / 16384, "s/rank", "tools/bench_scale.py "
                                              "(docs/DESIGN.md, 'The control plane at "
                                              "scale'): declaration -> every member joined, "
                                              "1.66 s at 16,384 simulated ranks on 2 shared "
                                              "cores (0.28 s at 4,096, 0.062 s at 1,024); "
                                              "control_plane(N) = this x N, the line through "
                                              "the 16,384 point (above the smaller ones)")
    worker_start_s: Figure = Figure(60.0, "s", ASSUMPTION + ": process start, imports, "
                                    "Megatron initialisation, 65B model and optimizer build "
                                    "(our 8-rank CPU relaunch: 4.6 s, README "
                                    "bench_recovery.py --vs-checkpoint)")
    scheduler_requeue_s: Figure = Figure(240.0, "s", ASSUMPTION + ": the scheduler requeues "
                                         "the job and allocates replacement nodes; with the "
                                         "worker start, the 300 s recovery default of the "
                                         "mlsysim ReliabilityModel (Harvard cs249r)")
    save_fixed_s: Figure = Figure(0.171, "s", "ours: the steady save of the 8-rank CPU job "
                                  "with cached plans (README, tools/bench_recovery.py "
                                  "--vs-checkpoint): a save's cost besides its bytes")
    node_down_detect_s: Figure = Figure(300.0, "s", "Slurm SlurmdTimeout default 300 s (a "
                                        "node's loss seen by the scheduler)")
    nccl_timeout_s: Figure = Figure(600.0, "s", "Megatron-LM --distributed-timeout-minutes "
                                    "default 10 (a hang seen by the NCCL watchdog)")
    torchft_timeout_s: Figure = Figure(60.0, "s", "torchft Manager(timeout=60 s) default")
    torchft_heal_bps: Figure = Figure(4e9, "B/s", "torchft: a replica heals 12 GB from a peer "
                                      "in about 3 s with streaming (field notes)")

    def nccl_init_s(self, n: int) -> float:
        return self.nccl_init_base_s.value + self.nccl_init_at_100k_s.value * (n / 1e5) ** 2

    def control_plane_s(self, n: int) -> float:
        return self.control_plane_per_rank_s.value * n


@dataclass(frozen=True)
class DeadPoolFigures:
    """DeadPool's own: detection timeouts (our defaults) and the snapshot's cost."""

    heartbeat_timeout_s: Figure = Figure(10.0, "s", "deadpool-launch --heartbeat-timeout "
                                         "default (a lost host)")
    progress_timeout_floor_s: Figure = Figure(20.0, "s", "--deadpool-progress-timeout "
                                              "default: 10 x the longest iteration, at least "
                                              "20 s (a hang)")
    progress_timeout_iterations: Figure = Figure(10.0, "iterations", "as above")
    snapshot_cost_gpu: Figure = Figure(0.01, "iterations/snapshot", "the GPU assumption, not "
                                       "yet measured: on/off <= 1.01 at interval 1 "
                                       "(tools/gpu_check.sh will measure it)")
    snapshot_cost_cpu: Figure = Figure(0.10, "iterations/snapshot", "ours, CPU: "
                                       "tools/bench_snapshot.py in-job ratios at interval 10 "
                                       "1.007-1.013 (0.07-0.13 per snapshot), interval 1 "
                                       "1.09-1.14 (docs/DESIGN.md, stop 22)")

    def progress_timeout_s(self, iteration_s: float) -> float:
        return max(self.progress_timeout_floor_s.value,
                   self.progress_timeout_iterations.value * iteration_s)


@dataclass(frozen=True)
class Params:
    rates: FailureRates = field(default_factory=FailureRates)
    cluster: Cluster = field(default_factory=Cluster)
    deadpool: DeadPoolFigures = field(default_factory=DeadPoolFigures)
    mtbf_scale: float = 1.0  # > 1: failures that much rarer
    spare_target: float = 0.01  # pool empty over the run with at most this probability

    def __post_init__(self) -> None:
        if not self.mtbf_scale > 0:
            raise ValueError(f"--mtbf-scale must be positive, got {self.mtbf_scale}")
        if not 0 < self.spare_target < 1:
            raise ValueError(f"--spare-target must be in (0, 1), got {self.spare_target}")


def sources(params: Params) -> dict[str, dict]:
    """Every figure by dotted name: value, unit, source (for the JSON and the docs)."""
    out: dict[str, dict] = {}
    for part in ("rates", "cluster", "deadpool"):
        obj = getattr(params, part)
        for f in fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, Figure):
                out[f"{part}.{f.name}"] = {"value": v.value, "unit": v.unit, "source": v.source}
    return out
