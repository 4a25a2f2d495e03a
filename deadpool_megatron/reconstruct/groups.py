"""Process groups per generation: join under a fresh store prefix, abort, destroy.

Every generation's default group and Megatron-Core groups live under the store prefix
`dp/gen{g}/pg/`, so nothing of a dead generation (keys, sockets, sequence numbers) can be
confused with the new one.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.control import keys
from deadpool_megatron.control.client import ControlClient

log = logging.getLogger("deadpool_megatron.reconstruct")


def live_groups() -> list[dist.ProcessGroup]:
    """Every process group this process holds (default, Megatron's, snapshot's)."""
    return list(c10d._world.pg_map.keys()) if dist.is_initialized() else []


def leave_generation() -> None:
    """Drop every group of this generation without waiting for anything.

    With gloo, no call frees a collective that another thread of this process is blocked
    in (abort and shutdown only take effect once that work ends), so the training thread of
    a broken generation is abandoned, not joined: it errors out on its own when its peers'
    sockets close or its timeout passes. `_abort_process_group` on the default group
    returns at once and forgets every group, so the next generation starts clean; with
    NCCL it also aborts the communicators, which does free blocked kernels.
    """
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        try:
            c10d._abort_process_group(c10d._get_default_group())
        except Exception:  # noqa: BLE001 - already gone
            pass
    c10d._world.pg_map.clear() if dist.is_initialized() else None


def join_generation(ctl: ControlClient, generation: int, rank: int, world_size: int,
                    cfg: TrainConfig) -> bool:
    """Rendezvous of one generation, then the default and every Megatron group.

    False if a newer generation was declared while waiting (a failure during recovery).
    """
    from deadpool_megatron.integration.distributed import init_megatron_groups

    if not ctl.rendezvous(generation, world_size):
        return False
    if cfg.distributed_backend == "nccl":
        # A spare keeps the device it was started on (its launcher slot), whatever rank it
        # takes; an active worker's slot is its local rank.
        slot = int(os.environ.get("DEADPOOL_DEVICE_SLOT", os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(slot % torch.cuda.device_count())
    store = dist.PrefixStore(keys.pg_prefix(generation), ctl.store)
    dist.init_process_group(backend=cfg.distributed_backend, store=store, rank=rank,
                            world_size=world_size,
                            timeout=timedelta(minutes=cfg.distributed_timeout_minutes))
    init_megatron_groups(cfg)
    return True


def sever_connections(keep_ports: set[int]) -> int:
    """Shut down every established TCP connection of this process except those to or from
    `keep_ports` (the control-plane store); returns how many were cut.

    Called between generations, before any new group exists: what remains are the broken
    generation's gloo pairs. A collective blocked on one of them (in the abandoned training
    thread, here or on a peer) then fails at once, as if the peer had died, instead of
    waiting out its timeout and waking, minutes later, inside the new generation.
    """
    import socket

    import psutil

    cut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or conn.fd < 0 or not conn.raddr:
            continue
        if conn.laddr.port in keep_ports or conn.raddr.port in keep_ports:
            continue
        try:
            dup = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            continue  # closed meanwhile
        try:
            dup.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            dup.close()
    return cut
