"""One host's worker processes for one epoch: start, report exits, obey kill requests, stop.

Every host's launcher runs this (host 0's too), so a worker's exit reaches the control
plane the same way wherever it ran: an exit report in the store plus a bumped counter
that host 0 watches (one read per tick, however many workers there are).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from typing import Sequence

import torch.distributed as dist

from deadpool_megatron.control import keys
from deadpool_megatron.launch.config import LaunchConfig

log = logging.getLogger("deadpool_megatron.launch")


def spare_ids(node: int, count: int) -> list[str]:
    """Spare worker ids of one host; every id that starts with "s" is a spare."""
    return [f"s{node}.{i}" for i in range(count)]


class LocalWorkers:
    """The processes this host started in one epoch, keyed by worker id."""

    def __init__(self, cfg: LaunchConfig, cmd: Sequence[str], store: dist.Store,
                 master_port: int, ranks_per_node: int, epoch: int) -> None:
        self.cfg, self.cmd, self.store = cfg, list(cmd), store
        self.master_port, self.ranks_per_node, self.epoch = master_port, ranks_per_node, epoch
        self.procs: dict[str, subprocess.Popen] = {}
        self.reported: set[str] = set()
        self._kills_seen = 0

    def _env(self, worker: str, rank: int | None, slot: int) -> dict[str, str]:
        env = {**os.environ, "MASTER_ADDR": self.cfg.master_addr,
               "MASTER_PORT": str(self.master_port), "WORLD_SIZE": str(self.cfg.world_size),
               "LOCAL_WORLD_SIZE": str(self.ranks_per_node), "GROUP_RANK": str(self.cfg.node_rank),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "DEADPOOL_WORKER_ID": worker,
               "DEADPOOL_HEARTBEAT_TIMEOUT_S": str(self.cfg.heartbeat_timeout),
               "DEADPOOL_EPOCH": str(self.epoch),
               # A spare keeps the device it was started on, whatever rank it takes.
               "DEADPOOL_DEVICE_SLOT": str(slot), "LOCAL_RANK": str(slot)}
        if rank is not None:
            env["RANK"] = str(rank)
        return env

    def start(self) -> list[str]:
        """Start this host's active workers and spares; returns the spare ids."""
        for slot, rank in enumerate(self.cfg.local_ranks()):
            self._start(f"w{rank}", rank, slot)
        spares = spare_ids(self.cfg.node_rank, self.cfg.spares)
        for i, worker in enumerate(spares):
            self._start(worker, None, self.cfg.nproc_per_node + i)
        self.store.set(keys.node_spares(self.cfg.node_rank), json.dumps(spares))
        return spares

    def _start(self, worker: str, rank: int | None, slot: int) -> None:
        proc = subprocess.Popen(self.cmd, env=self._env(worker, rank, slot),
                                stdin=subprocess.DEVNULL)
        # Workers run one step below the launcher's priority: on a host whose cores the
        # training saturates, the control plane that turns a death into a declaration
        # must not queue behind it (any user may lower a child's priority).
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + 1)
        except OSError:
            pass
        self.procs[worker] = proc

    def poll(self) -> None:
        """Report new exits; SIGKILL the workers host 0 asked to kill."""
        for worker, proc in self.procs.items():
            if worker not in self.reported and proc.poll() is not None:
                self.reported.add(worker)
                self.store.set(keys.exit_report(worker), str(proc.returncode))
                self.store.add(keys.EXITS, 1)
        kills = self.store.add(keys.KILLS, 0)
        if kills != self._kills_seen:
            self._kills_seen = kills
            for worker, proc in self.procs.items():
                if proc.poll() is None and self.store.check([keys.kill_request(worker)]):
                    log.warning("deadpool-launch: killing worker %s (asked by host 0)", worker)
                    proc.kill()

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def stop(self, timeout_s: float) -> None:
        """Give every worker until the deadline to exit on its own, then SIGKILL it."""
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
