"""Test-only: one rank fails inside Megatron-Core the way real failures come, without our
fault injector.

Installed by pretrain_gpt.py when the environment variable DEADPOOL_TEST_MEGATRON_FAULT is
set (only tests set it). It patches a Megatron-Core function in the process of the worker
that started as that rank (a spare taking the rank later is not affected):

    "raise rank=2 at=forward call=13"   RuntimeError("CUDA error: an illegal memory access
                                        was encountered") from TransformerLayer.forward
    "raise rank=1,6 at=save error=ecc"  RuntimeError("CUDA error: uncorrectable ECC error
                                        encountered"), a GPU's hardware fault, in ranks 1
                                        and 6 (a list of ranks: each of them)
    "raise rank=all at=save"            OSError(ENOSPC, "No space left on device") from
                                        megatron.core.dist_checkpointing.save, in every
                                        rank's first save (a full file system); rank=all:
                                        every worker that started as a rank
    "nan rank=2 at=forward call=13"     that layer's output turns NaN (a numerical blow-up):
                                        the loss and every gradient of the rank's data-
                                        parallel replica follow, and Megatron's own check
                                        (--check-for-nan-in-loss-and-grad, on by default)
                                        raises "found NaN in local grad norm" in each of its
                                        ranks, alike, before the gradient reduction
    "kill rank=1 at=backward call=65"   SIGKILL of the process (the failure of
                                        tools/bench_recovery.py --vs-checkpoint's job
                                        without --deadpool, where no injector runs)
    "block rank=3 at=backward call=5"   the training thread blocks forever (releasing the
                                        GIL, its process otherwise healthy) inside the
                                        backward of Megatron's tensor-parallel linear
    "gil rank=2 at=save seconds=20"     the thread holds the GIL for that long inside
                                        megatron.core.dist_checkpointing.save (a long C call)
    "stop rank=2 at=save"               the process stops itself (SIGSTOP: frozen, as by a
                                        debugger or a cgroup freeze) inside that save
    "sleep rank=2 at=save seconds=8"    that save takes this much longer on the rank (a slow
                                        file system; the GIL released), its peers waiting
    "kill rank=3 at=gloo call=2"        SIGKILL inside the gloo creation of the process's
                                        2nd default group (generation 1's, after one
                                        recovery), right after it published its address:
                                        a peer that was to connect, dead. Its address is
                                        127.0.0.2, above its peers' with GLOO_SOCKET_IFNAME=lo
                                        (127.0.0.1), so each of them is the side that waits
                                        to be connected (gloo: the lower address listens)

    "kill rank=3 at=pair call=2"        as at=gloo, inside the gloo creation of the process's
                                        2nd snapshot pair group (generation 1's): its buddy
                                        waits to be connected
    "kill rank=1 at=fetch call=1"       the same in its 1st replica fetch's pair group (a
                                        restore: the source of a spare's replicated region)

    "block rank=3 at=ack call=4"        the snapshot worker blocks forever (the GIL released)
                                        in its 4th snapshot's acknowledgement with its
                                        buddy: a worker that cutting its connections does
                                        not free

    "block worker=s0.0 at=restore"      the worker named s0.0 (a spare) blocks forever (the
                                        GIL released) in its 1st restore transfer (its
                                        shard from its buddy, moves.exchange): a transfer
                                        that cutting its connections does not free

    "block worker=s0.0 at=build"        the worker named s0.0 (a spare) blocks forever as it
                                        builds a GPT model (GPTModel's constructor): a spare
                                        hung while it builds the failed rank's objects alone

`call=N` fires at the Nth call of the patched function in this process (1-based), so a
test picks the iteration and micro-batch: TransformerLayer.forward runs once per layer of
the stage per micro-batch. `iter=N` instead makes it a fault of the work, not of a process:
it fires at the first call in Megatron's iteration N (1-based, as logged) in whichever
worker holds the rank then, a spare that took it and redoes that iteration too:

    "raise rank=2 at=forward iter=3"    every worker of the first launch is patched
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

ENV = "DEADPOOL_TEST_MEGATRON_FAULT"
ALL = -1  # rank=all
CUDA_ERROR = "CUDA error: an illegal memory access was encountered"
ECC_ERROR = "CUDA error: uncorrectable ECC error encountered"  # a GPU's own fault
ERRORS = {"illegal": CUDA_ERROR, "ecc": ECC_ERROR}  # error=...: what `raise` raises


@dataclass(frozen=True)
class MegatronFault:
    action: str  # raise, nan, kill, block, gil, stop, sleep
    ranks: tuple[int, ...]  # (ALL,): every rank
    at: str  # forward, backward, save, gloo, pair, fetch, ack, restore, build
    call: int = 1
    seconds: float = 0.0
    iteration: int = 0  # a fault of the work: fires in iteration N in the rank's holder
    error: str = ""  # a key of ERRORS; "": the place's own (ENOSPC in a save, else illegal)
    worker: str = ""  # instead of ranks: the worker of this name (a spare: "s0.0")

    @classmethod
    def parse(cls, text: str) -> "MegatronFault":
        words = text.split()
        fields = dict(w.split("=", 1) for w in words[1:])
        given = fields.get("rank", "")
        ranks = (ALL,) if given == "all" else tuple(int(r) for r in given.split(",") if r)
        return cls(action=words[0], ranks=ranks,
                   at=fields["at"], call=int(fields.get("call", 1)),
                   seconds=float(fields.get("seconds", 0)), iteration=int(fields.get("iter", 0)),
                   error=fields.get("error", ""), worker=fields.get("worker", ""))

    def __post_init__(self) -> None:
        if self.error and self.error not in ERRORS:
            raise ValueError(f"{ENV}: unknown error={self.error!r}; one of {sorted(ERRORS)}")

    def names(self, rank: int) -> bool:
        """Whether `rank` is one the fault names."""
        return ALL in self.ranks or rank in self.ranks

    def due(self, calls: int) -> bool:
        """Whether the patched function's `calls`th call in this process fires it."""
        if not self.iteration:
            return calls == self.call
        import torch.distributed as dist
        from megatron.training import get_args

        return self.names(dist.get_rank()) and \
            get_args().curr_iteration + 1 == self.iteration

    def mine(self, rank: int | None, worker: str = "") -> bool:
        """Whether the worker `worker`, started as `rank` (None: a spare), is patched."""
        if self.worker:
            return worker == self.worker
        return bool(self.iteration) or (rank is not None and self.names(rank))


