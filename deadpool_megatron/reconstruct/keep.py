"""Groups kept across a recovery (gloo; --deadpool-remake-groups turns it off): a group that
no replaced rank belongs to, and that every member left idle and even, is handed to the next
generation as it is, so that only the groups the failure touched are made again.

When a group is safe to keep. A gloo group is its members' TCP pairs: it may outlive the cut
only if none of them was cut, and if every member has issued as many operations on it (its
sequence number, which gloo counts for collectives and point-to-point alike): then every
operation one member began, every other began too, and each completes on the pairs left
whole. An operation some members issued and others never will (the reduction barrier that
an intact replica waits in for a replica that stopped) would pair with the next
generation's first one, so such a group is dropped. Which groups:
- candidates (`keepable`): groups with no replaced rank, either of one rank (no peer:
  kept without asking anyone), within replicas that lost nothing (their threads run the
  iteration's micro-batches to the end and stop before the reduction, without a cut) or
  across replicas (idle in forward and backward; the barrier before the reduction waits
  in a group of its own); their sockets, known from their creation, are spared by the cut
  (the barrier's only until a thread is seen in it);
- a member whose thread would not stop until its spared sockets were cut too, or whose
  thread was past the reduction's start, reports its candidates broken;
- each candidate's verdict is agreed in the control-plane store, per set of ranks (a
  Megatron job has several groups of the same ranks: one report covers them all): the
  first member to report sets a reference, every candidate it names with its sequence
  number (or -1, broken); each member sets "drop" on what differs from its own view, then
  counts itself in; the last one counted sets "keep" on the rest. A member that waits too
  long sets "drop" instead (the first verdict set wins: every member reads the same one).
  Key names carry a tag of the job token (SignedStore.secret_name): no process without it
  can skew the counts. Each member then marks its reports done: a candidate whose members
  are all done without a verdict is one some member does not report on (its view of the
  group differs: it left a generation that never formed, chaos soak seed 21), dropped at
  once instead of at the timeout;
- a kept group is taken out of torch's world before the old generation is forgotten (which
  aborts every group it knows), and handed back, under the name its position in the new
  generation's creation order gives it, when Megatron's initialisation asks for it
  (`creating`); a barrier on it then waits for whatever it still had in flight.

NCCL: every group made again (DeadPoolConfig.keeps_groups): a thread blocked on an NCCL
kernel is freed only by aborting communicators, which the cut does before anything can tell
the idle ones from the others, and an aborted communicator cannot be used again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from deadpool_megatron.control.sockets import fd_names, new_socket_inodes, socket_fd_inodes
from deadpool_megatron.reconstruct.rebind import GroupKey

log = logging.getLogger("deadpool_megatron.reconstruct")
AGREE_TIMEOUT_S = 10.0  # a member that has not reported by then: its groups are dropped
WAIT_SLICE_S = 0.1  # the wait for verdicts looks this often for a newer declaration
# The agreement's long operation (no stall seen inside) outlasts its own timeout, so that it
# ends with the exit's fresh stamp, never by expiring first: a rank that waited out the
# timeout was seen stalled for all of it, and every survivor was replaced (chaos soak 44).
AGREE_BUDGET_S = AGREE_TIMEOUT_S + 5.0
BROKEN = -1
OURS = "DEADPOOL_"  # our own groups (snapshot pairs): made again with their pipeline
BARRIER = "DATA_PARALLEL_REDUCTION_BARRIER"  # keepable like any other group


@dataclass
class Detached:
    """A kept group out of torch's world, waiting for the next generation to ask for it."""

    pg: Any
    backend: str
    config: str
    ranks: dict[int, int]


def open_sockets() -> dict[int, int]:
    """This process's sockets now: inode -> fd."""
    return {inode: fd for fd, inode in socket_fd_inodes()}


def connected(inodes: frozenset[int], table: dict[int, int]) -> int:
    """How many of these sockets (`table`: open_sockets()) are TCP connections still open
    both ways."""
    count = 0
    for inode in inodes:
        fd = table.get(inode)
        if fd is None:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            try:
                sock.getpeername()
            except OSError:
                continue
            try:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    continue  # the peer shut it down
            except BlockingIOError:
                pass
            except OSError:
                continue
            count += 1
    return count


def make_barrier_group() -> None:
    """The reduction barrier's own group (this rank's data-parallel peers, made by them
    alone): a failure that finds the replicas that lost nothing waiting in the barrier (for
    one that stopped) leaves that group uneven, so it must not be the one the gradients are
    reduced in, which then stays even and is kept. The barrier's group is kept too when no
    one was in it (the failure came before they reached it)."""
    from megatron.core import parallel_state as ps

    ranks = dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))
    if len(ranks) > 1:
        dist.new_group(sorted(ranks), use_local_synchronization=True, group_desc=BARRIER)


def find_barrier_group() -> Any:
    """This generation's reduction-barrier group (make_barrier_group), or None."""
    return next((pg for pg in c10d._world.pg_map if pg.group_desc == BARRIER), None)


