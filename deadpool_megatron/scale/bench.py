"""The control plane at scale: host 0's real store and coordinator, and N simulated ranks
that train nothing but make every control-plane request a worker makes (scale/member.py)
on simulated hosts whose launchers make theirs (scale/host.py), a few processes of them.

One run at N ranks: start (every rank in generation 0, the spares waiting), a steady
window (requests per second by host, rank and spare; the coordinator's CPU per tick),
then recoveries: a rank is killed, its host reports the exit, the coordinator declares,
every member and the spare meet in the next generation. Measured per recovery: the
declaration to the last member through the rendezvous (`declared_to_joined_s`), and each
member's share of the store requests and bytes (the members', the dead rank's host's, the
coordinator's), to which the process groups' requests are added as torch makes them
(scale/groups.py). The plan and the placements are timed at N too (pure functions).
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as wait_pipes
from typing import Any

from deadpool_megatron.control import keys
from deadpool_megatron.control.auth import SignedStore, new_token
from deadpool_megatron.control.sockets import store_server
from deadpool_megatron.launch.config import LaunchConfig
from deadpool_megatron.launch.coordinator import Coordinator, EpochEnded
from deadpool_megatron.launch.launcher import TICK_S
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.metrics.threads import cpu_seconds, thread_ids
from deadpool_megatron.scale import placement
from deadpool_megatron.scale.counting import CountingStore
from deadpool_megatron.scale.groups import kept_recovery_groups, megatron_groups, recovery_groups
from deadpool_megatron.scale.process import HostSpec, ProcessSpec, main as process_main

# Keys whose traffic goes on whether or not anything fails (heartbeats, polls, the
# coordinator's scans): the coordinator's requests on them are steady load, not a
# recovery's.
STEADY = ("dp/exits", "dp/kills", "dp/host/", "dp/flush_request", "dp/injects",
          "dp/node", "dp/shutdown", "dp/done/", "dp/inject")


def classify(key: str) -> str:
    return "steady" if any(s in key for s in STEADY) else "recovery"


@dataclass
class ScaleConfig:
    ranks: int
    ranks_per_host: int = 8
    processes: int = 4
    recoveries: int = 3
    steady_s: float = 3.0
    spare_hosts: int = 8  # hosts with one spare each (the first ones)
    tp: int = 8
    pp: int = 4
    seed: int = 0
    timeout_s: float = 900.0


@dataclass
class Recovery:
    generation: int
    killed_to_declared_s: float
    declared_to_joined_s: float
    declared_to_settled_s: float
    member_requests: float  # per member (the members' own)
    host_requests: int  # the dead rank's host: its exit report
    coordinator_requests: int
    bytes_per_member: float
    max_member_requests: int
    store_cpu_s: float = 0.0  # host 0's store thread, kill to every member joined


@dataclass
class ScaleResult:
    ranks: int
    hosts: int
    processes: int
    start_s: float
    steady: dict[str, float]
    coordinator_tick_ms: float
    coordinator_scan_ms: float
    recoveries: list[Recovery] = field(default_factory=list)
    groups: dict[str, Any] = field(default_factory=dict)
    placement_ms: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        recs = self.recoveries
        med = (lambda xs: statistics.median(xs) if xs else float("nan"))
        control = med([r.member_requests + (r.host_requests + r.coordinator_requests)
                       / self.ranks for r in recs])
        nccl, gloo = self.groups.get("nccl", 0.0), self.groups.get("gloo", 0.0)
        return {
            "ranks": self.ranks, "hosts": self.hosts,
            "declared_to_joined_s": med([r.declared_to_joined_s for r in recs]),
            "declared_to_settled_s": med([r.declared_to_settled_s for r in recs]),
            "killed_to_declared_s": med([r.killed_to_declared_s for r in recs]),
            "store_ops_per_member_per_recovery": control + nccl,
            "control_ops_per_member_per_recovery": control,
            "pg_ops_per_member_nccl": nccl,
            "pg_ops_per_member_gloo": gloo,
            "store_ops_per_member_per_recovery_gloo": control + gloo,
            # With the groups no failure touched kept (reconstruct/keep.py: gloo today).
            "store_ops_per_member_per_recovery_kept":
                control + self.groups.get("kept_nccl", 0.0) + self.groups.get("agreement", 0.0),
            "agreement_ops_per_member_kept": self.groups.get("agreement", 0.0),
            "pg_ops_per_member_nccl_kept": self.groups.get("kept_nccl", 0.0),
            "pg_ops_per_member_gloo_kept": self.groups.get("kept_gloo", 0.0),
            "megatron_groups_per_member": self.groups.get("megatron", 0),
            "megatron_groups_per_member_kept": self.groups.get("kept_megatron", 0.0),
            "ranks_making_groups_kept": self.groups.get("kept_builders", 0),
            "bytes_per_member_per_recovery": med([r.bytes_per_member for r in recs]),
            "max_member_requests": max((r.max_member_requests for r in recs), default=0),
            "store_cpu_s_per_recovery": med([r.store_cpu_s for r in recs]),
            "steady_store_cpu_share": self.steady.get("store_cpu", 0.0),
            "steady_ops_per_s_per_host": self.steady.get("per_host", 0.0),
            "steady_ops_per_s_per_rank": self.steady.get("per_rank", 0.0),
            "steady_ops_per_s_per_spare": self.steady.get("per_spare", 0.0),
            "steady_ops_per_s_host0": self.steady.get("host0", 0.0),
            "coordinator_cpu_ms_per_tick": self.coordinator_tick_ms,
            "coordinator_cpu_ms_per_scan": self.coordinator_scan_ms,
            "start_s": self.start_s,
            **{f"{k}_ms": v for k, v in self.placement_ms.items()},
            "groups_per_member": self.groups.get("groups", 0),
            "pair_new_group_calls_per_rank": self.groups.get("pair_calls", 0),
            "recoveries": [asdict(r) for r in recs],
        }


class _Host0:
    """Host 0 as deadpool-launch --control-only runs it: the store, its own (empty)
    launcher loop and the coordinator, ticking every TICK_S."""

    def __init__(self, cfg: ScaleConfig, token: str) -> None:
        from deadpool_megatron.launch.workers import LocalWorkers

        hosts = cfg.ranks // cfg.ranks_per_host
        before = thread_ids()
        self.server = store_server("127.0.0.1", 0, timeout_s=120)
        self.store_threads = thread_ids() - before  # the store server's own (libuv) thread
        self.counting = CountingStore(self.server, classify)
        self.launch = LaunchConfig(nproc_per_node=cfg.ranks_per_host, nnodes=hosts + 1,
                                   control_only=True, heartbeat_timeout=60.0,
                                   join_timeout=cfg.timeout_s)
        store = SignedStore(self.counting, token, keys.epoch_prefix(0))
        self.coordinator = Coordinator(self.launch, store, cfg.ranks_per_host, False,
                                       EventLog(None, rank=-1))
        self.workers = LocalWorkers(self.launch, [], store, self.server.port,
                                    cfg.ranks_per_host, 0, "/tmp")
        self.declared: list[tuple[int, float]] = []
        declare = self.coordinator._declare

        def timed_declare() -> None:
            t = time.monotonic()
            declare()
            self.declared.append((self.coordinator.generation, t))

        self.coordinator._declare = timed_declare  # type: ignore[method-assign]
        self.ticks = 0
        self.tick_cpu = 0.0
        self.scan_cpu: list[float] = []
        self.coordinator.open()

    def tick(self) -> None:
        self.workers.poll()
        scanning = time.monotonic() >= self.coordinator._next_scan
        t0 = time.thread_time()
        self.coordinator.tick(time.monotonic())
        spent = time.thread_time() - t0
        self.ticks += 1
        self.tick_cpu += spent
        if scanning:
            self.scan_cpu.append(spent)


class Harness:
    def __init__(self, cfg: ScaleConfig) -> None:
        self.cfg = cfg
        self.token = new_token()
        self.host0 = _Host0(cfg, self.token)
        self.pipes: list[Any] = []
        self.procs: list[Any] = []
        self.owner: dict[int, int] = {}  # rank -> process index
        self.joins: dict[int, dict[int, tuple[int, float, float]]] = {}
        self.killed_at: list[float] = []

    # -- processes --------------------------------------------------------------------------
    def start(self) -> float:
        cfg = self.cfg
        hosts = cfg.ranks // cfg.ranks_per_host
        specs: list[list[HostSpec]] = [[] for _ in range(cfg.processes)]
        for h in range(hosts):
            p = h * cfg.processes // hosts
            node = h + 1  # host 0 is the control-only host
            specs[p].append(HostSpec(node, h * cfg.ranks_per_host, cfg.ranks_per_host,
                                     1 if h < cfg.spare_hosts else 0))
            for r in range(h * cfg.ranks_per_host, (h + 1) * cfg.ranks_per_host):
                self.owner[r] = p
        ctx = multiprocessing.get_context("spawn")
        t0 = time.monotonic()
        for p in range(cfg.processes):
            ours, theirs = ctx.Pipe()
            spec = ProcessSpec("127.0.0.1", self.host0.server.port, self.token, cfg.ranks,
                               tuple(specs[p]), TICK_S)
            proc = ctx.Process(target=process_main, args=(theirs, spec), daemon=True)
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)
        self._until(lambda: self._joined(0) >= cfg.ranks, "generation 0")
        return time.monotonic() - t0

    def stop(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.host0.workers.stop(0)  # its progress directory

    def _joined(self, generation: int) -> int:
        return sum(j.get(generation, (0, 0.0, 0.0))[0] for j in self.joins.values())

    def _last(self, generation: int, which: int) -> float:
        return max(j[generation][which] for j in self.joins.values() if generation in j)

    def _until(self, done: Any, what: str, timeout_s: float | None = None) -> None:
        """Tick host 0 and read the processes' reports until `done()`."""
        deadline = time.monotonic() + (timeout_s or self.cfg.timeout_s)
        next_tick = time.monotonic()
        while not done():
            now = time.monotonic()
            if now >= next_tick:
                try:
                    self.host0.tick()
                except EpochEnded as end:
                    raise RuntimeError(f"the coordinator ended the epoch: {end}") from None
                next_tick = now + TICK_S
            if now > deadline:
                raise TimeoutError(f"{what}: not done within the harness's timeout "
                                   f"({self._progress()}; {self._states()})")
            for pipe in wait_pipes(self.pipes, timeout=max(0.0, next_tick - time.monotonic())):
                self._message(self.pipes.index(pipe), pipe.recv())

    def _states(self) -> str:
        """Where the processes' live workers are (asked when the harness gives up)."""
        for pipe in self.pipes:
            pipe.send(("states",))
        states: collections.Counter = collections.Counter()
        deadline = time.monotonic() + 10
        answered = 0
        while answered < len(self.pipes) and time.monotonic() < deadline:
            for pipe in wait_pipes(self.pipes, timeout=1):
                kind, *args = pipe.recv()
                if kind == "states":
                    states.update(args[0])
                    answered += 1
        return ", ".join(f"{n} {s}" for s, n in states.most_common(6))

    def _progress(self) -> str:
        gens = sorted({g for j in self.joins.values() for g in j})
        return ", ".join(f"generation {g}: {self._joined(g)} joined" for g in gens)

    def _message(self, p: int, message: tuple) -> None:
        kind, *args = message
        if kind == "joins":
            for g, entry in args[0].items():
                self.joins.setdefault(p, {})[g] = entry
        elif kind == "killed":
            self.killed_at.append(args[0])
        elif kind == "tallies":
            self._tallies[p] = args[1]
        elif kind == "error":
            raise RuntimeError(f"a simulated worker failed: {args[0]}")

    def _collect(self, phase: str) -> list[dict]:
        self._tallies: dict[int, dict] = {}
        for pipe in self.pipes:
            pipe.send(("tallies", phase))
        self._until(lambda: len(self._tallies) == len(self.pipes), f"tallies of {phase}", 60)
        return [self._tallies[p] for p in range(len(self.pipes))]

    def _phase(self, name: str) -> None:
        for pipe in self.pipes:
            pipe.send(("phase", name))

    # -- the measurements -------------------------------------------------------------------
    def steady(self) -> tuple[dict[str, float], float, float]:
        cfg, host0 = self.cfg, self.host0
        self._phase("steady")
        before = dict(host0.counting.requests)
        host0.ticks, host0.tick_cpu, host0.scan_cpu = 0, 0.0, []
        store_cpu = cpu_seconds(host0.store_threads)
        t0 = time.monotonic()
        self._until(lambda: time.monotonic() - t0 >= cfg.steady_s, "the steady window")
        elapsed = time.monotonic() - t0
        self._phase("idle")
        tallies = self._collect("steady")
        hosts = sum(t["hosts"]["count"] for t in tallies)
        spares = sum(t["spares"]["count"] for t in tallies)
        host0_requests = sum(host0.counting.requests.values()) - sum(before.values())
        steady = {
            "per_host": sum(t["hosts"]["requests"] for t in tallies) / hosts / elapsed,
            "per_rank": sum(t["members"]["requests"] for t in tallies) / cfg.ranks / elapsed,
            "per_spare": (sum(t["spares"]["requests"] for t in tallies) / spares / elapsed
                          if spares else 0.0),
            "host0": host0_requests / elapsed,
            "store_cpu": (cpu_seconds(host0.store_threads) - store_cpu) / elapsed,
        }
        tick = 1e3 * host0.tick_cpu / max(1, host0.ticks)
        scan = 1e3 * statistics.median(host0.scan_cpu) if host0.scan_cpu else 0.0
        return steady, tick, scan

    def recover(self, victim: int) -> Recovery:
        host0 = self.host0
        generation = host0.coordinator.generation + 1
        counted = dict(host0.counting.requests)
        counted_bytes = dict(host0.counting.bytes)
        killed = len(self.killed_at)
        store_cpu = cpu_seconds(host0.store_threads)
        self.pipes[self.owner[victim]].send(("kill", victim))
        self._until(lambda: len(self.killed_at) > killed and host0.declared
                    and host0.declared[-1][0] == generation, f"the declaration of {generation}")
        self._until(lambda: self._joined(generation) >= self.cfg.ranks,
                    f"generation {generation}")
        declared = host0.declared[-1][1]
        store_cpu = cpu_seconds(host0.store_threads) - store_cpu
        coordinator = host0.counting.requests["recovery"] - counted.get("recovery", 0)
        coordinator_bytes = host0.counting.bytes["recovery"] - counted_bytes.get("recovery", 0)
        tallies = self._collect(f"rec{generation}")
        exits = self._collect("exit")
        members = sum(t["members"]["requests"] + t["spares"]["requests"] for t in tallies)
        member_bytes = sum(t["members"]["bytes"] + t["spares"]["bytes"] for t in tallies)
        n = self.cfg.ranks
        return Recovery(
            generation=generation,
            killed_to_declared_s=declared - self.killed_at[-1],
            declared_to_joined_s=self._last(generation, 1) - declared,
            declared_to_settled_s=self._last(generation, 2) - declared,
            member_requests=members / n,
            host_requests=sum(t["hosts"]["requests"] for t in exits),
            coordinator_requests=coordinator,
            bytes_per_member=(member_bytes + coordinator_bytes) / n,
            max_member_requests=max(max(t["members"]["max_requests"],
                                        t["spares"]["max_requests"]) for t in tallies),
            store_cpu_s=store_cpu)


