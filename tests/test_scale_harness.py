"""The scale harness (deadpool_megatron/scale/) speaks what the real workers and launchers
speak: its wire client sends torch's client's bytes; a simulated member makes a real
ControlClient's requests (same queries, same keys) through a start and a recovery, a
simulated spare a real spare's; a simulated host a real LocalWorkers'. And the cost model
of the groups counts what gloo really asks of the store."""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from deadpool_megatron.scale.wire import Connection, Store, Tally, decode_requests
from deadpool_megatron.testing.jobs import REPO


class Recorder:
    """A TCP proxy in front of a store server that keeps what each client sent."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.sent: list[bytearray] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            record = bytearray()
            self.sent.append(record)
            threading.Thread(target=self._pump, args=(client, server, record),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None),
                             daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            if record is not None:
                record += data
            try:
                dst.sendall(data)
            except OSError:
                return


def _server():
    from deadpool_megatron.control.sockets import store_server

    return store_server("127.0.0.1", 0, timeout_s=30)


def test_the_wire_client_sends_torchs_bytes() -> None:
    """The same calls through torch's client and the harness's: the same bytes."""
    server = _server()
    server.set("ep0//k", "v")
    theirs, ours = Recorder(server.port), Recorder(server.port)
    client = dist.TCPStore("127.0.0.1", theirs.port, is_master=False,
                           timeout=timedelta(seconds=10))
    prefixed = dist.PrefixStore("ep0/", client)
    prefixed.set("a", b"x" * 300)
    prefixed.get("k")
    prefixed.add("n", 3)
    prefixed.check(["k", "a"])
    prefixed.wait(["k"])
    prefixed.multi_get(["k", "a"])
    prefixed.append("log", b"w1,")

    async def same_calls() -> None:
        conn = await Connection.open("127.0.0.1", ours.port)
        store = Store(conn, "ep0/")
        store.set("a", b"x" * 300, None)
        await store.get("k", None)
        await store.add("n", 3, None)
        await store.check(["k", "a"], None)
        await conn._request(b"\x06" + (1).to_bytes(8, "little") + (7).to_bytes(8, "little")
                            + b"/ep0//k", "byte", None)
        await store.multi_get(["k", "a"], None)
        store.append("log", b"w1,", None)
        await store.get("k", None)  # everything before it has been sent
        conn.close()

    asyncio.run(same_calls())
    time.sleep(0.2)
    theirs_, ours_ = bytes(theirs.sent[0]), bytes(ours.sent[0])
    # VALIDATE with the magic number, PING (with its own nonce), then every request.
    assert theirs_[:6] == ours_[:6] and theirs_[10:] == ours_[10:len(theirs_)]
    assert decode_requests(bytes(theirs.sent[0]))[:3] == [("VALIDATE", ""), ("PING", ""),
                                                          ("SET", "/ep0//a")]


# -- a real worker's requests, and a simulated one's ------------------------------------------
REAL = r"""
import json, sys, threading, time
from deadpool_megatron.control import keys
from deadpool_megatron.control.client import ControlClient
from deadpool_megatron.launch.coordinator import Coordinator
from deadpool_megatron.launch.config import LaunchConfig
from deadpool_megatron.control.auth import SignedStore
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.control.sockets import store_server
sys.path.insert(0, "{tests}")
from test_scale_harness import Recorder, decode_requests

TOKEN = "t" * 32
server = store_server("127.0.0.1", 0, timeout_s=30)
host0 = SignedStore(server, TOKEN, keys.epoch_prefix(0))
coordinator = Coordinator(LaunchConfig(nproc_per_node=1, nnodes=3, control_only=True,
                                       failure_window=0.0), host0, 1, False,
                          EventLog(None, -1))
coordinator.open()
host0.set(keys.node_spares(1), json.dumps(["s1.0"]))
host0.set(keys.node_spares(2), json.dumps([]))
recorders = {"w1": Recorder(server.port), "s1.0": Recorder(server.port)}
def client(worker):
    port = recorders[worker].port if worker in recorders else server.port
    return ControlClient("127.0.0.1", port, worker, timeout_s=30, token=TOKEN)

def join(ctl, generation, rank):
    store, _ = ctl.take_connection()
    assert ctl.rendezvous(generation, 2, rank, ctl.signed(store))
    ctl.prepare_connection()

w0, w1 = client("w0"), client("w1")
t = threading.Thread(target=join, args=(w0, 0, 0)); t.start()
join(w1, 0, 1); t.join()
spare = client("s1.0")
spare_done = []
def spare_path():
    generation, rank = spare.wait_for_assignment()
    join(spare, generation, rank)
    spare.replaced(generation)
    spare_done.append(generation)