def barrier_group() -> Any:
    """This generation's reduction-barrier group, which must exist."""
    found = find_barrier_group()
    if found is None:  # never the default group in its place: that would wait for all
        raise RuntimeError("no reduction-barrier group in this generation")
    return found


def keepable(key: GroupKey, replaced: set[int], replica_of: Callable[[int], int],
             lost: set[int]) -> bool:
    """A group that may outlive the recovery: none of its ranks replaced, not ours, and
    either of one rank (no peer to wait on or to be uneven with), across replicas (idle
    in forward and backward: the data-parallel ones, the reduction barrier being
    elsewhere) or within replicas that lost nothing (`lost`: the replicas that did).
    Every member of a group answers alike."""
    desc, ranks = key[0], key[1]
    if desc.startswith(OURS) or replaced & set(ranks):
        return False
    if len(ranks) == 1:
        return True
    replicas = {replica_of(r) for r in ranks}
    return len(replicas) > 1 or not replicas & lost


def candidates(registry: dict[GroupKey, Any], sockets: dict[int, frozenset[int]],
               replaced: set[int], replica_of: Callable[[int], int]
               ) -> dict[GroupKey, tuple[Any, bool]]:
    """This rank's keepable groups, each with whether this rank can keep it: its
    connections, one per other member, all known and open."""
    lost = {replica_of(r) for r in replaced}
    found, table = {}, open_sockets()
    for key, pg in registry.items():
        if not keepable(key, replaced, replica_of, lost):
            continue
        ranks = key[1]
        inodes = sockets.get(id(pg))
        found[key] = (pg, inodes is not None and connected(inodes, table) == len(ranks) - 1)
    return found


def spared(mine: dict[GroupKey, tuple[Any, bool]],
           sockets: dict[int, frozenset[int]]) -> frozenset[int]:
    """The sockets the cut leaves open: those of the groups this rank may keep."""
    return frozenset().union(*(sockets[id(pg)] for pg, ok in mine.values() if ok))


def agree(store: Any, generation: int, rank: int, mine: dict[GroupKey, tuple[Any, bool]],
          sockets: dict[int, frozenset[int]], broken: bool,
          superseded: Callable[[], bool] = lambda: False,
          timeout_s: float = AGREE_TIMEOUT_S) -> set[GroupKey]:
    """The candidates every member keeps (see the module's docstring); `store` is the
    worker's SignedStore; `broken`: this rank's spared sockets were cut after all. Every
    member of a candidate reaches the same verdict. Called by every member that may keep
    groups, with candidates or none (its reports are then done at once). The wait for the
    others' reports ends at `timeout_s`, as soon as `superseded()` (a newer generation
    was declared: some member may never report for this one), or, for each candidate,
    once all its members are done."""
    verdict_of: dict[GroupKey, str | None] = {}
    pending: dict[GroupKey, str] = {}
    sets: dict[tuple[int, ...], dict[GroupKey, int]] = {}
    table = open_sockets()
    for key, (pg, ok) in mine.items():
        size = len(key[1])
        whole = ok and not broken and connected(sockets[id(pg)], table) == size - 1
        if size == 1:  # no one to agree with
            verdict_of[key] = "keep" if whole else "drop"
        else:
            seq = int(pg._get_sequence_number_for_group()) if whole else BROKEN
            sets.setdefault(tuple(key[1]), {})[key] = seq
    for ranks, seqs in sets.items():
        settled, waiting = _report(store, generation, ranks, seqs)
        verdict_of.update(settled)
        pending.update(waiting)
    store.set(_done(store, generation, rank), "1")
    deadline = time.monotonic() + timeout_s
    while pending and not superseded() and time.monotonic() < deadline:
        try:
            store.wait(list(pending.values()), timedelta(seconds=WAIT_SLICE_S))
        except (dist.DistStoreError, RuntimeError):
            pass  # not all set yet
        else:
            verdict_of.update(zip(pending, _read(store, list(pending.values()))))
            pending.clear()
            break
        for key, verdict_key in list(pending.items()):
            if not store.check([verdict_key]) and \
                    store.check([_done(store, generation, r) for r in key[1]]):
                verdict_of[key] = store.set_once(verdict_key, "drop")  # some member
                del pending[key]  # does not name it
    for key, verdict_key in pending.items():  # still unset: dropped (the first set wins)
        verdict_of[key] = store.set_once(verdict_key, "drop")
    # A verdict that fails verification (not the job's) was never set by a member: dropped.
    return {key for key, verdict in verdict_of.items() if verdict == "keep"}


