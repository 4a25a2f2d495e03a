"""The launcher's console: every worker writes its full output to a log file of its own
(never lost, never blocked on a reader), and a thread of the launcher follows those files
and prints what a person needs (launch/console_lines.py), or every line with --console raw.

Files: LOG_DIR/epoch<N>/<worker>.log (w<rank> for a rank's first worker, s<host>.<i> for a
spare), one directory per epoch (a restart from --save starts fresh workers).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING, Callable, TextIO

from deadpool_megatron.launch.console_lines import ConsoleFilter, JobView

if TYPE_CHECKING:
    from deadpool_megatron.launch.coordinator import Coordinator

log = logging.getLogger("deadpool_megatron.launch")
MODES = ("status", "raw")
POLL_S = 0.1  # how often the console reads the workers' new output


def epoch_dir(log_dir: str, epoch: int) -> str:
    return os.path.join(log_dir, f"epoch{epoch}")


def default_log_dir(node_rank: int) -> str:
    """A fresh directory for a launcher that was given no --log-dir (as torchrun does)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return tempfile.mkdtemp(prefix=f"deadpool-launch-{stamp}-host{node_rank}-")


class _Follow:
    """One worker's log file, read from where the last read stopped."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def new_lines(self, final: bool) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()  # all of it: the console may lag, never drop lines
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        if final and self.partial:
            lines, self.partial = [*lines, self.partial], b""
        return [line.decode(errors="replace").rstrip("\r") for line in lines]


class Console:
    """Follows LOG_DIR/epoch*/*.log in a thread; start(), then close() at the end."""

    def __init__(self, mode: str, log_dir: str, out: TextIO, poll_s: float = POLL_S) -> None:
        self.mode, self.log_dir, self.out, self.poll_s = mode, log_dir, out, poll_s
        self.filter = ConsoleFilter()
        self.job: Callable[[], JobView | None] = lambda: None
        self._files: dict[str, _Follow] = {}
        self._epoch = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def open_epoch(self, epoch: int) -> str:
        """The directory the workers of `epoch` write to (made here)."""
        path = epoch_dir(self.log_dir, epoch)
        os.makedirs(path, exist_ok=True)
        with self._lock:
            self.poll(final=True)  # the older epoch's last lines first
            self._epoch, self._files = epoch, {}
            self.filter = ConsoleFilter()
            self.job = lambda: None
        return path

    def follow_job(self, coordinator: Coordinator) -> None:
        """Host 0: the status line also says the generation's spares left, and a recovery
        its time since the declaration."""
        self.job = job_view(coordinator)

    def start(self) -> None:
        log.info("deadpool-launch: each worker's full output: %s/epoch<N>/<worker>.log "
                 "(console: %s)", self.log_dir, self.mode)
        self._thread = threading.Thread(target=self._run, name="deadpool-console",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            self.poll(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                try:
                    self.poll(final=False)
                except Exception as err:  # the console must never stop the launcher
                    log.warning("deadpool-launch: console: %r", err)

    def poll(self, final: bool) -> None:
        """Read every worker's new lines and print what the console shows of them."""
        if self._epoch < 0:
            return
        directory = epoch_dir(self.log_dir, self._epoch)
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".log"))
        except OSError:
            names = []
        for name in names:
            if name not in self._files:
                self._files[name] = _Follow(os.path.join(directory, name))
                self.filter.add_worker(name[:-4])
        now, job, shown = time.monotonic(), self.job(), []
        for name, follow in self._files.items():
            lines = follow.new_lines(final)
            if self.mode == "raw":
                shown += [line + "\n" for line in lines]
            elif lines:
                shown += [_format(s, t) for s, t in self.filter.feed(name[:-4], lines, now, job)]
        if self.mode != "raw":
            outputs = self.filter.close(now) if final else self.filter.tick(now)
            shown += [_format(s, t) for s, t in outputs]
        if shown:
            self.out.write("".join(shown))
            self.out.flush()


def _format(source: str, text: str) -> str:
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"[{stamp} {source}] {text}\n"


def job_view(coordinator: Coordinator) -> Callable[[], JobView]:
    """Host 0's coordinator as the console sees it (read from the console's thread: plain
    attribute reads)."""
    def view() -> JobView:
        return JobView(generation=coordinator.generation, spares_left=len(coordinator.spares),
                       declared_wall=time.time() - (time.monotonic() - coordinator.declared_at))
    return view
