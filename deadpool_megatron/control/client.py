"""The worker side of the control plane: heartbeats, generation watch, assignments.

Every blocking call polls the store with a deadline and also watches for shutdown, so no
worker waits forever on a job that has ended.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from deadpool_megatron.control import keys

log = logging.getLogger("deadpool_megatron.control")
POLL_S = 0.01
WATCH_S = 0.02


class JobShutdown(RuntimeError):
    """The launcher ended the job (finished, or recovery impossible: the reason says)."""


class ControlClient:
    """One per worker process; built from the launcher's environment."""

    def __init__(self, host: str, port: int, worker: str, heartbeat_s: float,
                 timeout_s: float, epoch: int = 0) -> None:
        self.worker = worker
        self.epoch = epoch
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.host, self.port = host, port
        self.store = self._connect()
        self._watch_gen = -1
        self._on_new_generation: Callable[[int], None] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="deadpool-heartbeat",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls) -> "ControlClient | None":
        """None unless launched by deadpool-launch."""
        worker = os.environ.get("DEADPOOL_WORKER_ID")
        if worker is None:
            return None
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), worker,
                   float(os.environ.get("DEADPOOL_HEARTBEAT_S", "0.2")),
                   float(os.environ.get("DEADPOOL_CONTROL_TIMEOUT_S", "300")),
                   int(os.environ.get("DEADPOOL_EPOCH", "0")))

    @property
    def is_spare(self) -> bool:
        return self.worker.startswith("s")

    def _connect(self) -> dist.Store:
        """This epoch's view of the launcher's store (a restart opens a fresh one)."""
        store = dist.TCPStore(self.host, self.port, is_master=False,
                              timeout=timedelta(seconds=self.timeout_s))
        return dist.PrefixStore(keys.epoch_prefix(self.epoch), store)

    # -- heartbeat and generation watch (own thread, own connection) ----------------------
    def _beat(self) -> None:
        """Heartbeat every heartbeat_s; look for a new generation every WATCH_S."""
        store = self._connect()
        last_beat = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() - last_beat >= self.heartbeat_s:
                    store.set(keys.heartbeat(self.worker), repr(time.time()))
                    last_beat = time.monotonic()
                generation = int(store.get(keys.GENERATION))
            except Exception:  # noqa: BLE001 - the launcher is gone: the job is over
                return
            with self._lock:
                callback, watched = self._on_new_generation, self._watch_gen
                if callback is not None and generation > watched:
                    self._on_new_generation = None
            if callback is not None and generation > watched:
                callback(generation)
            self._stop.wait(WATCH_S)

    def watch(self, generation: int, on_new_generation: Callable[[int], None]) -> None:
        """Call `on_new_generation` once, from the heartbeat thread, when one is declared."""
        with self._lock:
            self._watch_gen = generation
            self._on_new_generation = on_new_generation

    def unwatch(self) -> None:
        with self._lock:
            self._on_new_generation = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.heartbeat_s + 1)

    # -- queries --------------------------------------------------------------------------
    def generation(self) -> int:
        return int(self.store.get(keys.GENERATION))

    def members(self, generation: int) -> dict[int, str]:
        return {int(r): w for r, w in json.loads(self.store.get(keys.members(generation))).items()}

    def replaced(self, generation: int) -> dict[int, str]:
        if not self.store.check([keys.replaced(generation)]):
            return {}
        return {int(r): w for r, w in json.loads(self.store.get(keys.replaced(generation))).items()}

    def _check_shutdown(self) -> None:
        if self.store.check([keys.SHUTDOWN]):
            raise JobShutdown(self.store.get(keys.SHUTDOWN).decode())

    def _poll(self, what: str, ready: Callable[[], object], timeout_s: float | None = None):
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            self._check_shutdown()
            value = ready()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.worker}: no {what} within "
                                   f"{timeout_s or self.timeout_s:.0f} s")
            time.sleep(POLL_S)

    # -- blocking steps ---------------------------------------------------------------------
    def wait_for_assignment(self) -> tuple[int, int]:
        """Spares: block until a generation gives this worker a rank; (generation, rank)."""
        def assigned() -> tuple[int, int] | None:
            generation = self.generation()
            for rank, worker in self.members(generation).items():
                if worker == self.worker:
                    return generation, rank
            return None

        return self._poll("assignment", assigned, timeout_s=float("inf"))

    def wait_generation_after(self, generation: int) -> int:
        """Survivors after an error: block until the launcher declares a newer generation."""
        def newer() -> int | None:
            g = self.generation()
            return g if g > generation else None

        return self._poll(f"generation after {generation}", newer)

    def rendezvous(self, generation: int, world_size: int) -> bool:
        """Store barrier of one generation; False if a newer one is declared meanwhile."""
        self.store.add(keys.joined(generation), 1)

        def all_joined() -> bool | None:
            if self.generation() != generation:
                return False
            return True if self.store.add(keys.joined(generation), 0) >= world_size else None

        return bool(self._poll(f"rendezvous of generation {generation}", all_joined))

    def report_failure(self, reason: str) -> None:
        try:
            self.store.set(keys.failure_report(self.worker), reason)
        except Exception:  # noqa: BLE001 - best effort; the exit code says it too
            pass

    def mark_done(self) -> None:
        self.store.set(keys.done(self.worker), "1")
