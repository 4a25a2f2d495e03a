"""Start the workers and the warm spares, host the control plane, and turn a worker's
death into a new generation instead of the end of the job.

Unlike torchrun, a worker's exit never kills the survivors: the launcher declares the
failed ranks, assigns spares (control/policy.py) and opens the next generation in its
TCPStore, which lives here, outside every training rank (rank 0 may die too).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from deadpool_megatron.config import add_arguments, flag, from_namespace
from deadpool_megatron.control import keys
from deadpool_megatron.control.policy import RecoveryImpossible, assign_spares, check_recoverable
from deadpool_megatron.metrics.events import EventLog

log = logging.getLogger("deadpool_megatron.launch")


@dataclass
class LaunchConfig:
    nproc_per_node: int = field(default=1, metadata=flag("Active workers on this host."))
    nnodes: int = field(default=1, metadata=flag("Hosts in the job (only 1 is supported yet)."))
    node_rank: int = field(default=0, metadata=flag("This host's index."))
    master_addr: str = field(default="127.0.0.1", metadata=flag("Address of the control plane."))
    master_port: int = field(default=0, metadata=flag("Control-plane port (0: pick a free one)."))
    spares: int = field(default=0, metadata=flag("Warm spare processes for the whole job."))
    logical_nodes: int = field(
        default=1, metadata=flag("Split this host's workers into N failure domains (rehearsal).")
    )
    heartbeat_timeout: float = field(
        default=10.0, metadata=flag("Seconds without a heartbeat before a worker is declared hung.")
    )
    failure_window: float = field(
        default=0.05, metadata=flag("Seconds to gather failures into one declaration.")
    )
    max_restarts: int = field(
        default=1, metadata=flag("Whole-job restarts from the --save checkpoint when "
                                 "hot-swap is impossible.")
    )
    shutdown_timeout: float = field(
        default=30.0, metadata=flag("Seconds workers get to exit after the job ends.")
    )

    def validate(self) -> None:
        if self.nnodes != 1 or self.node_rank != 0:
            raise SystemExit("deadpool-launch: error: --nnodes > 1 is not supported yet; "
                             "run one launcher with --nproc-per-node = all ranks")
        if self.nproc_per_node <= 0 or self.spares < 0:
            raise SystemExit("deadpool-launch: error: --nproc-per-node must be positive and "
                             "--spares non-negative")
        if self.logical_nodes <= 0 or self.nproc_per_node % self.logical_nodes:
            raise SystemExit(f"deadpool-launch: error: --logical-nodes {self.logical_nodes} "
                             f"must divide --nproc-per-node {self.nproc_per_node}")


RECOVERY_IMPOSSIBLE = 3


def _flag_value(args: Sequence[str], name: str) -> str | None:
    args = list(args)
    if name in args:
        i = args.index(name)
        return args[i + 1] if i + 1 < len(args) else None
    return None


class Launcher:
    def __init__(self, cfg: LaunchConfig, script: str, script_args: Sequence[str]) -> None:
        self.cfg = cfg
        self.cmd = [sys.executable, "-u", script, *script_args]
        self.world = cfg.nproc_per_node
        # The workers' failure domains: --deadpool-ranks-per-node if the job sets it, else
        # the launcher's logical nodes (passed to the workers as LOCAL_WORLD_SIZE).
        rpn = _flag_value(script_args, "--deadpool-ranks-per-node")
        self.ranks_per_node = int(rpn) if rpn else cfg.nproc_per_node // cfg.logical_nodes
        self.allow_same_node = "--deadpool-allow-same-node-buddy" in script_args
        self.events = EventLog(_flag_value(script_args, "--deadpool-events"), rank=-1)
        self.epoch = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.heartbeats: dict[str, tuple[bytes, float]] = {}

    def _env(self, worker: str, rank: int | None) -> dict[str, str]:
        env = {**os.environ, "MASTER_ADDR": self.cfg.master_addr,
               "MASTER_PORT": str(self.store.port), "WORLD_SIZE": str(self.world),
               "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "DEADPOOL_WORKER_ID": worker,
               "DEADPOOL_HEARTBEAT_TIMEOUT_S": str(self.cfg.heartbeat_timeout),
               "DEADPOOL_EPOCH": str(self.epoch)}
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), DEADPOOL_DEVICE_SLOT=str(rank))
        else:  # spares take the device slots after the active workers'
            env["DEADPOOL_DEVICE_SLOT"] = str(self.world + int(worker[1:]))
        return env

    def _start(self, worker: str, rank: int | None) -> None:
        self.procs[worker] = subprocess.Popen(self.cmd, env=self._env(worker, rank),
                                              stdin=subprocess.DEVNULL)

    def run(self) -> int:
        """Hot-swap for as long as it can; then, if the job writes durable checkpoints
        (--save), restart every worker from the newest one (--load), once per
        --max-restarts."""
        save_dir = _flag_value(self.cmd, "--save")
        for attempt in range(self.cfg.max_restarts + 1):
            self.epoch = attempt
            rc = self._run_epoch()
            if rc != RECOVERY_IMPOSSIBLE or save_dir is None or attempt == self.cfg.max_restarts:
                return rc
            log.warning("deadpool-launch: falling back to the durable checkpoint under %s: "
                        "restarting all %d workers with --load", save_dir, self.world)
            self.events.emit("checkpoint_fallback", save=save_dir, attempt=attempt + 1)
            if _flag_value(self.cmd, "--load") is None:
                self.cmd += ["--load", save_dir]
            self.procs.clear()
            self.heartbeats.clear()
            self.store = None  # closes this epoch's control plane before the next one
        return RECOVERY_IMPOSSIBLE

    def _run_epoch(self) -> int:
        cfg = self.cfg
        self.store = dist.TCPStore(cfg.master_addr, cfg.master_port, is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=60))
        generation = 0
        current = {r: f"w{r}" for r in range(self.world)}
        spares = [f"s{i}" for i in range(cfg.spares)]
        self.store.set(keys.members(0), json.dumps(current))
        self.store.set(keys.GENERATION, "0")
        for rank, worker in current.items():
            self._start(worker, rank)
        for worker in spares:
            self._start(worker, None)
        log.info("deadpool-launch: %d workers (%d logical nodes of %d), %d warm spares, "
                 "control plane on %s:%d", self.world, cfg.logical_nodes, self.ranks_per_node,
                 len(spares), cfg.master_addr, self.store.port)
        exited: set[str] = set()
        failed: set[str] = set()
        first_failure = 0.0
        try:
            while True:
                now = time.monotonic()
                for worker, proc in self.procs.items():
                    if worker in exited or proc.poll() is None:
                        continue
                    exited.add(worker)
                    if worker in current.values() and not self._done(worker):
                        failed.add(worker)
                        first_failure = first_failure or now
                        rank = next(r for r, w in current.items() if w == worker)
                        self.events.emit("failure_detected", worker=worker, rank=rank,
                                         returncode=proc.returncode, how="exit")
                        log.warning("deadpool-launch: rank %d (worker %s) exited with %s",
                                    rank, worker, proc.returncode)
                    elif worker in spares:
                        spares.remove(worker)
                        log.warning("deadpool-launch: spare %s exited (%s); %d left", worker,
                                    proc.returncode, len(spares))
                for worker in self._hung(current, spares, exited, now):
                    log.warning("deadpool-launch: worker %s missed heartbeats for %.1f s; "
                                "killing it", worker, cfg.heartbeat_timeout)
                    self.events.emit("failure_detected", worker=worker, how="heartbeat")
                    self.procs[worker].kill()
                if failed and now - first_failure >= cfg.failure_window:
                    failed_ranks = {r for r, w in current.items() if w in failed}
                    try:
                        check_recoverable(generation, failed_ranks, self.world,
                                          self.ranks_per_node, self.allow_same_node)
                        plan = assign_spares(generation, current, failed_ranks, spares)
                    except RecoveryImpossible as err:
                        return self._abort(str(err))
                    self.store.set(keys.members(plan.generation), json.dumps(plan.rank_to_worker))
                    self.store.set(keys.replaced(plan.generation), json.dumps(plan.replaced))
                    self.store.set(keys.GENERATION, str(plan.generation))
                    self.events.emit("generation_declared", generation=plan.generation,
                                     failed_ranks=sorted(failed_ranks),
                                     replaced={str(k): v for k, v in plan.replaced.items()})
                    log.warning("deadpool-launch: generation %d: ranks %s failed; spares %s "
                                "take their places", plan.generation, sorted(failed_ranks),
                                plan.replaced)
                    generation, current = plan.generation, plan.rank_to_worker
                    spares = [s for s in spares if s not in plan.replaced.values()]
                    failed.clear()
                    first_failure = 0.0
                if all(w in exited and self._done(w) for w in current.values()):
                    self.store.set(keys.SHUTDOWN, "done")
                    return 0
                time.sleep(0.01)
        finally:
            self._stop_all()

    def _done(self, worker: str) -> bool:
        """Finished its training (it may still be exiting)."""
        return self.store.check([keys.done(worker)])

    def _hung(self, current: dict[int, str], spares: list[str], exited: set[str],
              now: float) -> list[str]:
        hung = []
        for worker in [*current.values(), *spares]:
            if (worker in exited or not self.store.check([keys.heartbeat(worker)])
                    or self._done(worker)):
                continue
            beat = self.store.get(keys.heartbeat(worker))
            last = self.heartbeats.get(worker)
            if last is None or last[0] != beat:
                self.heartbeats[worker] = (beat, now)
            elif now - last[1] > self.cfg.heartbeat_timeout:
                hung.append(worker)
                self.heartbeats[worker] = (beat, float("inf"))  # kill once
        return hung

    def _abort(self, reason: str) -> int:
        log.error("deadpool-launch: hot-swap impossible: %s", reason)
        self.events.emit("recovery_impossible", reason=reason)
        self.store.set(keys.SHUTDOWN, reason)
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        return RECOVERY_IMPOSSIBLE

    def _stop_all(self) -> None:
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        for proc in self.procs.values():
            if proc.poll() is None and deadline - time.monotonic() > 0:
                try:
                    proc.wait(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s launcher] %(message)s",
                        stream=sys.stdout, force=True)
    parser = argparse.ArgumentParser(
        prog="deadpool-launch",
        description="torchrun-like launcher with warm spares and hot-swap recovery")
    add_arguments(parser, LaunchConfig, "launch")
    parser.add_argument("script", help="training script, e.g. pretrain_scripts/pretrain_gpt.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    cfg = from_namespace(LaunchConfig, ns)
    cfg.validate()
    return Launcher(cfg, ns.script, ns.script_args).run()