s = threading.Thread(target=spare_path); s.start()
time.sleep(0.3)
host0.set(keys.exit_report("w0"), "-9"); host0.append(keys.EXITED, "w0,"); host0.add(keys.EXITS, 1)
coordinator.tick(time.monotonic()); coordinator.tick(time.monotonic())
# w1's recovery, as reconstruct/recovery.py calls its client: leave, flush check, enter
g = w1.wait_generation_after(0)
w1.flush_of(g); assert w1.members(g).get(1) == "w1"; w1.replaced(g); w1.flush_of(g)
join(w1, g, 1); w1.replaced(g)
s.join(30); assert spare_done == [1], spare_done
time.sleep(0.3)
traces = {w: [r for sent in rec.sent for r in decode_requests(bytes(sent))]
          for w, rec in recorders.items()}
print(json.dumps(traces))
import os; os._exit(0)
"""


def _normal(trace: list) -> collections.Counter:
    """Requests whose number depends on timing are left out: a wait's timeout (its cancel
    and the end-of-job check that follows, then the wait again), a waiting spare's check of
    the job's end, and the ready key the last to join sets."""
    kept = [tuple(r) for r in trace if r[0] != "CANCEL_WAIT" and not r[1].endswith("shutdown")
            and not (r[0] == "SET" and "/ready/" in r[1])]
    counts = collections.Counter(kept)
    for request in counts:
        if request[0] == "WAIT" and "/ready/" in request[1]:
            counts[request] = 1
    return counts


def _simulated() -> tuple[list, list]:
    """The same scenario with simulated members (w0, w1) and spare, every request of w1
    and the spare traced."""
    from deadpool_megatron.control import keys
    from deadpool_megatron.control.auth import SignedStore
    from deadpool_megatron.launch.config import LaunchConfig
    from deadpool_megatron.launch.coordinator import Coordinator
    from deadpool_megatron.metrics.events import EventLog
    from deadpool_megatron.scale.member import SimMember
    from deadpool_megatron.scale.signed import SignedView

    token = "t" * 32
    server = _server()
    host0 = SignedStore(server, token, keys.epoch_prefix(0))
    coordinator = Coordinator(LaunchConfig(nproc_per_node=1, nnodes=3, control_only=True,
                                           failure_window=0.0), host0, 1, False,
                              EventLog(None, -1))
    coordinator.open()
    host0.set(keys.node_spares(1), json.dumps(["s1.0"]))
    host0.set(keys.node_spares(2), json.dumps([]))

    async def scenario() -> tuple[list, list]:
        pool = await Connection.open("127.0.0.1", server.port)
        view = SignedView(Store(pool), token, keys.epoch_prefix(0))
        members = []
        for worker, rank in (("w0", 0), ("w1", 1), ("s1.0", None)):
            tally = Tally(trace=[] if worker != "w0" else None)
            conn = await Connection.open("127.0.0.1", server.port, tally)
            member = SimMember(worker, rank, 2, view, view.waiter(conn), tally=tally)
            members.append(member)
        tasks = [asyncio.ensure_future(m.start()) for m in members]
        while any(len(m.joined) < 1 for m in members[:2]):
            await asyncio.sleep(0.01)
        w0 = members[0]
        w0.alive = False
        tasks[0].cancel()
        w0.waiter.conn.close()
        host0.set(keys.exit_report("w0"), "-9")
        host0.append(keys.EXITED, "w0,")
        host0.add(keys.EXITS, 1)
        await asyncio.sleep(0.05)
        coordinator.tick(time.monotonic())
        coordinator.tick(time.monotonic())
        deadline = time.monotonic() + 30
        while (len(members[1].joined) < 2 or not members[2].joined or
               not members[2].joined[-1].settled_at) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        for task in tasks:
            task.cancel()
        return members[1].tally.trace, members[2].tally.trace

    return asyncio.run(scenario())


def test_a_simulated_member_and_spare_make_a_real_workers_requests(tmp_path) -> None:
    """Generation 0, then rank 0 dies and the spare takes it: w1's requests (a survivor)
    and the spare's, from a real ControlClient called as the recovery calls it, and from
    the harness's: the same queries on the same keys, as many of each."""
    script = REAL.replace("{tests}", str(REPO / "tests"))
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    real = json.loads(run.stdout.strip().splitlines()[-1])
    sim_w1, sim_spare = _simulated()
    assert _normal(sim_w1) == _normal(real["w1"])
    assert _normal(sim_spare) == _normal(real["s1.0"])


