"""deadpool-launch's flags, shaped like torchrun's, plus spares and rehearsal nodes."""

from __future__ import annotations

from dataclasses import dataclass, field

from deadpool_megatron.config import flag


class LaunchError(ValueError):
    """A bad launcher flag; the message names it and says what to change."""


@dataclass
class LaunchConfig:
    nproc_per_node: int = field(default=1, metadata=flag("Active workers on each host."))
    nnodes: int = field(default=1, metadata=flag("Hosts in the job; one launcher per host."))
    node_rank: int = field(default=0, metadata=flag(
        "This host's index; host 0 hosts the control plane."))
    master_addr: str = field(default="127.0.0.1", metadata=flag(
        "Address of host 0 (the control plane); host 0 listens on this address only."))
    master_port: int = field(default=0, metadata=flag(
        "Control-plane port (0 on host 0: pick a free one and print it)."))
    spares: int = field(default=0, metadata=flag(
        "Warm spare processes on this host (any host's spare may replace any rank)."))
    logical_nodes: int = field(default=1, metadata=flag(
        "Split each host's workers into N failure domains (rehearsal on one host)."))
    heartbeat_timeout: float = field(default=10.0, metadata=flag(
        "Seconds without a report from a host's launcher before that host (its workers "
        "with it) is declared lost; a hung worker is found by its progress instead "
        "(--deadpool-progress-timeout of the training script)."))
    failure_window: float = field(default=0.02, metadata=flag(
        "Seconds to gather failures into one declaration."))
    max_restarts: int = field(default=1, metadata=flag(
        "Whole-job restarts from the --save checkpoint when hot-swap is impossible."))
    shutdown_timeout: float = field(default=30.0, metadata=flag(
        "Seconds workers get to exit after the job ends."))
    join_timeout: float = field(default=300.0, metadata=flag(
        "Seconds a host waits for the control plane of host 0."))

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def local_ranks(self) -> range:
        """Global ranks whose first worker runs on this host."""
        first = self.node_rank * self.nproc_per_node
        return range(first, first + self.nproc_per_node)

    def validate(self) -> None:
        if self.nproc_per_node <= 0:
            raise LaunchError(f"--nproc-per-node must be positive, got {self.nproc_per_node}")
        if self.spares < 0:
            raise LaunchError(f"--spares must be non-negative, got {self.spares}")
        if self.nnodes <= 0 or not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank {self.node_rank} must be in [0, --nnodes "
                              f"{self.nnodes})")
        if self.node_rank > 0 and self.master_port == 0:
            raise LaunchError("--node-rank > 0 needs the --master-port of host 0 (host 0 "
                              "may pick a free one with 0 and prints it)")
        if self.logical_nodes <= 0 or self.nproc_per_node % self.logical_nodes:
            raise LaunchError(f"--logical-nodes {self.logical_nodes} must divide "
                              f"--nproc-per-node {self.nproc_per_node}")
        for name in ("heartbeat_timeout", "shutdown_timeout", "join_timeout"):
            if getattr(self, name) <= 0:
                raise LaunchError(f"--{name.replace('_', '-')} must be positive")

    def check_devices(self, backend: str, devices: int) -> None:
        """With NCCL each worker of a host, spares included, needs a GPU of its own: active
        workers take device slots 0..nproc-1, spares nproc, nproc+1, ... Two ranks on one
        GPU are refused by NCCL, and a spare sharing a GPU would take it over a live rank's
        memory. `devices` is this host's CUDA device count (0: none seen here; the
        workers then say so themselves)."""
        needed = self.nproc_per_node + self.spares
        if backend != "nccl" or devices == 0 or needed <= devices:
            return
        raise LaunchError(
            f"--nproc-per-node {self.nproc_per_node} plus --spares {self.spares} need "
            f"{needed} GPUs on this host, which has {devices}: with the nccl backend every "
            f"worker and every spare needs a GPU of its own. Use for example "
            f"--nproc-per-node {max(devices - 1, 1)} --spares 1 (a spare on any host may "
            f"replace any rank).")


def script_backend(script_args: list[str]) -> str:
    """The training script's --distributed-backend (its default: nccl)."""
    for i, arg in enumerate(script_args):
        if arg == "--distributed-backend" and i + 1 < len(script_args):
            return script_args[i + 1]
        if arg.startswith("--distributed-backend="):
            return arg.split("=", 1)[1]
    return "nccl"