def _report(store: Any, generation: int, ranks: tuple[int, ...], seqs: dict[GroupKey, int]
            ) -> tuple[dict[GroupKey, str | None], dict[GroupKey, str]]:
    """This member's report on its candidates among `ranks` (`seqs`: each one's sequence
    number, or BROKEN): the verdicts it settles, and the verdict keys it must wait for.
    The first member to report sets the set's reference (every candidate it names, with
    its sequence number); each member drops what differs from its own view (a sequence
    number, a candidate one names and the other does not, BROKEN), then counts itself in;
    the last member counted sets "keep" on the rest. Its drops precede its count, so the
    last member's "keep" can only fall on candidates no member found uneven."""
    base = _set_name(generation, ranks)
    view = {(key[0], key[2]): seq for key, seq in seqs.items()}
    reference = store.set_once(store.secret_name(base + "/first"),
                               json.dumps(sorted([d, o, s] for (d, o), s in view.items())))
    try:
        first = {(str(d), int(o)): int(s) for d, o, s in json.loads(reference or "[]")}
    except (ValueError, TypeError):  # not a member's reference: nothing matches it
        first = {}
    uneven = {e for e, seq in view.items() if seq == BROKEN or first.get(e) != seq}
    uneven |= set(first) - set(view)
    settled: dict[GroupKey, str | None] = {}
    for desc, ordinal in sorted(uneven):
        key = (desc, ranks, ordinal)
        verdict = store.set_once(_verdict(store, generation, key), "drop")
        if key in seqs:
            settled[key] = verdict
    if store.add(store.secret_name(base + "/reports"), 1) == len(ranks):
        for key in seqs:
            settled[key] = store.set_once(_verdict(store, generation, key), "keep")
    return settled, {key: _verdict(store, generation, key) for key in seqs
                     if key not in settled}


def _read(store: Any, keys: list[str]) -> list[str | None]:
    """Verdicts known to be set: one request for one, two (a multi_get) for more."""
    values = [store.read_set(keys[0])] if len(keys) == 1 else store.read_many(keys)
    return [None if value is None else value.decode() for value in values]


def _set_name(generation: int, ranks: tuple[int, ...]) -> str:
    digest = hashlib.sha1(repr(ranks).encode()).hexdigest()[:16]
    return f"dp/gen{generation}/keep/set/{digest}"


def _verdict(store: Any, generation: int, key: GroupKey) -> str:
    digest = hashlib.sha1(repr(key).encode()).hexdigest()[:16]
    return store.secret_name(f"dp/gen{generation}/keep/{digest}/verdict")


def _done(store: Any, generation: int, rank: int) -> str:
    """The key that says `rank` has reported on all its candidates for `generation`."""
    return store.secret_name(f"dp/gen{generation}/keep/done/{rank}")


def detach(pg: Any) -> Detached:
    """Take `pg` out of torch's world, so that forgetting the old generation leaves it be."""
    world = c10d._world
    held = Detached(pg, world.pg_map[pg][0], world.pg_backend_config[pg],
                    dict(world.pg_group_ranks[pg]))
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks,
                  world.pg_backend_config, world.pg_to_tag, world.pg_coalesce_state):
        table.pop(pg, None)
    for tagged in world.tags_to_pg.values():
        if pg in tagged:
            tagged.remove(pg)
    return held


@contextlib.contextmanager
def creating(rank: int, handed: dict[GroupKey, Detached],
             sockets: dict[int, frozenset[int]]) -> Iterator[list[Any]]:
    """While a generation's groups are made: a group in `handed` is given back instead of
    made (its name the one its position gives it, as every other rank names that position);
    every group made here with this rank is recorded with the sockets that appeared while
    it was made. Yields the groups handed back."""
    real = c10d._new_group_with_tag
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    given: list[Any] = []

    def new_group_with_tag(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        members = sorted(ranks) if ranks is not None else list(range(dist.get_world_size()))
        if rank not in members:
            return real(ranks, *args, **kwargs)
        desc = kwargs.get("group_desc") or "undefined"
        name = (desc, tuple(members))
        ordinal = seen.get(name, 0)
        seen[name] = ordinal + 1
        held = handed.pop((*name, ordinal), None)
        if held is not None:
            return _hand_back(held, members, given,
                              bool(kwargs.get("use_local_synchronization")))
        before = fd_names()
        pg = real(ranks, *args, **kwargs)
        # A socket missed (its fd number reused meanwhile) only leaves the group unkept:
        # it must have one connection per other member (`candidates`).
        sockets[id(pg)] = new_socket_inodes(before)
        return pg

    c10d._new_group_with_tag = new_group_with_tag
    try:
        yield given
        for pg in given:
            dist.barrier(group=pg)  # whatever it still had in flight is done
    finally:
        c10d._new_group_with_tag = real
        alive = {id(pg) for pg in c10d._world.pg_map}
        for gone in set(sockets) - alive:
            del sockets[gone]


def _hand_back(held: Detached, members: list[int], given: list[Any], hashed: bool) -> Any:
    name = c10d._process_group_name(members, use_hashed_name=hashed)
    default_store = c10d._world.pg_map[c10d._get_default_group()][1]
    held.pg._set_group_name(name)
    c10d._register_pg_in_world(held.pg, backend_name=held.backend,
                               store=dist.PrefixStore(f"{name}/", default_store),
                               group_name=name, backend_config=held.config,
                               rank_mapping=held.ranks)
    given.append(held.pg)
    return held.pg
