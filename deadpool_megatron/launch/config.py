"""deadpool-launch's flags, shaped like torchrun's, plus spares, standby hosts and rehearsal
nodes."""

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
    standby_hosts: int = field(default=0, metadata=flag(
        "The last N hosts of --nnodes are standby machines: they run no training rank, only "
        "their --spares, ready to take the ranks of a lost host. Give every host the same "
        "value; the job's world is then (--nnodes - N) x --nproc-per-node (less host 0 "
        "with --control-only)."))
    spare_respawns: int = field(default=0, metadata=flag(
        "Host 0: after a failed worker's recovery is declared, its host (if it lives) starts "
        "a new warm spare in its device slot, at most N times in an epoch, so that the pool "
        "does not shrink with each software failure or hang (the process died, not its "
        "device; a new spare that dies before taking a rank gets no successor). 0: never."))
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
    control_only: bool = field(default=False, metadata=flag(
        "Host 0 only: host the control plane (store and coordinator) and run no training "
        "rank, e.g. on a login or CPU node, so that losing any training host is survived; "
        "training hosts are then --node-rank 1 .. --nnodes - 1."))
    flush_timeout: float = field(default=60.0, metadata=flag(
        "Seconds the workers get to write their newest in-memory snapshots to the job's "
        "--save (on SIGTERM, or when hot-swap is impossible) before the job stops or "
        "restarts from them."))
    job_token_file: str | None = field(default=None, metadata=flag(
        "File holding the job token (the same file on every host, readable by its owner "
        "only) that authenticates control-plane writes; needed with --nnodes > 1. A "
        "single-host job makes a random one."))
    console: str = field(default="status", metadata=flag(
        "What the console shows of the workers' output: status (a line per iteration, the "
        "fault-tolerance events, every traceback, each warning repeated by the workers "
        "once with a count) or raw (every line of every worker, as printed). Either way "
        "each worker's full output is in --log-dir.", choices=["status", "raw"]))
    preload: str = field(default="auto", metadata=flag(
        "How workers start: auto forks each from a process of this host that imported torch "
        "and Megatron-Core once (about 8 s of CPU saved a worker), where no CUDA device is "
        "visible (CPU rehearsal; CUDA does not survive a fork); off starts each with a "
        "fresh interpreter, as torchrun does.", choices=["auto", "off"]))
    log_dir: str | None = field(default=None, metadata=flag(
        "Directory for each worker's full output (stdout and stderr), "
        "LOG_DIR/epoch<N>/<worker>.log; default: a new directory under the system's "
        "temporary directory, printed at start."))

    @property
    def first_training_host(self) -> int:
        return 1 if self.control_only else 0

    @property
    def training_hosts(self) -> range:
        return range(self.first_training_host, self.nnodes - self.standby_hosts)

    @property
    def worker_hosts(self) -> range:
        """Hosts that start workers: the training hosts, then the standby hosts (spares)."""
        return range(self.first_training_host, self.nnodes)

    @property
    def standby(self) -> bool:
        """This host runs spares only (--standby-hosts)."""
        return self.node_rank >= self.nnodes - self.standby_hosts

    @property
    def world_size(self) -> int:
        return len(self.training_hosts) * self.nproc_per_node

    def ranks_of(self, host: int) -> range:
        """Global ranks whose first worker runs on `host` (none on a control-only host)."""
        if host not in self.training_hosts:
            return range(0)
        first = (host - self.first_training_host) * self.nproc_per_node
        return range(first, first + self.nproc_per_node)

    def host_of(self, worker: str) -> int:
        """The host a worker runs on: w{rank} by its rank, s{host}.{i} by its name."""
        if worker.startswith("s"):
            return int(worker[1:].split(".")[0])
        return int(worker[1:]) // self.nproc_per_node + self.first_training_host

    def local_ranks(self) -> range:
        return self.ranks_of(self.node_rank)

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
        if self.spare_respawns < 0:
            raise LaunchError(f"--spare-respawns must be non-negative, got {self.spare_respawns}")
        if self.standby_hosts < 0:
            raise LaunchError(f"--standby-hosts must be non-negative, got {self.standby_hosts}")
        if not self.training_hosts:
            raise LaunchError(f"--standby-hosts {self.standby_hosts} leaves no training host "
                              f"of --nnodes {self.nnodes}"
                              f"{' (host 0 is --control-only)' if self.control_only else ''}: "
                              f"at most {len(self.worker_hosts) - 1} standby host(s)")
        if self.standby and self.spares <= 0:
            raise LaunchError(f"host {self.node_rank} is a standby host (--standby-hosts "
                              f"{self.standby_hosts}: the last {self.standby_hosts} of "
                              f"--nnodes {self.nnodes}) and runs spares only: give it "
                              f"--spares 1 or more")
        if self.control_only and (self.node_rank != 0 or self.nnodes < 2 or self.spares):
            raise LaunchError("--control-only is for host 0 of a job with training hosts "
                              "(--nnodes 2 or more) and runs no spare (--spares 0)")
        if self.nnodes > 1 and not self.job_token_file:
            raise LaunchError(f"--nnodes {self.nnodes} needs --job-token-file: the same "
                              f"secret file on every host (e.g. `umask 077; openssl rand -hex "
                              f"32 > $HOME/.deadpool_token`), which authenticates the hosts' "
                              f"control-plane writes")
        for name in ("heartbeat_timeout", "shutdown_timeout", "join_timeout", "flush_timeout"):
            if getattr(self, name) <= 0:
                raise LaunchError(f"--{name.replace('_', '-')} must be positive")

    def check_devices(self, backend: str, devices: int) -> None:
        """With NCCL each worker of a host, spares included, needs a GPU of its own: active
        workers take device slots 0..nproc-1, spares the next ones (a standby host's from
        0). Two ranks on one
        GPU are refused by NCCL, and a spare sharing a GPU would take it over a live rank's
        memory. `devices` is this host's CUDA device count (0: none seen here; the
        workers then say so themselves)."""
        needed = len(self.local_ranks()) + self.spares
        if backend != "nccl" or devices == 0 or needed <= devices:
            return
        if self.standby:
            raise LaunchError(
                f"--spares {self.spares} on standby host {self.node_rank} need {needed} GPUs, "
                f"which it has not ({devices}): with the nccl backend every spare needs a GPU "
                f"of its own; use --spares {devices}")
        raise LaunchError(
            f"--nproc-per-node {self.nproc_per_node} plus --spares {self.spares} need "
            f"{needed} GPUs on this host, which has {devices}: with the nccl backend every "
            f"worker and every spare needs a GPU of its own. Use for example "
            f"--nproc-per-node {max(devices - 1, 1)} --spares 1 (a spare on any host may "
            f"replace any rank).")