def run(cfg: ScaleConfig, log: Any = print) -> ScaleResult:
    """One harness run at `cfg.ranks` ranks."""
    rng = random.Random(cfg.seed)
    harness = Harness(cfg)
    hosts = cfg.ranks // cfg.ranks_per_host
    try:
        start_s = harness.start()
        log(f"[{cfg.ranks} ranks] generation 0 formed in {start_s:.1f} s")
        steady, tick_ms, scan_ms = harness.steady()
        result = ScaleResult(cfg.ranks, hosts, cfg.processes, start_s, steady, tick_ms,
                             scan_ms)
        victims = rng.sample(range(cfg.ranks), cfg.recoveries)
        for victim in victims:
            rec = harness.recover(victim)
            log(f"[{cfg.ranks} ranks] generation {rec.generation}: rank {victim} killed, "
                f"declared {1e3 * rec.killed_to_declared_s:.0f} ms later, every member "
                f"joined {rec.declared_to_joined_s:.3f} s after the declaration; "
                f"{rec.member_requests:.1f} requests per member")
            result.recoveries.append(rec)
    finally:
        harness.stop()
    rank = cfg.ranks // 2 + 3
    megatron = megatron_groups(cfg.ranks, cfg.tp, cfg.pp, rank=rank)
    pairs = placement.pair_groups(cfg.ranks, cfg.ranks_per_host)
    cost = recovery_groups(cfg.ranks, megatron.mine, pairs)
    kept = kept_recovery_groups(cfg.ranks, cfg.tp, cfg.pp, megatron.every, rank, pairs)
    result.groups = {"groups": cost.groups, "nccl": cost.nccl, "gloo": cost.gloo,
                     "largest": cost.largest, "megatron": len(megatron.mine),
                     "kept_megatron": kept.groups, "kept_builders": kept.builders,
                     "kept_nccl": kept.nccl, "kept_gloo": kept.gloo,
                     "agreement": kept.agreement,
                     "pair_calls": placement.pair_new_group_calls(cfg.ranks,
                                                                  cfg.ranks_per_host)}
    result.placement_ms = placement.timings(cfg.ranks, cfg.ranks_per_host, cfg.tp, cfg.pp)
    return result