def _hold_gil(seconds: float) -> None:
    """A C call that keeps the GIL (ctypes.pythonapi calls do not release it)."""
    libc = ctypes.PyDLL(None)
    libc.usleep(ctypes.c_uint(int(seconds * 1e6)))


def _poisoned(output: Any) -> Any:
    """A layer's output (hidden states, or hidden states and context) made NaN."""
    if isinstance(output, tuple):
        return (output[0] * float("nan"), *output[1:])
    return output * float("nan")


def _failing(fault: MegatronFault, fn: Callable) -> Callable:
    calls, fired = 0, False

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls, fired
        calls += 1
        if not fired and fault.due(calls):
            fired = True
            print(f"test fault: {fault.action} in {fault.at} (call {calls}) at "
                  f"{time.time():.3f}", flush=True)
            if fault.action == "raise" and fault.at == "save" and not fault.error:
                where = kwargs.get("checkpoint_dir", args[1] if len(args) > 1 else "")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))
            if fault.action == "raise":
                raise RuntimeError(ERRORS[fault.error or "illegal"])
            if fault.action == "nan":
                return _poisoned(fn(*args, **kwargs))
            if fault.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.action == "block":
                threading.Event().wait()  # forever; the GIL is released
            if fault.action == "gil":
                _hold_gil(fault.seconds)
            if fault.action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault.action == "sleep":
                time.sleep(fault.seconds)
        return fn(*args, **kwargs)

    return wrapper


