"""Start the workers and the warm spares, host the control plane, and turn a worker's
death into a new generation instead of the end of the job.

One launcher runs per host. Host 0's also hosts the TCPStore control plane, outside every
training rank (rank 0 may die too), and runs the coordinator (launch/coordinator.py).
Unlike torchrun, a worker's exit never kills the survivors. When hot-swap is impossible
and the job writes durable checkpoints (--save), host 0 opens a new epoch: every host
restarts its workers from the newest checkpoint (--load). Keys of each epoch live under
their own store prefix, so nothing of an ended epoch can be mistaken for the next.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import select
import signal
import sys
import time
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from deadpool_megatron.config import ConfigError, add_arguments, from_namespace
from deadpool_megatron.control import keys
from deadpool_megatron.control.auth import SignedStore, TokenError, new_token, read_token_file
from deadpool_megatron.control.policy import RECOVERY_IMPOSSIBLE_RC
from deadpool_megatron.control.sockets import is_loopback, store_server, unresolvable
from deadpool_megatron.faults.remote import job_shape
from deadpool_megatron.launch.config import LaunchConfig, LaunchError
from deadpool_megatron.launch.console import Console, default_log_dir
from deadpool_megatron.launch.coordinator import STOPPED, Coordinator, EpochEnded, end_epoch
from deadpool_megatron.launch.orphans import Orphans
from deadpool_megatron.launch.preload import Preloader, start_preloader
from deadpool_megatron.launch.worker_flags import worker_flags
from deadpool_megatron.launch.workers import LocalWorkers
from deadpool_megatron.metrics.events import EventLog

log = logging.getLogger("deadpool_megatron.launch")
TICK_S = 0.01


class Launcher:
    def __init__(self, cfg: LaunchConfig, script: str, script_args: Sequence[str],
                 token: str) -> None:
        self.cfg, self.token = cfg, token
        self.script = script
        self.cmd = [sys.executable, "-u", script, *script_args]  # LocalWorkers forks cmd[2:]
        # The workers' failure domains: --deadpool-ranks-per-node if the job sets it, else
        # the launcher's (logical) hosts, passed to the workers as LOCAL_WORLD_SIZE.
        flags = self.worker = worker_flags(script_args)
        self.worker_ft = flags.deadpool
        rpn = flags.deadpool.deadpool_ranks_per_node
        self.ranks_per_node = rpn if rpn else cfg.nproc_per_node // cfg.logical_nodes
        self.allow_same_node = flags.deadpool.deadpool_allow_same_node_buddy
        # Without --deadpool the workers cannot hot-swap: run as torchrun would (a failure
        # restarts every worker from --save, or ends the job).
        self.hot_swap = flags.deadpool.deadpool
        self._epoch_store: dist.TCPStore | None = None  # host 0, without --deadpool
        self.save_dir = flags.save
        self.root: dist.TCPStore | None = None
        self.control: SignedStore | None = None  # the root keys (epochs, the end), signed
        self.joined_hosts: set[int] = set()  # host 0: the live hosts of the last epoch
        self._wake: int | None = None  # read end of the SIGCHLD wake-up pipe
        self._stopping = False  # SIGTERM (a scheduler's preemption or time limit)
        self.preloader: Preloader | None = None  # forks the workers (--preload)
        self.orphans = Orphans(adopted=False)  # what dead workers leave behind (run)
        self.console = Console(cfg.console, cfg.log_dir or default_log_dir(cfg.node_rank),
                               sys.stdout)

    def _cmd(self, epoch: int) -> list[str]:
        """Epochs after the first resume from the newest durable state under --save (a
        flushed snapshot or a checkpoint), if there is one; else as the job started."""
        from deadpool_megatron.integration.checkpoint import latest_iteration
        from deadpool_megatron.snapshot import flush

        if epoch == 0 or not self.save_dir or (latest_iteration(self.save_dir) is None
                                               and flush.latest(self.save_dir) is None):
            return self.cmd
        cmd = list(self.cmd)
        if "--load" in cmd[:-1]:
            cmd[cmd.index("--load") + 1] = self.save_dir
            return cmd
        return [*cmd, "--load", self.save_dir]

    def _tick(self) -> None:
        """Wait TICK_S, or less if a worker exits meanwhile."""
        if self._wake is None:
            time.sleep(TICK_S)
            return
        preloaded = self.preloader is not None and self.preloader.alive
        select.select([self._wake, *([self.preloader.fileno()] if preloaded else [])], [], [],
                      TICK_S)
        if preloaded:
            self.preloader.pump()  # its news read, the pipe waits for the next
        try:
            while os.read(self._wake, 512):
                pass
        except BlockingIOError:
            pass

    def _workers(self, epoch: int, incarnation: int = 0) -> LocalWorkers:
        store = SignedStore(self.root, self.token, keys.epoch_prefix(epoch))
        return LocalWorkers(self.cfg, self._cmd(epoch), store, self._worker_port(epoch),
                            self.ranks_per_node, epoch, self.console.open_epoch(epoch),
                            preloader=self.preloader, orphans=self.orphans,
                            progress_timeout_s=self.worker_ft.deadpool_progress_timeout
                            or 0.0,
                            startup_timeout_s=self.worker_ft.deadpool_startup_timeout,
                            ignore_sigterm=self.hot_swap, incarnation=incarnation)

    def _worker_port(self, epoch: int) -> int:
        """The store port the workers rendezvous on. With --deadpool, the control plane's
        (every key of an epoch lives under its prefix). Without, torch's own env://
        rendezvous keeps its keys at the root of the store, so each epoch (a restart from
        the checkpoint) gets a store of its own, as torchrun starts one per restart."""
        if self.hot_swap:
            return self.root.port
        if self.cfg.node_rank == 0:
            self._epoch_store = store_server(self.cfg.master_addr, 0, timeout_s=60)
            self.control.set(keys.epoch_port(epoch), str(self._epoch_store.port))
            return self._epoch_store.port
        return int(self._authentic(keys.epoch_port(epoch)))

    def _authentic(self, key: str) -> bytes:
        """A root key host 0 writes (waiting while it is unset or forged)."""
        deadline = time.monotonic() + self.cfg.join_timeout
        while (value := self.control.read(key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no authenticated {key} within --join-timeout")
            time.sleep(0.05)
        return value

    def run(self) -> int:
        self.console.start()
        # Before anything is started: every later descendant's orphans come to us.
        self.orphans = Orphans.adopt()
        # It imports while the control plane comes up; CUDA does not survive a fork.
        if self.cfg.preload == "auto" and torch.cuda.device_count() == 0:
            self.preloader = start_preloader(
                self.script, os.path.join(self.console.log_dir, "preload.log"))
        try:
            return self._run()
        finally:
            if self.preloader is not None:
                self.preloader.close()
            self.orphans.close()
            self.console.close()

    def _run(self) -> int:
        cfg = self.cfg
        # A worker's death wakes the control loop at once, not at its next tick: SIGCHLD
        # writes a byte to a pipe the loop waits on.
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        self._wake = read_end
        signal.set_wakeup_fd(write_end)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._on_term)
        if cfg.node_rank == 0:
            self.root = store_server(cfg.master_addr, cfg.master_port, timeout_s=60)
            self.control = SignedStore(self.root, self.token)
            self.control.set(keys.LAYOUT, json.dumps(
                {"nnodes": cfg.nnodes, "nproc_per_node": cfg.nproc_per_node,
                 "standby_hosts": cfg.standby_hosts, "control_only": cfg.control_only,
                 "shape": job_shape(self.worker.tp, self.worker.pp, self.worker.cp,
                                    cfg.world_size, self.ranks_per_node)}))
            if cfg.nnodes > 1 and is_loopback(cfg.master_addr):
                log.warning("deadpool-launch: host 0 listens on %s only (--master-addr), a "
                            "loopback address: hosts on other machines cannot reach it; pass "
                            "host 0's network address", cfg.master_addr)
            return self._run_host0()
        self.root = dist.TCPStore(cfg.master_addr, cfg.master_port, is_master=False,
                                  timeout=timedelta(seconds=cfg.join_timeout))
        self.control = SignedStore(self.root, self.token)
        try:
            self._adopt_layout()
            return self._run_other_host()
        except dist.DistError as err:
            log.error("deadpool-launch: host %d lost the control plane on %s:%d (%s); "
                      "stopping", cfg.node_rank, cfg.master_addr, cfg.master_port, err)
            return 1
        except LaunchError as err:
            log.error("deadpool-launch: %s", err)
            return 2

    def _on_term(self, *_: object) -> None:
        """SIGTERM: the job is to stop. Host 0 has the workers flush their newest snapshots
        to --save first (every launcher asks it: a scheduler signals every host)."""
        if not self._stopping:
            log.warning("deadpool-launch: SIGTERM: asking for a flush of the newest snapshots "
                        "and a stop")
        self._stopping = True

    def _ask_to_stop(self, workers: LocalWorkers) -> None:
        if self._stopping and not workers.store.check([keys.flush_request(self.cfg.node_rank)]):
            workers.store.set(keys.flush_request(self.cfg.node_rank), "SIGTERM")
            workers.store.add(keys.FLUSH_REQUESTS, 1)  # host 0 reads the requests then

    # -- host 0 ---------------------------------------------------------------------------
    def _run_host0(self) -> int:
        """Hot-swap for as long as it can; then, if the job writes durable checkpoints
        (--save), restart every host's workers from the newest one, once per
        --max-restarts."""
        events = EventLog(self.worker_ft.deadpool_events, rank=-1)
        for epoch in range(self.cfg.max_restarts + 1):
            rc = self._run_epoch(epoch, events)
            if rc != RECOVERY_IMPOSSIBLE_RC or self.save_dir is None \
                    or epoch == self.cfg.max_restarts or self._stopping:
                break
            log.warning("deadpool-launch: falling back to the newest durable state under %s "
                        "(flushed snapshot or checkpoint): restarting all %d workers with "
                        "--load", self.save_dir, self.cfg.world_size)
            events.emit("checkpoint_fallback", save=self.save_dir, attempt=epoch + 1)
        self.control.set(keys.END, str(rc))
        self._wait_for_byes()
        return rc

    def _run_epoch(self, epoch: int, events: EventLog) -> int:
        cfg = self.cfg
        workers = self._workers(epoch)
        coordinator = Coordinator(cfg, workers.store, self.ranks_per_node,
                                  self.allow_same_node, events, self.hot_swap)
        coordinator.open()
        self.console.follow_job(coordinator)
        self.control.set(keys.EPOCH, str(epoch))  # the other hosts start their workers now
        spares = workers.start()
        log.info("deadpool-launch: epoch %d: %d workers on %d host(s) (%d per host, %d "
                 "failure domains of %d ranks)%s, %d warm spares here%s; control plane on "
                 "%s:%d", epoch, cfg.world_size, len(cfg.training_hosts), cfg.nproc_per_node,
                 cfg.world_size // self.ranks_per_node, self.ranks_per_node,
                 f" and {cfg.standby_hosts} standby host(s)" if cfg.standby_hosts else "",
                 len(spares), " (control only)" if cfg.control_only else "", cfg.master_addr,
                 self.root.port)
        try:
            while True:
                workers.poll()
                self._ask_to_stop(workers)
                coordinator.tick(time.monotonic())
                self._tick()
        except EpochEnded as end:
            if end.returncode == RECOVERY_IMPOSSIBLE_RC:
                log.error("deadpool-launch: hot-swap impossible: %s", end)
                events.emit("recovery_impossible", reason=str(end))
            elif end.returncode != 0:
                log.error("deadpool-launch: ending the job: %s", end)
            if end.flush:
                self._flush(workers, coordinator, end, events)
            if end.returncode != 0:
                end_epoch(workers.store, str(end))
            workers.stop(cfg.shutdown_timeout)
            self.joined_hosts = coordinator.live_hosts()
            return end.returncode

    def _flush(self, workers: LocalWorkers, coordinator: Coordinator, end: EpochEnded,
               events: EventLog) -> None:
        """Have every live worker write its newest snapshots (and a lost ward's) to --save,
        within --flush-timeout, then commit the newest complete one (snapshot/flush.py)."""
        from deadpool_megatron.snapshot import flush

        if not self.hot_swap or self.save_dir is None:
            log.warning("deadpool-launch: nothing flushed: %s", "the training script has no "
                        "--save" if self.hot_swap else "the workers run without --deadpool")
            return
        t0 = time.monotonic()
        expected = coordinator.declare_flush(end.lost, str(end))
        while time.monotonic() - t0 < self.cfg.flush_timeout:
            workers.poll()
            if all(coordinator.flushed_or_gone(w) for w in expected):
                break
            self._tick()
        missing = [w for w in expected if not coordinator.flushed_or_gone(w)]
        dumped = workers.dump_stacks(missing)  # where each was, in its log
        if dumped:
            log.error("deadpool-launch: workers %s did not report at the flush within "
                      "--flush-timeout (%.0f s); their stacks are in their logs", dumped,
                      self.cfg.flush_timeout)
        before = flush.latest(self.save_dir)
        iteration = flush.commit(self.save_dir, self.cfg.world_size)
        seconds = time.monotonic() - t0
        if iteration == before:
            iteration = None  # nothing newer than an earlier flush is complete
        events.emit("flush_committed", iteration=iteration, seconds=round(seconds, 3),
                    missing=missing)
        resume = "; relaunch with --load " + self.save_dir + " to resume there" \
            if end.returncode == STOPPED else ""
        nothing = None if iteration is not None or missing \
            else coordinator.why_nothing_flushed(expected)
        if nothing is not None:
            log.warning("deadpool-launch: no worker holds snapshots to flush (%s)", nothing)
            return
        if iteration is None:
            log.error("deadpool-launch: the flush wrote no complete snapshot in %.1f s "
                      "(%s); the newest checkpoint under %s stays the one to load", seconds,
                      f"no report from {missing}" if missing else "shards missing",
                      self.save_dir)
            return
        log.warning("deadpool-launch: flushed the snapshot of iteration %d to %s in %.1f s%s",
                    iteration, flush.iteration_dir(self.save_dir, iteration), seconds, resume)

    def _wait_for_byes(self) -> None:
        """Keep the store up until every other live host has read the end (bounded; a
        host lost as a whole is not waited for)."""
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        others = [keys.bye(n) for n in sorted(self.joined_hosts - {0})]
        while others and time.monotonic() < deadline:
            others = [key for key in others if self.control.read(key) is None]
            time.sleep(0.05)

    # -- every other host ---------------------------------------------------------------
    def _adopt_layout(self) -> None:
        """Host 0's layout: whether it trains (--control-only), checked against ours."""
        layout = json.loads(self._authentic(keys.LAYOUT))
        mine = {"nnodes": self.cfg.nnodes, "nproc_per_node": self.cfg.nproc_per_node,
                "standby_hosts": self.cfg.standby_hosts}
        theirs = {k: layout.get(k, 0) for k in mine}
        if theirs != mine:
            raise LaunchError(f"host {self.cfg.node_rank} was started with {mine}, host 0 "
                              f"with {theirs}: give every host the same --nnodes, "
                              f"--nproc-per-node and --standby-hosts")
        self.cfg = dataclasses.replace(self.cfg, control_only=bool(layout["control_only"]))

    def _run_other_host(self) -> int:
        cfg, epoch = self.cfg, -1
        while True:
            epoch, end = self._next_epoch(epoch)
            if end is not None:
                self.control.set(keys.bye(cfg.node_rank), "1")
                return end
            incarnation = self._start_count(epoch)
            if incarnation and not self.hot_swap:
                log.warning("deadpool-launch: host %d rejoins epoch %d, which cannot take it "
                            "back without --deadpool (its lost ranks end the epoch): waiting "
                            "for host 0's next epoch (a restart from --save) or the end",
                            cfg.node_rank, epoch)
                continue
            workers = self._workers(epoch, incarnation)
            try:
                spares = workers.start()
                ranks = workers.ranks
                log.info("deadpool-launch: host %d, epoch %d: %s and %d warm spares started",
                         cfg.node_rank, epoch, f"ranks {ranks[0]}..{ranks[-1]}" if ranks
                         else "a standby host: no rank" if not incarnation else
                         "rejoined a running epoch as a standby host (spares hold its ranks)",
                         len(spares))
                try:
                    while workers.ended is None:  # host 0 announces it (kill counter)
                        workers.poll()
                        self._ask_to_stop(workers)
                        self._tick()
                except dist.DistError:
                    # Host 0 is gone: the workers notice too; they flush and exit.
                    log.error("deadpool-launch: host %d lost the control plane; its workers "
                              "get --flush-timeout %.0f s to write their snapshots and exit",
                              cfg.node_rank, cfg.flush_timeout)
                    workers.stop(cfg.flush_timeout)
                    raise
                workers.poll()
                workers.stop(cfg.shutdown_timeout)
                workers.poll()
            finally:
                workers.stop(0)  # on a lost control plane too: leave nothing behind

    def _start_count(self, epoch: int) -> int:
        """How many launchers of this host started in `epoch` before this one. After the
        first, the host rejoins: its ranks went to spares when its earlier launcher was
        lost, so it brings spares only, and needs some."""
        store = SignedStore(self.root, self.token, keys.epoch_prefix(epoch))
        incarnation = store.add(keys.host_starts(self.cfg.node_rank), 1) - 1
        if incarnation and self.hot_swap and self.cfg.spares <= 0:
            raise LaunchError(f"host {self.cfg.node_rank} rejoins epoch {epoch} of a running "
                              f"job (its earlier launcher was lost and spares took its ranks): "
                              f"it runs spares only; give it --spares 1 or more")
        return incarnation

    def _next_epoch(self, epoch: int) -> tuple[int, int | None]:
        """Wait for host 0 to open an epoch after `epoch` or end the job: (epoch, end)."""
        deadline = time.monotonic() + self.cfg.join_timeout
        while time.monotonic() < deadline:
            end, opened = _as_int(self.control.read(keys.END)), \
                _as_int(self.control.read(keys.EPOCH))
            if end is not None:
                return epoch, end
            if opened is not None and opened > epoch:
                return opened, None
            time.sleep(0.05)
        log.error("deadpool-launch: host %d: host 0 opened no epoch after %d within "
                  "--join-timeout %.0f s", self.cfg.node_rank, epoch, self.cfg.join_timeout)
        return epoch, 1


def _as_int(value: bytes | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        log.warning("deadpool-launch: ignored a malformed value %r", value[:80])
        return None


def _job_token(cfg: LaunchConfig) -> str:
    """--job-token-file's token; a single-host job makes its own."""
    return read_token_file(cfg.job_token_file) if cfg.job_token_file else new_token()


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
    try:
        cfg.validate()
        if (why := unresolvable(cfg.master_addr)) is not None:
            raise LaunchError(f"--master-addr {cfg.master_addr!r} does not resolve on this "
                              f"host ({why}): pass host 0's IP address, or a name this "
                              f"host's resolver knows")
        flags = worker_flags(ns.script_args)
        cfg.check_devices(flags.backend, torch.cuda.device_count())
        if cfg.spares and not flags.deadpool.deadpool:
            raise LaunchError(f"--spares {cfg.spares} needs --deadpool on the training script "
                              f"(spares take failed ranks only with hot-swap); add --deadpool "
                              f"or launch with --spares 0")
        if cfg.spare_respawns and not flags.deadpool.deadpool:
            raise LaunchError(f"--spare-respawns {cfg.spare_respawns} needs --deadpool on the "
                              f"training script (spares take failed ranks only with hot-swap)")
        token = _job_token(cfg)
    except (LaunchError, TokenError, ConfigError) as err:
        parser.error(str(err))  # exit status 2, like every other bad flag
    return Launcher(cfg, ns.script, ns.script_args, token).run()