def test_a_simulated_host_makes_a_real_launchers_requests(tmp_path) -> None:
    """One poll with a worker just exited, then one a little later: LocalWorkers' requests
    (a recording proxy) and the simulated host's (traced), in order."""
    from deadpool_megatron.control import keys
    from deadpool_megatron.control.auth import SignedStore
    from deadpool_megatron.launch.config import LaunchConfig
    from deadpool_megatron.launch.workers import REPORT_S, LocalWorkers
    from deadpool_megatron.scale.host import SimHost
    from deadpool_megatron.scale.signed import SignedView

    class Exited:
        pid, returncode = 1, -9

        def poll(self) -> int:
            return self.returncode

    server = _server()
    recorder = Recorder(server.port)
    client = dist.TCPStore("127.0.0.1", recorder.port, is_master=False,
                           timeout=timedelta(seconds=10))
    store = SignedStore(client, "t" * 32, keys.epoch_prefix(0))
    workers = LocalWorkers(LaunchConfig(nproc_per_node=2, nnodes=2, node_rank=1), [], store,
                           server.port, 2, 0, str(tmp_path))
    workers.procs = {"w2": Exited()}
    try:
        workers.poll()
        time.sleep(REPORT_S)
        workers.poll()
        client.get(keys.epoch_prefix(0) + "/" + keys.EXITS)  # all sent before it answers
    finally:
        workers.procs = {}
        workers.stop(0)  # its progress directory
    real = decode_requests(bytes(recorder.sent[0]))[2:-2]

    async def simulated() -> list:
        conn = await Connection.open("127.0.0.1", server.port)
        host = SimHost.make(1, range(2, 4), 0, SignedView(Store(conn), "t" * 32, "ep0/"))
        host.workers = ["w2"]
        host.tally.trace = []
        host.exit("w2", -9)
        now = time.monotonic()
        await host.poll(now)
        await host.poll(now + REPORT_S)
        return host.tally.trace

    assert asyncio.run(simulated()) == [tuple(r) for r in real]


def test_gloo_asks_the_store_what_the_model_counts() -> None:
    """A gloo group's creation, counted with a counting store: 1 + 3 x size requests per
    member (the model of scale/groups.py), for sizes 2 and 3."""
    from torch.distributed import ProcessGroupGloo

    from deadpool_megatron.scale.counting import CountingStore
    from deadpool_megatron.scale.groups import gloo_requests

    server = _server()
    for size in (2, 3):
        stores = [CountingStore(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                              timeout=timedelta(seconds=20)))
                  for _ in range(size)]
        made = []

        def make(rank: int) -> None:
            made.append(ProcessGroupGloo(dist.PrefixStore(f"g{size}/", stores[rank]), rank,
                                         size, timedelta(seconds=20)))

        threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(made) == size
        assert [sum(s.requests.values()) for s in stores] == [gloo_requests(size)] * size


class _EvenGroup:
    """A candidate group whose sequence number is `seq` (keep.agree asks nothing else)."""

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def _get_sequence_number_for_group(self) -> int:
        return self.seq


def test_the_groups_agreement_asks_the_store_what_the_model_counts(monkeypatch) -> None:
    """keep.agree run by three members over two sets of ranks, {1, 3, 5} (two groups, as
    Megatron makes several groups of the same ranks) and {1, 3} (one), every group even,
    then by a member with none, over one counting store: every group kept, and the
    requests the model counts (scale/groups.py). The members report one after the other,
    so that who is last in each set is known: the model charges every member a wait and a
    read, which the last member of all its sets (rank 5) does not make; the waits are
    timing (a wait that outlasts its slice is followed by checks, more requests)."""
    from deadpool_megatron.control.auth import SignedStore
    from deadpool_megatron.reconstruct import keep
    from deadpool_megatron.scale.counting import CountingStore
    from deadpool_megatron.scale.groups import agreement_requests

    monkeypatch.setattr(keep, "connected", lambda inodes, table: len(inodes))  # all open
    counting = CountingStore(dist.HashStore())
    store = SignedStore(counting, "token", "t/")
    dp, dp_cp, tp = (("DATA_PARALLEL_GROUP", (1, 3, 5), 0),
                     ("DATA_PARALLEL_GROUP_WITH_CP", (1, 3, 5), 0),
                     ("TENSOR_MODEL_PARALLEL_GROUP", (1, 3), 0))
    named = {1: [dp, dp_cp, tp], 3: [dp, dp_cp, tp], 5: [dp, dp_cp]}
    pgs = {dp: _EvenGroup(7), dp_cp: _EvenGroup(12), tp: _EvenGroup(40)}
    kept: dict[int, set] = {}
    threads = []
    for rank, keys in named.items():
        mine = {key: (pgs[key], True) for key in keys}
        sockets = {id(pgs[key]): frozenset(range(len(key[1]) - 1)) for key in keys}
        threads.append(threading.Thread(target=lambda r=rank, m=mine, s=sockets: kept.update(
            {r: keep.agree(store, 2, r, m, s, broken=False, timeout_s=60.0)}), daemon=True))
        threads[-1].start()
        deadline = time.monotonic() + 60.0
        while not store.check([keep._done(store, 2, rank)]) and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(60.0)
    assert not any(t.is_alive() for t in threads)
    assert kept == {1: {dp, dp_cp, tp}, 3: {dp, dp_cp, tp}, 5: {dp, dp_cp}}
    assert keep.agree(store, 2, 7, {}, {}, broken=False) == set()  # names none
    calls, requests = counting.calls, sum(counting.requests.values())
    exact = requests - calls["wait"] - calls["check"]
    model = sum(agreement_requests([key[1] for key in keys]) for keys in named.values())
    model += agreement_requests([])
    assert exact == model - 3 - 2, (calls, model)  # three waits; rank 5's read (a multi_get)
    assert calls["multi_get"] == 2, calls  # ranks 1 and 3 read their verdicts, in one each
    assert agreement_requests([(1, 3, 5)]) == pytest.approx(2 + 1 / 3 + 1 + 1 + 1)
    assert agreement_requests([(2,), (4,)]) == 1  # no peer: only the done mark


