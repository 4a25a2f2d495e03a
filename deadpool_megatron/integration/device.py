"""This process's CUDA device: chosen once, set in every thread that touches CUDA.

CUDA's current device is a property of the calling thread, not of the process. A device set
in the worker's main thread is not the device of the generation's training thread, of the
snapshot worker or of the thread that releases an old generation's groups: each of them
starts on device 0. Under deadpool-launch every worker of a host would then train, seed and
copy snapshots on GPU 0 (NCCL: duplicate GPU). So the device is chosen once per process,
from the launcher's slot, and every such thread enters `ProcessDevice.thread()` first.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

SLOT_ENV = "DEADPOOL_DEVICE_SLOT"


class DeviceLayoutError(RuntimeError):
    """This worker has no device of its own; the message says which flags to change."""


def device_slot(environ: Mapping[str, str]) -> int:
    """The launcher's slot (a spare keeps the slot it was started on, whatever rank it
    takes), else torchrun's LOCAL_RANK, else 0."""
    return int(environ.get(SLOT_ENV, environ.get("LOCAL_RANK", "0")))


@dataclass(frozen=True)
class ProcessDevice:
    """The CUDA device index of this process; None where it uses no CUDA device."""

    index: int | None

    @classmethod
    def choose(cls, backend: str, environ: Mapping[str, str] | None = None) -> "ProcessDevice":
        """The device of this worker's slot. With NCCL every worker (spares too) needs a
        GPU of its own: a slot beyond the host's devices is an error, not a shared GPU.
        Gloo over CUDA tensors may share one (the single-GPU rehearsal of tools/gpu_check.sh)."""
        environ = os.environ if environ is None else environ
        if not torch.cuda.is_available():
            if backend == "nccl":
                raise DeviceLayoutError(
                    "--distributed-backend nccl needs CUDA devices; on a CPU machine pass "
                    "--distributed-backend gloo (CPU rehearsal mode).")
            return cls(None)
        slot, count = device_slot(environ), torch.cuda.device_count()
        if slot < count:
            return cls(slot)
        if backend == "nccl":
            raise DeviceLayoutError(
                f"this worker's device slot is {slot} ({SLOT_ENV} or LOCAL_RANK) but this "
                f"host has {count} CUDA devices: with NCCL every active worker and every "
                f"spare of a host needs a GPU of its own. Make --nproc-per-node plus "
                f"--spares at most {count} (for example --nproc-per-node {max(count - 1, 1)} "
                f"--spares 1).")
        return cls(slot % count)

    def bind(self) -> None:
        """Make this device the calling thread's current one (nothing without CUDA)."""
        if self.index is not None:
            torch.cuda.set_device(self.index)

    @contextlib.contextmanager
    def thread(self) -> Iterator[None]:
        """Enter first in any thread that may touch CUDA (a new thread starts on device 0)."""
        self.bind()
        yield


CPU = ProcessDevice(None)
