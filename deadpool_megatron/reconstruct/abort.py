"""Cutting a broken generation loose, so that whatever waits on it returns at once.

gloo: the generation's TCP connections are shut down (groups.sever_connections): a
collective blocked on one fails as if the peer had died.

NCCL: a thread blocked on an NCCL kernel (a CUDA synchronisation behind a collective that a
dead peer never joins) returns only once its communicator is aborted, whatever flag it is
asked to check. So the communicators are aborted first, before the recovery waits for the
thread; waiting first would cost every recovery the whole stop timeout and leave the thread
behind. The connections are cut as well (the snapshot group is gloo).

Only the broken generation's own connections are cut: sockets that existed before it began
forming (other libraries', the control plane's) are left alone. And torch's NCCL watchdog is
told not to act on errors itself (asynchronous error handling off): otherwise it may abort
communicators or tear the whole process down on a peer's failure, before or against the
recovery's decision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import MutableMapping

from deadpool_megatron.control.sockets import Endpoint
from deadpool_megatron.reconstruct.groups import sever_connections

log = logging.getLogger("deadpool_megatron.reconstruct")
ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ERROR_HANDLING_OFF = "0"  # NoHandling: errors surface in the caller, the recovery decides


def configure_nccl_error_handling(environ: MutableMapping[str, str]) -> str | None:
    """Turn the NCCL watchdog's error handling off before any group exists; returns a
    warning when the environment asked for something else (it is overridden)."""
    previous = environ.get(ERROR_HANDLING_ENV)
    environ[ERROR_HANDLING_ENV] = ERROR_HANDLING_OFF
    if previous is None or previous == ERROR_HANDLING_OFF:
        return None
    return (f"{ERROR_HANDLING_ENV}={previous} overridden with {ERROR_HANDLING_OFF}: under "
            f"deadpool-launch a peer's failure is recovered from, so torch's NCCL watchdog "
            f"must not abort or tear down this process on its own")


def abort_communicators() -> None:
    """Abort every communicator of this process's current (broken) generation at once;
    torch aborts them inside one NCCL group, so that one abort cannot wait on another."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    try:
        c10d._abort_process_group()
    except Exception as err:  # noqa: BLE001 - a communicator already gone; go on cutting
        log.warning("aborting the broken generation's communicators: %s", err)


@dataclass
class GenerationCut:
    """Cuts one broken generation: NCCL communicators aborted (once) before anything
    waits, then its connections opened since `older` was taken, but the control plane's
    and, until `cut_spared`, those of the groups this rank may keep (`spared`, keep.py)."""

    keep: frozenset[Endpoint]  # the control-plane store's ends (control/sockets.endpoints)
    older: frozenset[int]
    nccl: bool
    aborted: bool = False
    spared: frozenset[int] = frozenset()
    spared_cut: bool = False

    def __call__(self, both_ways: bool = False) -> int:
        """Cut now (again: a connection still being set up at the last cut may hold a
        thread); returns the connections cut. The read side, which gloo turns into a failed
        pair and a closed socket (groups.sever_connections); `both_ways` where no send of
        a waiting thread can meet the shut write side, or the read side is not enough: a
        stopping thread past its patience, a generation still forming (no event loop may
        watch its connections yet), and once the rank's threads have stopped (its peers
        must read the end at once)."""
        if self.nccl and not self.aborted:
            self.aborted = True
            abort_communicators()
        return sever_connections(self.keep, self.older | self.spared, both_ways)

    def unspare(self, inodes: frozenset[int]) -> None:
        """These connections are cut after all (a thread waits on them)."""
        self.spared = self.spared - inodes

    def cut_spared(self) -> None:
        """The thread would not stop: the kept groups' connections go too (none is kept)."""
        if self.spared:
            self.spared, self.spared_cut = frozenset(), True