def gloo_options(address: str, timeout: Any) -> Any:
    """A gloo group's options with its device bound to `address` (which side of each pair
    listens follows from the addresses: the lower one)."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = timeout
    return options


def killed_after_publishing(inner: Any, said: str) -> Any:
    """`inner`, a store, for one gloo group's creation: the first key set (this process's
    address) is published, `said` printed, then the process SIGKILLed."""
    import torch.distributed as dist

    class KilledAfterSet(dist.Store):
        def set(self, key: str, value: Any) -> None:
            inner.set(key, value)
            print(f"{said} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        def get(self, key: str) -> bytes:
            return inner.get(key)

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            return inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

        def add(self, key: str, value: int) -> int:
            return inner.add(key, value)

        def check(self, keys: list[str]) -> bool:
            return inner.check(keys)

    return KilledAfterSet()


def _killed_publishing(fault: MegatronFault, module: Any, name: str, kind: str) -> None:
    """Inside the gloo group creation of the `call`th call of `module.name` in this process
    (dist.init_process_group: a default group; engine/moves.pair_group: a snapshot pair, a
    replica fetch), this process publishes its address (127.0.0.2, above its peers', so
    each peer is the side that waits to be connected), says so, and is SIGKILLed."""
    from torch.distributed import distributed_c10d as c10d

    real, gloo = getattr(module, name), c10d.ProcessGroupGloo
    calls = 0

    class Publishing(gloo):  # type: ignore[misc, valid-type]
        def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
            said = f"test fault: kill in {kind} (call {calls}), its address published,"
            super().__init__(killed_after_publishing(store, said), rank, size,
                             gloo_options("127.0.0.2", timeout))

    @functools.wraps(real)
    def patched(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == fault.call:
            c10d.ProcessGroupGloo = Publishing
        return real(*args, **kwargs)

    setattr(module, name, patched)


def install_from_env() -> MegatronFault | None:
    """Patch Megatron-Core as DEADPOOL_TEST_MEGATRON_FAULT says, in the worker that started
    as the named rank (with iter=: in every worker; with worker=: in the one so named);
    returns the fault, or None."""
    text = os.environ.get(ENV)
    if not text or os.environ.get("DEADPOOL_EPOCH", "0") != "0":
        return None
    fault = MegatronFault.parse(text)
    rank = os.environ.get("RANK")
    if not fault.mine(None if rank is None else int(rank),
                      os.environ.get("DEADPOOL_WORKER_ID", "")):
        return None
    if fault.at == "forward":
        from megatron.core.transformer.transformer_layer import TransformerLayer

        TransformerLayer.forward = _failing(fault, TransformerLayer.forward)
    elif fault.at == "backward":
        from megatron.core.tensor_parallel.layers import (
            LinearWithGradAccumulationAndAsyncCommunication as Linear,
        )

        Linear.backward = staticmethod(_failing(fault, Linear.backward))
    elif fault.at == "build":
        from megatron.core.models.gpt import GPTModel

        GPTModel.__init__ = _failing(fault, GPTModel.__init__)
    elif fault.at == "gloo":
        import torch.distributed as dist

        _killed_publishing(fault, dist, "init_process_group", "gloo")
    elif fault.at == "pair":
        from deadpool_megatron.snapshot import engine

        _killed_publishing(fault, engine, "pair_group", "a snapshot pair")
    elif fault.at == "fetch":
        from deadpool_megatron.snapshot import moves

        _killed_publishing(fault, moves, "pair_group", "a replica fetch")
    elif fault.at == "ack":
        from deadpool_megatron.snapshot import worker

        worker.acknowledge = _failing(fault, worker.acknowledge)
    elif fault.at == "restore":
        from deadpool_megatron.snapshot import moves

        moves.exchange = _failing(fault, moves.exchange)
    elif fault.at == "save":
        from megatron.core import dist_checkpointing

        dist_checkpointing.save = _failing(fault, dist_checkpointing.save)
    else:
        raise ValueError(f"{ENV}: unknown at={fault.at!r}")
    return fault
