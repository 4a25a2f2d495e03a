"""The launcher's nudge: a worker learns that deadpool-inject wrote a request for it.

A counter in a small shared-memory file per worker (beside its progress record), which only
its host's launcher increments, when it has read a new request aimed at that worker. The
worker's fault injector compares it at each iteration boundary, a memory read, and reads
the store only when it moved: no store request per rank per iteration, from whatever
thread the training runs in (a signal handler, the nudge before, can be installed from the
main thread only, and off it every boundary read the store).
"""

from __future__ import annotations

import mmap
import os
import struct

ENV = "DEADPOOL_NUDGE_FILE"
_WORD = struct.Struct("<Q")


class NudgeWord:
    """The worker's side: created here (so the launcher nudges only a worker that looks),
    then read."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _WORD.size:
                os.ftruncate(fd, _WORD.size)
            self._map = mmap.mmap(fd, _WORD.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._seen = self._value()

    def _value(self) -> int:
        return _WORD.unpack_from(self._map, 0)[0]

    def moved(self) -> bool:
        """Whether the launcher nudged since the last call."""
        value = self._value()
        if value == self._seen:
            return False
        self._seen = value
        return True


def nudge(path: str) -> bool:
    """The launcher's side: increment the worker's counter; False if the worker has not
    created it yet (it then reads the store at its first boundary anyway)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        data = os.pread(fd, _WORD.size, 0)
        if len(data) < _WORD.size:
            return False
        # A worker reading mid-write sees some other value: one more store read, no harm.
        os.pwrite(fd, _WORD.pack(_WORD.unpack(data)[0] + 1), 0)
        return True
    finally:
        os.close(fd)
