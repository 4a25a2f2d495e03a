"""Process groups per generation: join under a fresh store prefix, cut, leave.

Every generation's default group and Megatron-Core groups live under the store prefix
`dp/gen{g}/pg/`, so nothing of a dead generation (keys, sockets, sequence numbers) can be
confused with the new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Any, Callable, ContextManager, Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.control import keys
from deadpool_megatron.control.client import ControlClient
from deadpool_megatron.control.sockets import Endpoint, endpoint, socket_fd_inodes
from deadpool_megatron.reconstruct.forming import Forming

log = logging.getLogger("deadpool_megatron.reconstruct")


def forget_groups() -> None:
    """Forget every group of this generation without waiting for anything.

    Called once the generation's training thread has stopped (its connections are cut
    first, so nothing blocks on them). `_abort_process_group` on the default group returns
    at once and forgets every group, so the next generation starts clean; with NCCL it also
    aborts the communicators. The group objects stay alive in whatever holds them until the
    rebind replaces them.
    """
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        try:
            c10d._abort_process_group(c10d._get_default_group())
        except Exception:  # noqa: BLE001 - already gone
            pass
    c10d._world.pg_map.clear() if dist.is_initialized() else None


REBUILD_TIMEOUT_S = 60.0  # groups being created wait this long at most for a peer


class GenerationStore:
    """A store connection of its own for one generation's rendezvous and groups (kept from
    generation to generation until a cut: ControlClient.take_connection).

    A rank waits in the store for its peers to join, then, creating each group, for each
    peer's address. If a peer dies meanwhile, the wait would last the whole timeout; a
    newer declaration cuts this connection instead (`cut`), and the wait fails at once."""

    def __init__(self, ctl: ControlClient, generation: int) -> None:
        client, self.fds = ctl.take_connection()
        self.ctl = ctl
        self.control = ctl.signed(client)
        self.store = dist.PrefixStore(keys.epoch_prefix(ctl.epoch) + keys.pg_prefix(generation),
                                      client)

    def cut(self) -> None:
        """Fail whatever waits on this connection (it is then dead: the next generation
        takes another)."""
        import socket

        self.ctl.connection_cut()

        for fd in self.fds:
            try:
                dup = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                dup.close()


def join_generation(ctl: ControlClient, generation: int, rank: int, world_size: int,
                    cfg: TrainConfig,
                    make_groups: Callable[[timedelta], None] | None = None,
                    laps: Callable[[str], None] = lambda name: None,
                    on_store: Callable[[GenerationStore], None] = lambda store: None,
                    after_default_group: Callable[[], None] = lambda: None,
                    creating: Callable[[timedelta], ContextManager] =
                    lambda timeout: contextlib.nullcontext(),
                    barrier_group: bool = False,
                    forming: Forming | None = None) -> bool:
    """Rendezvous of one generation, then the default and every Megatron group
    (`make_groups(timeout)`, by default ours for `cfg`) and, with `barrier_group`, the
    reduction barrier's, made by `forming` in a thread of its own inside
    `creating(timeout)`: what must hold while they are made (the groups kept from the last
    generation handed back: keep.py; the loop's patches of torch and Megatron), entered and
    left by this thread, so that a creation left behind undoes nothing when it ends.

    False if a newer generation was declared while waiting in the rendezvous (a failure
    during recovery); FormingAbandoned if it was declared while the groups were made and
    a creation still waited on (forming.py). The groups are created with a timeout of at
    most REBUILD_TIMEOUT_S, then given the job's.
    """
    from deadpool_megatron.integration.distributed import (make_megatron_groups,
                                                           megatron_groups_patched)
    from deadpool_megatron.reconstruct.keep import make_barrier_group

    forming = forming or Forming(generation)
    store = GenerationStore(ctl, generation)
    on_store(store)
    laps("connection")
    if not ctl.rendezvous(generation, world_size, rank, waiter=store.control):
        return False
    laps("rendezvous")
    job_timeout = timedelta(minutes=cfg.distributed_timeout_minutes)
    rebuild = min(job_timeout, timedelta(seconds=REBUILD_TIMEOUT_S))

    def default_group() -> None:
        # torch names the default group and Megatron's (no explicit name) by a process-wide
        # count, reset only when a default group is destroyed. A forming cut inside
        # init_process_group had counted one and destroyed none: every later generation of
        # that rank named its groups apart from its peers', each member waiting for the
        # others under its own store prefix (chaos soak seeds 21 and 44: no generation
        # formed again).
        c10d._world.group_count = 0
        dist.init_process_group(backend=cfg.distributed_backend, store=store.store,
                                rank=rank, world_size=world_size, timeout=rebuild)
        laps("default_group")
        after_default_group()

    def groups() -> None:
        if make_groups is not None:
            make_groups(rebuild)
        else:
            make_megatron_groups(cfg, timeout=rebuild)
        if barrier_group:
            make_barrier_group()

    forming.run(default_group, "the default group")
    with contextlib.ExitStack() as patched:
        patched.enter_context(creating(rebuild))
        if make_groups is None:
            patched.enter_context(megatron_groups_patched(cfg))
        forming.run(groups, "Megatron's groups")
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(job_timeout, group)
    laps("megatron_groups")
    return True


def socket_inodes() -> frozenset[int]:
    """This process's sockets now: taken as a generation begins forming, what is older than
    the generation (other libraries' connections, the control plane's) is never cut."""
    return frozenset(inode for _, inode in socket_fd_inodes())


def sever_connections(keep: frozenset[Endpoint], older: frozenset[int] = frozenset(),
                      both_ways: bool = False) -> int:
    """Shut down every TCP connection of this process opened since `older` was taken (the
    generation's own: its gloo pairs, its snapshot group's, NCCL's socket transport),
    except those to or from `keep` (the control-plane store's addresses and port), whatever
    its state; returns how many were cut.

    Called between generations, before any new group exists: what remains are the broken
    generation's gloo pairs. A collective blocked on one of them (in the stopping training
    thread, here or on a peer) then fails at once, as if the peer had died, instead of
    waiting out its timeout. Half-closed sockets (the peer cut first: CLOSE_WAIT) are cut
    too: an operation posted on one later must fail, not wait. The sockets are found through
    /proc/self/fd (psutil's connection table took 100-200 ms on a loaded host).

    The read side only, unless `both_ways`: gloo's event loop then reads the end of the
    stream, fails the pair with every operation waiting on it, and closes the socket, which
    the peer sees; but not on a pair whose posted receive lost its buffer, where it never
    reads again, so a leaving rank shuts both ways once its threads stopped (leave.py). A
    write side shut down under a thread that is just posting a send (an
    intact replica entering the reduction barrier as it is cut) fails that send with EPIPE,
    which gloo's asynchronous path answers by queueing the send, unfailed, and the pair's
    later failure does not wake a waiting send of an unbound buffer
    (gloo/transport/tcp/pair.cc: write, signalException): the thread would wait out the
    group's timeout (CI: "a thread ... did not stop within 5 s", its training thread in the
    data-parallel barrier, every gloo connection of the rank already closed).
    """
    import socket

    how = socket.SHUT_RDWR if both_ways else socket.SHUT_RD
    cut = 0
    for sock, local, peer in _tcp_sockets(skip=older):
        with sock:
            if peer is None or local in keep or peer in keep:
                continue  # listening or not yet connected; or the control plane's
            try:
                sock.shutdown(how)
                cut += 1
            except OSError:
                pass
    return cut


def open_connections() -> list[str]:
    """This process's TCP sockets as "local->peer" ports ("local listening/unconnected"):
    what a report of a thread that would not stop shows."""
    out = []
    for sock, local, peer in _tcp_sockets():
        with sock:
            out.append(f"{local[1]}->{peer[1]}" if peer is not None
                       else f"{local[1]} unconnected")
    return out


def _tcp_sockets(skip: frozenset[int] = frozenset()
                 ) -> Iterator[tuple[Any, Endpoint, Endpoint | None]]:
    """(a duplicate of the socket, its local end, its peer's end or None) for each TCP
    socket of this process but those whose inode is in `skip` (not even duplicated); the
    caller closes the duplicate."""
    import socket

    for fd, inode in socket_fd_inodes():
        if inode in skip:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        if os.fstat(sock.fileno()).st_ino != inode:
            sock.close()  # closed meanwhile and its number reused: a newer socket, which a
            continue  # cut running beside the next generation's forming must not touch
        try:
            inet = sock.family in (socket.AF_INET, socket.AF_INET6)
            if sock.type != socket.SOCK_STREAM or not inet:
                sock.close()
                continue
            local = endpoint(sock.getsockname())
        except OSError:
            sock.close()
            continue
        try:
            peer = endpoint(sock.getpeername())
        except OSError:
            peer = None
        yield sock, local, peer
