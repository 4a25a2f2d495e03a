"""Groups kept across a recovery (reconstruct/keep.py): a group no failure touched outlives
the recovery as the very same object, only when every member left it idle and even; the run
ends with the failure-free fingerprint and a clean group audit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

import pytest

from conftest import GPT_3D_ARGS
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.testing.jobs import JobResult, run_launched
from deadpool_megatron.topology import ParallelSizes, coord_of
from recoveries import check_recoveries

REPO = Path(__file__).resolve().parents[1]

# Four gloo ranks: groups a={0,1}, b={2,3}, c={0,2}, d={1,3}, w=all. Generation 0 runs one
# collective on each (rank 1 one more on `a` when asked: uneven); the agreement of a's two
# members in the store, then a new world in which a is handed back where agreed.
_SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
from torch.distributed import distributed_c10d as c10d
from deadpool_megatron.control.auth import SignedStore
from deadpool_megatron.reconstruct import keep
rank, port, uneven = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
sockets, handed = {}, {}
def generation(g):
    dist.init_process_group("gloo", store=dist.PrefixStore(f"g{g}/", raw), rank=rank,
                            world_size=4)
    with keep.creating(rank, handed, sockets):
        return {d: dist.new_group(r, group_desc=d) for d, r in
                [("a", [0, 1]), ("b", [2, 3]), ("c", [0, 2]), ("d", [1, 3]), ("w", [0, 1, 2, 3])]}
old = generation(0)
mine = {d: pg for d, pg in old.items() if pg != dist.GroupMember.NON_GROUP_MEMBER}
for pg in mine.values():
    dist.all_reduce(torch.ones(1), group=pg)
if uneven and rank in (0, 1):  # an operation rank 0 issues and rank 1 never does
    work = dist.all_reduce(torch.ones(1), group=mine["a"], async_op=True) if rank == 0 else None
kept = set()
if rank in (0, 1):
    key = ("a", (0, 1), 0)
    store = SignedStore(raw, "token", "t/")
    kept = keep.agree(store, 1, rank, {key: (mine["a"], True)}, sockets, broken=False,
                      timeout_s=20)
    if kept:
        handed[key] = keep.detach(mine["a"])
if uneven and rank == 1:  # what rank 0 waits for, so that its process can end
    dist.all_reduce(torch.ones(1), group=mine["a"])
c10d._abort_process_group(c10d._get_default_group())
new = generation(1)
if rank in (0, 1):
    print(f"rank {rank} kept={bool(kept)} same={new['a'] is old['a']}", flush=True)
t = torch.full((1,), float(rank + 1))
for pg in (new["a"], new["w"]) if rank in (0, 1) else (new["w"],):
    dist.all_reduce(t, group=pg)
print(f"rank {rank} sum={t.item()}", flush=True)
dist.destroy_process_group()
# Not what this tests: the teardown of gloo's threads in groups aborted above, which a
# worker leaves to its release thread (recovery.py); at interpreter exit their destructors
# may run without it (std::terminate, seen once in six runs).
os._exit(0)
'''


def _four_ranks(tmp_path: Path, uneven: bool) -> list[str]:
    script = tmp_path / "keep.py"
    script.write_text(_SCRIPT)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))  # an OS-chosen port: no race
    port = server.port
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port),
                               "1" if uneven else "0"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(4)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    return outs


@pytest.mark.multiproc
def test_an_even_group_is_handed_back_as_the_same_object(tmp_path: Path) -> None:
    outs = _four_ranks(tmp_path, uneven=False)
    assert "rank 0 kept=True same=True" in outs[0] and "rank 1 kept=True same=True" in outs[1]
    # 1 + 2 = 3 on a for ranks 0 and 1; then 3 + 3 + 3 + 4 = 13 on w, everywhere
    assert all("sum=13.0" in out for out in outs), outs


@pytest.mark.multiproc
def test_an_uneven_group_is_dropped_by_both_members(tmp_path: Path) -> None:
    outs = _four_ranks(tmp_path, uneven=True)
    assert "rank 0 kept=False same=False" in outs[0], outs[0]
    assert "rank 1 kept=False same=False" in outs[1], outs[1]
    assert all("sum=13.0" in out for out in outs), outs  # the new a made, and working


def test_groups_are_kept_with_gloo_unless_told_otherwise() -> None:
    assert DeadPoolConfig(deadpool=True).keeps_groups("gloo")
    assert not DeadPoolConfig(deadpool=True).keeps_groups("nccl")  # every group made again
    assert not DeadPoolConfig(deadpool=True, deadpool_remake_groups=True).keeps_groups("gloo")


def _events(prefix: Path) -> list[dict]:
    out = []
    for path in prefix.parent.glob(prefix.name + ".rank*"):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(out, key=lambda e: e["t"])


@pytest.mark.multiproc
def test_intact_replica_keeps_its_groups_bit_exact(tmp_path: Path,
                                                   failure_free_8: JobResult) -> None:
    events = tmp_path / "events"
    args = [*GPT_3D_ARGS, "--train-iters", "8", "--deadpool", "--deadpool-events",
            str(events), "--deadpool-audit-groups",
            "--deadpool-inject", "kill rank=5 iter=4 phase=backward"]
    launch = ["--nproc-per-node", "8", "--spares", "1", "--logical-nodes", "2"]
    run = run_launched(launch, args, tmp_path, timeout_s=400,
                       env={"DEADPOOL_CONTROL_TIMEOUT_S": "90"})
    ev = _events(events)
    recovered = check_recoveries(run, ev, failure_free_8.fingerprint, 1)
    sizes = ParallelSizes.from_world(8, 2, 2)
    lost = coord_of(5, sizes).dp
    kept = {e["rank"]: e["kept_groups"] for e in ev if e["event"] == "abort"}
    assert sorted(kept) == [0, 1, 2, 3, 4, 6, 7], kept  # every survivor left, the spare not
    for e in recovered:
        assert e["groups_kept"] == len(kept.get(e["rank"], [])), e
    for rank, groups in kept.items():
        descs = {desc for desc, _ in groups}
        assert all(5 not in ranks for _, ranks in groups), (rank, groups)
        assert not any(desc.startswith("DEADPOOL_") for desc in descs)  # ours: made again
        if rank != 7:  # its data-parallel peer is the replaced rank
            assert "DATA_PARALLEL_GROUP_WITH_CP" in descs, (rank, groups)
        if coord_of(rank, sizes).dp != lost:  # within a replica that lost nothing
            assert "TENSOR_MODEL_PARALLEL_GROUP" in descs, (rank, groups)
        else:  # the lost replica's own groups were cut: its ranks keep only wider ones
            assert all(len({coord_of(r, sizes).dp for r in ranks}) > 1
                       for _, ranks in groups if len(ranks) > 1), (rank, groups)
        # Megatron's one-rank groups (context, expert, ...; in the rehearsal one gloo group,
        # shared by all): kept by every survivor
        assert any(len(ranks) == 1 for _, ranks in groups), (rank, groups)


def test_at_16384_ranks_only_the_replaced_ranks_replica_and_dp_group_make_groups() -> None:
    """The policy alone (keep.keepable, no processes), TP 8 x PP 16 x DP 128: of the
    tensor-, pipeline-, data- and model-parallel groups, those made again after rank 1,000
    is replaced are its own and its replica's; the ranks that make any (our barrier groups
    aside) are its replica's 128 and its data-parallel group's 128 (one in both): 255 of
    16,384."""
    from deadpool_megatron.reconstruct.keep import keepable
    from deadpool_megatron.topology import group_members

    sizes = ParallelSizes.from_world(16384, 8, 16)
    replaced = {1000}
    replica_of = lambda r: coord_of(r, sizes).dp  # noqa: E731

    def groups() -> set[tuple[str, tuple[int, ...], int]]:
        found = set()
        for first in range(sizes.world_size):
            c = coord_of(first, sizes)
            if c.tp == 0:
                found.add(("TENSOR_MODEL_PARALLEL_GROUP",
                           tuple(group_members(first, sizes, "tp")), 0))
            if c.dp == 0:
                found.add(("DATA_PARALLEL_GROUP_WITH_CP",
                           tuple(group_members(first, sizes, "dp")), 0))
            if c.pp == 0:
                found.add(("PIPELINE_MODEL_PARALLEL_GROUP",
                           tuple(group_members(first, sizes, "pp")), 0))
            if c.tp == 0 and c.pp == 0:
                found.add(("MODEL_PARALLEL_GROUP", tuple(sorted(
                    r for p in group_members(first, sizes, "pp")
                    for r in group_members(p, sizes, "tp"))), 0))
        return found

    lost = {replica_of(r) for r in replaced}
    made = [key for key in groups() if not keepable(key, replaced, replica_of, lost)]
    builders = {r for key in made for r in key[1]}
    replica = {r for r in range(sizes.world_size) if replica_of(r) == replica_of(1000)}
    assert builders == replica | set(group_members(1000, sizes, "dp"))
    assert len(builders) == 255
    assert not any(keepable(key, replaced, replica_of, lost) for key in made)
    # Ours are never kept, whatever their members.
    assert not keepable(("DEADPOOL_SNAPSHOT_GROUP", (0, 8), 0), replaced, replica_of, lost)


class _Parks:
    """A training thread that parks at its next stop point, at once."""

    def __init__(self) -> None:
        self.parked = False

    def alive(self) -> bool:
        return not self.parked

    def stop_now(self) -> None:
        self.parked = True

    def stop_before_reduction(self) -> None:
        self.parked = True

    def join(self, timeout_s: float) -> bool:
        return True

    def where(self) -> str:
        return "parked"

    ident = None  # no thread: the progress monitor has nothing to look at


class _Board:
    """A progress board that records the budgets of the long operations it is asked for."""

    def __init__(self, budgets: list[float]) -> None:
        self.budgets = budgets

    def long_operation(self, budget_s: float) -> Any:
        import contextlib

        self.budgets.append(budget_s)
        return contextlib.nullcontext()

    def watching(self, thread_id: int) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def set_generation(self, generation: int) -> None:
        pass

    def stamp(self, phase: str, iteration: int) -> None:
        pass


def _inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


@pytest.mark.parametrize("at_barrier", [True, False], ids=["at-the-barrier", "between"])
def test_a_thread_stopped_between_iterations_spares_no_connection(monkeypatch,
                                                                  at_barrier: bool) -> None:
    """Rank 0 of an intact replica (TP 2: ranks 0, 1; rank 3 of the other replica
    replaced) stops. At the reduction barrier it holds its iteration whole, so no peer of
    its replica waits on it: its keepable group's connection stays open and is reported
    whole. Stopped between iterations, a peer already in the next one may wait on it on
    that very connection (CI: a pipeline peer held for the whole grace, the ranks that went
    on taken for hung): it is cut, and the group reported broken."""
    from deadpool_megatron.config import TrainConfig
    from deadpool_megatron.hooks import LoopState
    from deadpool_megatron.reconstruct import keep, leave, member as members
    from deadpool_megatron.rehearsal import prepare_megatron_import
    from deadpool_megatron.replay.ledger import MicrobatchLedger

    prepare_megatron_import()
    with socket.create_server(("127.0.0.1", 0)) as server:
        ctl = types.SimpleNamespace(endpoints=frozenset(), worker="w0",
                                    members=lambda g: {0: "w0", 3: "s0.0"},
                                    replaced=lambda g: [3], flush_of=lambda g: None,
                                    store=None, latest_declared=lambda: g + 1)
        g = 4
        engine = types.SimpleNamespace(abandon=lambda: None, release_waiters=lambda: None,
                                       stop_worker=lambda pipe, t: True)
        ledger = MicrobatchLedger()
        member = members.Member(
            cfg=TrainConfig(distributed_backend="gloo", tensor_model_parallel_size=2),
            ft=DeadPoolConfig(deadpool=True), ctl=ctl, rank=0, world=4,
            events=types.SimpleNamespace(emit=lambda *a, **k: None), engine=engine,
            ledger=ledger, injector=None, generation=g)
        member.sockets_before = frozenset(_inode(s) for s in [server])
        budgets: list[float] = []
        member.progress = _Board(budgets)
        state = LoopState(iteration=3, consumed_samples=0, objects=None)
        member.state = state
        ledger.on_iteration_start(state)  # iteration 4 began ...
        if at_barrier:
            ledger.before_grad_reduction(state)  # ... and every micro-batch is accumulated
        mine = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        try:
            pg, key = object(), ("TENSOR_MODEL_PARALLEL_GROUP", (0, 1), 0)
            member.groups.sockets = {id(pg): frozenset({_inode(mine), _inode(peer)})}
            monkeypatch.setattr(members.Member, "keepable",
                                lambda self, replaced, flushing: {key: (pg, True)})
            reported: list[bool] = []
            monkeypatch.setattr(keep, "agree", lambda store, gen, rank, found, sockets,
                                broken, superseded: reported.append(broken) or set())
            leave.leave(member, _Parks(), g + 1)
            assert reported == [not at_barrier]
            # The agreement's long operation outlasts its timeout: it ends with a fresh
            # stamp, never by expiring first (chaos soak seed 44: every survivor that
            # waited out the timeout was seen stalled for all of it, and replaced).
            assert budgets and min(budgets) > keep.AGREE_TIMEOUT_S + keep.WAIT_SLICE_S
            mine.setblocking(False)
            if at_barrier:
                with pytest.raises(BlockingIOError):
                    mine.recv(1)  # open, nothing to read
            else:
                assert mine.recv(1) == b""  # shut down: a peer blocked on it returns
        finally:
            mine.close()
            peer.close()


def test_a_rank_leaving_a_generation_that_never_formed_reports_every_group_broken() -> None:
    """Chaos soak seed 28: generation 3 was declared while rank 4 formed generation 2
    (after generation 1 broke). Its objects still held generation 1's groups, some kept and
    not yet handed back, their connections being cut by the interruption; it found them
    open, agreed to keep them, and failed taking out of torch's world a group no longer in
    it. Leaving a generation that never formed here, a rank names every keepable group (its
    peers wait for its report) but reports each broken; leaving one that formed, the open
    ones whole."""
    from deadpool_megatron.config import TrainConfig
    from deadpool_megatron.reconstruct.member import Member

    with socket.create_server(("127.0.0.1", 0)) as server:
        mine = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        try:
            member = Member(
                cfg=TrainConfig(distributed_backend="gloo", tensor_model_parallel_size=2),
                ft=DeadPoolConfig(deadpool=True), ctl=None, rank=0, world=4, events=None,
                engine=None, ledger=None, injector=None, generation=2)
            pg, key = object(), ("TENSOR_MODEL_PARALLEL_GROUP", (0, 1), 0)
            member.groups.registry = {key: pg}
            member.groups.sockets = {id(pg): frozenset({_inode(mine)})}  # one a peer
            member.groups.bound = 2
            assert member.keepable({3}, flushing=False) == {key: (pg, True)}
            member.groups.bound = 1  # generation 2's forming was cut
            assert member.keepable({3}, flushing=False) == {key: (pg, False)}
        finally:
            mine.close()
            peer.close()


def test_a_candidate_a_member_does_not_name_is_dropped_once_all_are_done(monkeypatch) -> None:
    """Chaos soak seed 21: a rank leaving a generation that never formed named a group of
    an older generation's view (a rank replaced then, not since, is in it); its peer there
    named no such group. It waited for that peer's report until the agreement's timeout,
    10 s of every recovery, while the others waited in the next rendezvous. Every member
    now marks its reports done (with no candidate too): a candidate whose members are all
    done without a verdict is dropped then."""
    import threading

    from deadpool_megatron.control.auth import SignedStore
    from deadpool_megatron.reconstruct import keep

    monkeypatch.setattr(keep, "connected", lambda inodes, table: len(inodes))
    store = SignedStore(dist.HashStore(), "token", "t/")
    key, pg = ("DATA_PARALLEL_GROUP_WITH_CP", (4, 6), 0), _Group(5)
    stop, kept = threading.Event(), []
    # Rank 4 names the group and can keep it; the deadline is far, the end must not be it.
    waiter = threading.Thread(target=lambda: kept.append(keep.agree(
        store, 2, 4, {key: (pg, True)}, {id(pg): frozenset({1})}, broken=False,
        superseded=stop.is_set, timeout_s=3600.0)), daemon=True)
    waiter.start()
    try:
        waiter.join(1.0)
        assert waiter.is_alive()  # rank 6 has not reported: it waits
        assert keep.agree(store, 2, 6, {}, {}, broken=False) == set()  # names none: done
        waiter.join(60.0)
        assert not waiter.is_alive() and kept == [set()]
    finally:
        stop.set()
        waiter.join(5.0)


class _Group:
    """A candidate group at sequence number `seq` (all keep.agree asks of a group)."""

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def _get_sequence_number_for_group(self) -> int:
        return self.seq


def _agree_all(monkeypatch, views: dict[int, dict[tuple, int]],
               broken: frozenset[int] = frozenset()) -> dict[int, set]:
    """keep.agree run at once by every rank of `views` (rank -> {candidate: its sequence
    number there}), each group's connections all open; what each rank keeps."""
    import threading

    from deadpool_megatron.control.auth import SignedStore
    from deadpool_megatron.reconstruct import keep

    monkeypatch.setattr(keep, "connected", lambda inodes, table: len(inodes))
    store = SignedStore(dist.HashStore(), "token", "t/")
    kept: dict[int, set] = {}

    def member(rank: int) -> None:
        mine, sockets = {}, {}
        for key, seq in views[rank].items():
            pg = _Group(seq)
            mine[key] = (pg, True)
            sockets[id(pg)] = frozenset(range(len(key[1]) - 1))
        kept[rank] = keep.agree(store, 3, rank, mine, sockets, broken=rank in broken,
                                timeout_s=60.0)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in views]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90.0)
    assert not any(t.is_alive() for t in threads)
    return kept


