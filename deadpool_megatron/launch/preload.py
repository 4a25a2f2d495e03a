"""Workers forked from a preloader (launch/preload_server.py): the launcher's side.

Each worker used to import torch and Megatron-Core itself: about 8 s of CPU a process, so
an 8-rank job with 2 warm spares spent some 45 s of a 2-core host's start (and every
whole-job restart) doing the same imports eleven times. A host's launcher now starts one
preloader, which imports them once while the launcher sets up, and forks each worker from
it. A worker is still its own process: its pid, process group, environment, log file,
parent-death signal and exit status are those a fresh interpreter would have, and signals
go to it directly (through a pidfd, so never to a reused pid). Only the command line that
`ps` shows is the preloader's; the worker's id is its name (`ps -o comm`, top).

`--preload auto` (the default) forks where no CUDA device is visible, i.e. for CPU
rehearsal; with CUDA, and with `--preload off`, every worker is a fresh interpreter, as
under torchrun. A preloader that fails leaves the launcher starting fresh interpreters.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from deadpool_megatron.launch.child import die_with_parent

log = logging.getLogger("deadpool_megatron.launch")
READY_TIMEOUT_S = 300.0  # the imports: ~6 s alone, longer on a host the training loads
REPLY_TIMEOUT_S = 30.0


class PreloadError(RuntimeError):
    """The preloader cannot fork workers (it said why, or it died)."""


class Preloader:
    """One host's preloader process and its two pipes."""

    def __init__(self, script: str, log_path: str, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        req_r, self._req_w = os.pipe()
        self._status_r, status_w = os.pipe()
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "deadpool_megatron.launch.preload_server",
                 script, str(req_r), str(status_w)], pass_fds=(req_r, status_w),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, cwd=cwd, preexec_fn=die_with_parent())
        os.close(req_r)
        os.close(status_w)
        os.set_blocking(self._status_r, False)
        self._buffer = b""
        self._ready: bool | None = None
        self.why: str | None = None
        self._pids: dict[str, int] = {}  # request id -> pid
        self.exits: dict[int, int] = {}  # pid -> returncode
        self._seq = 0
        self.alive = True  # False once its status pipe reached its end

    def fileno(self) -> int:
        """Readable when a worker exited (a wake-up for the launcher's loop)."""
        return self._status_r

    def pump(self) -> bool:
        """Read every message waiting; False once the preloader is gone."""
        while True:
            try:
                chunk = os.read(self._status_r, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                self.alive = False
                return False
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                self._take(json.loads(line))

    def _take(self, message: dict[str, Any]) -> None:
        if "ready" in message:
            self._ready, self.why = bool(message["ready"]), message["why"]
        elif "id" in message:
            self._pids[message["id"]] = int(message["pid"])
        else:
            self.exits[int(message["pid"])] = int(message["rc"])

    def _wait(self, done, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise PreloadError(f"no {what} from the preloader within {timeout_s:.0f} s")
            select.select([self._status_r], [], [], min(left, 0.5))
            if not self.pump() and not done():
                raise PreloadError(f"the preloader exited (status {self.proc.poll()}) "
                                   f"before {what}")

    def spawn(self, argv: Sequence[str], env: dict[str, str], log_path: str, name: str,
              own: Sequence[str], session: bool = False,
              ignore_sigterm: bool = False) -> "PreloadedProcess":
        """Fork `python -u ARGV` with `env` (whose keys in `own` may differ from the
        launcher's environment), its output appended to log_path; `ignore_sigterm`: see
        launch/child.py."""
        self._wait(lambda: self._ready is not None, READY_TIMEOUT_S, "readiness")
        if not self._ready:
            raise PreloadError(self.why or "not ready")
        self._seq += 1
        rid = str(self._seq)
        request = {"id": rid, "argv": list(argv), "env": env, "log": log_path,
                   "name": name, "own": sorted(own), "session": session,
                   "ignore_sigterm": ignore_sigterm}
        try:
            os.write(self._req_w, (json.dumps(request) + "\n").encode())
        except BrokenPipeError as err:
            raise PreloadError("the preloader exited") from err
        self._wait(lambda: rid in self._pids, REPLY_TIMEOUT_S, f"pid for {name}")
        return PreloadedProcess(self, self._pids.pop(rid))

    def close(self, timeout_s: float = 10.0) -> None:
        """No more workers: the preloader exits once its last child is reaped."""
        try:
            os.close(self._req_w)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.pump()
        os.close(self._status_r)


def start_preloader(script: str, log_path: str, env: dict[str, str] | None = None,
                    cwd: str | None = None) -> Preloader | None:
    """A preloader for `script`'s workers (started with `env` in `cwd`: theirs but for the
    variables each spawn names its own), or None where it cannot start."""
    try:
        return Preloader(script, log_path, env, cwd)
    except OSError as err:
        log.warning("deadpool-launch: no preloader (%s): each worker imports torch itself",
                    err)
        return None


class PreloadedProcess:
    """What the launcher needs of subprocess.Popen, for a worker the preloader forked."""

    def __init__(self, preloader: Preloader, pid: int) -> None:
        self.preloader, self.pid = preloader, pid
        self.returncode: int | None = None
        try:  # a handle on this very process: a signal never reaches a reused pid
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            if not self.preloader.pump() and self.pid not in self.preloader.exits:
                self._close_pidfd()
                self.returncode = -signal.SIGKILL  # the preloader died: so did its workers
            elif self.pid in self.preloader.exits:
                self.returncode = self.preloader.exits.pop(self.pid)
                self._close_pidfd()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            select.select([self.preloader.fileno()], [], [], 0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signum)
            else:
                os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