def test_kept_groups_leave_a_members_share_flat_and_local() -> None:
    """Issue 24, item 3, in the harness's accounting: Megatron's own groups at TP 8 x PP 4
    (every rank names them all), the keep policy applied. A member's share of the groups'
    store requests (NCCL) halves and stays flat from 1,024 to 16,384 ranks; the ranks that
    make a group of 2 to N-1 ranks again are exactly the replaced rank's replica and its
    pipeline stage's tensor-and-data-parallel group (found here from the coordinates)."""
    from deadpool_megatron.scale.groups import (kept_recovery_groups, megatron_groups,
                                                recovery_groups)
    from deadpool_megatron.topology import ParallelSizes, coord_of

    share = {}
    for world in (1024, 16384):
        rank = world // 2 + 3
        groups = megatron_groups(world, 8, 4, rank=rank)
        before = recovery_groups(world, groups.mine, 2)
        kept = kept_recovery_groups(world, 8, 4, groups.every, rank, 2)
        assert kept.nccl < 0.6 * before.nccl, (kept, before)
        assert kept.groups < len(groups.mine) / 2, (kept, len(groups.mine))
        sizes = ParallelSizes.from_world(world, 8, 4)
        mine = coord_of(rank, sizes)
        touched = {r for r in range(world) if coord_of(r, sizes).dp == mine.dp
                   or coord_of(r, sizes).pp == mine.pp}
        assert kept.builders == len(touched), (kept.builders, len(touched))
        # The survivors' agreement: a few requests per set of ranks, none world-sized, and
        # with it a kept recovery still asks the store less than making every group again.
        assert 1 < kept.agreement < 8 * len(groups.mine), kept
        assert kept.nccl + kept.agreement < before.nccl, (kept, before)
        share[world] = kept.nccl + kept.agreement
    assert share[16384] <= 1.5 * share[1024], share


def test_a_host_report_carries_whole_views_of_suspects_only() -> None:
    """Every live worker's generation and iteration; the whole view only of a worker
    stalled half its timeout or more, stopped, or whose monitor is silent."""
    from deadpool_megatron.launch.workers import host_report

    def view(st: float = 0.01, os_state: str = "S", mon: float = 0.02,
             long_: bool = False) -> dict:
        return {"g": 2, "c": 10, "it": 7, "ph": "forward", "st": st, "mon": mon, "wh": 1,
                "long": long_, "to": 20.0, "itn": 1.0, "os": os_state,
                "su": 300.0}

    views = {"w0": view(), "w1": view(st=11.0), "w2": view(os_state="T"),
             "w3": view(mon=5.0), "w4": view(st=9.0), "w5": view(st=30.0, long_=True),
             "w6": view(os_state="T", long_=True)}  # stopped inside a durable save
    report = host_report(4, views)
    assert report["seq"] == 4
    assert sorted(report["workers"]) == ["w1", "w2", "w3", "w6"]
    # ... with the oldest monitor among the host's others (w3's: hang.WorkerView)
    assert report["workers"]["w1"] == {**views["w1"], "mo": 5.0}
    assert report["workers"]["w3"]["mo"] == 0.02
    assert report["it"] == {w: [2, 7] for w in views}
    assert report["long"] == ["w5", "w6"]