DP, DP_CP, EXPERT_DP = (("DATA_PARALLEL_GROUP", (0, 2, 4), 0),
                        ("DATA_PARALLEL_GROUP_WITH_CP", (0, 2, 4), 0),
                        ("EXPERT_DATA_PARALLEL_GROUP", (0, 2, 4), 0))


def test_one_uneven_group_of_a_set_of_ranks_drops_only_itself(monkeypatch) -> None:
    """The groups of one set of ranks are reported together, each judged alone: rank 4
    issued one operation more on DP_CP (a reduction it began), so DP_CP alone is dropped,
    by all three."""
    even = {DP: 5, DP_CP: 9, EXPERT_DP: 0}
    kept = _agree_all(monkeypatch, {0: even, 2: even, 4: {**even, DP_CP: 10}})
    assert kept == {r: {DP, EXPERT_DP} for r in (0, 2, 4)}


def test_a_member_whose_connections_were_cut_drops_its_whole_set(monkeypatch) -> None:
    even = {DP: 5, DP_CP: 9}
    assert _agree_all(monkeypatch, {0: even, 2: even, 4: even},
                      broken=frozenset({2})) == {0: set(), 2: set(), 4: set()}


def test_a_group_one_member_does_not_name_is_dropped_the_others_kept(monkeypatch) -> None:
    """Views of a set that differ (a rank that left a generation that never formed names an
    older generation's group, chaos soak seed 21): what all name alike is kept, the rest
    dropped by every member that names it, whoever reported first."""
    even = {DP: 5, DP_CP: 9}
    kept = _agree_all(monkeypatch, {0: even, 2: {**even, EXPERT_DP: 3}, 4: even})
    assert kept == {r: {DP, DP_CP} for r in (0, 2, 4)}