def table(results: list[dict]) -> str:
    """The side-by-side table, one column per rank count."""
    rows = [
        ("declaration -> all joined (s)", "declared_to_joined_s", "{:.3f}"),
        ("... -> recovery's requests done (s)", "declared_to_settled_s", "{:.3f}"),
        ("exit -> declaration (s)", "killed_to_declared_s", "{:.3f}"),
        ("store requests / member / recovery", "store_ops_per_member_per_recovery", "{:.1f}"),
        ("  control plane", "control_ops_per_member_per_recovery", "{:.1f}"),
        ("  process groups, NCCL", "pg_ops_per_member_nccl", "{:.1f}"),
        ("  (process groups, gloo: full mesh)", "pg_ops_per_member_gloo", "{:.0f}"),
        ("store requests / member / recovery, groups kept",
         "store_ops_per_member_per_recovery_kept", "{:.1f}"),
        ("  process groups, NCCL, groups kept", "pg_ops_per_member_nccl_kept", "{:.1f}"),
        ("  the groups' agreement (control plane)", "agreement_ops_per_member_kept", "{:.1f}"),
        ("  (process groups, gloo, groups kept)", "pg_ops_per_member_gloo_kept", "{:.0f}"),
        ("Megatron groups made again / member", "megatron_groups_per_member", "{:.0f}"),
        ("  ... groups kept (mean over members)", "megatron_groups_per_member_kept", "{:.1f}"),
        ("  ranks making a group of 2..N-1, groups kept", "ranks_making_groups_kept", "{:.0f}"),
        ("bytes / member / recovery", "bytes_per_member_per_recovery", "{:.0f}"),
        ("host 0's store thread, CPU s / recovery", "store_cpu_s_per_recovery", "{:.2f}"),
        ("most requests of one member", "max_member_requests", "{:.0f}"),
        ("steady requests/s per host", "steady_ops_per_s_per_host", "{:.1f}"),
        ("steady requests/s per rank", "steady_ops_per_s_per_rank", "{:.2f}"),
        ("steady requests/s per spare", "steady_ops_per_s_per_spare", "{:.2f}"),
        ("steady requests/s, host 0 (coordinator)", "steady_ops_per_s_host0", "{:.0f}"),
        ("steady: host 0's store thread busy (share)", "steady_store_cpu_share", "{:.3f}"),
        ("coordinator CPU ms / tick (mean)", "coordinator_cpu_ms_per_tick", "{:.2f}"),
        ("coordinator CPU ms / host scan", "coordinator_cpu_ms_per_scan", "{:.2f}"),
        ("plan (ms)", "plan_ms", "{:.1f}"),
        ("spare assignment (ms)", "assign_ms", "{:.2f}"),
        ("pair + replica placement, one rank (ms)", "placement_ms", "{:.3f}"),
        ("pair-link new_group calls per rank", "pair_new_group_calls_per_rank", "{:.0f}"),
        ("generation 0 formed (s)", "start_s", "{:.1f}"),
    ]
    head = "| | " + " | ".join(str(r["ranks"]) for r in results) + " |"
    out = [head, "|---" * (len(results) + 1) + "|"]
    for label, key, fmt in rows:
        cells = [fmt.format(r[key]) if key in r else "-" for r in results]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_json(path: str, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({str(r["ranks"]): r for r in results}, f, indent=1)
