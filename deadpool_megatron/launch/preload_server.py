"""The preloader: a process that imports torch and Megatron-Core once, then forks each of its
host's workers, which runs its script as `python -u SCRIPT ARGS` would (launch/preload.py
is the launcher's side).

Run as `python -u -m deadpool_megatron.launch.preload_server SCRIPT REQUEST_FD STATUS_FD`.
The script's directory is put first on sys.path before anything is imported, as Python
does for a script, so a Megatron-LM tree's own `megatron` is the one preloaded. Requests
and replies are JSON lines: a request {"id", "argv", "env", "log", "name", "own", "session"}
is answered {"id", "pid"}, every exit {"pid", "rc"} (the returncode Popen would report).

A forked worker is the command it replaces, or it is not forked: where the worker's
environment differs from the preloader's in anything but the launcher's per-worker
variables (those read at interpreter start-up would differ), or a preloaded package would
be found elsewhere on its path, the child executes the command itself.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import json
import os
import runpy
import select
import signal
import sys
from typing import Any

PRELOADED = ("torch", "megatron")  # top-level packages a worker must find where we did
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
RECIPE, RECIPE_LINES = "# deadpool-preload:", 40


def preload(script: str) -> str | None:
    """Import what every worker imports first; returns why not, or None. Where CUDA is
    present nothing is forked: CUDA does not survive a fork. A script may name what its
    workers import first in a line `# deadpool-preload: MODULE:FUNCTION` among its first
    lines (pretrain_scripts/pretrain_gpt.py does: its megatron is a patched tree); else it
    is torch and Megatron-Core as found from the script's directory."""
    import torch
    import torch.distributed  # noqa: F401

    if torch.cuda.is_available():
        return "CUDA is present (a process that forks must not have touched it)"
    recipe = _recipe(script)
    if recipe is not None:
        module, _, function = recipe.partition(":")
        getattr(importlib.import_module(module), function)()
        return None
    from deadpool_megatron.rehearsal.imports import prepare_megatron_import

    prepare_megatron_import(True)  # as every CPU-rehearsal worker does first
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:  # a script without Megatron still gets torch preloaded
        print(f"preloader: Megatron not preloaded: {err}", flush=True)
        for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
            del sys.modules[name]  # the worker's own import meets what a fresh one would
    return None


def _recipe(script: str) -> str | None:
    with open(script, errors="replace") as f:
        for _, line in zip(range(RECIPE_LINES), f):
            if line.startswith(RECIPE):
                return line[len(RECIPE):].strip()
    return None


def _send(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        try:
            data = data[os.write(fd, data):]
        except InterruptedError:
            continue
        except BrokenPipeError:
            return  # the launcher is gone: nobody to tell, and the children must live on


def _reap(status_fd: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(status_fd, {"pid": pid, "rc": os.waitstatus_to_exitcode(status)})


def serve(request_fd: int, status_fd: int) -> dict[str, Any] | None:
    """Fork a worker per request until the launcher closes the request pipe; returns the
    request in each forked child, None in the preloader once its children are reaped."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buffered, open_ = b"", True
    while True:
        _reap(status_fd)
        if not open_:
            try:  # the launcher is done: wait for the last children, reporting each
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return None
            except InterruptedError:
                continue
            _send(status_fd, {"pid": pid, "rc": os.waitstatus_to_exitcode(status)})
            continue
        try:
            ready, _, _ = select.select([request_fd, wake_r], [], [], 1.0)
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        if request_fd not in ready:
            continue
        chunk = os.read(request_fd, 65536)
        if not chunk:
            open_ = False
            continue
        buffered += chunk
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            request = json.loads(line)
            request["parent"] = os.getpid()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (wake_r, wake_w, request_fd, status_fd):
                    os.close(fd)
                return request
            _send(status_fd, {"id": request["id"], "pid": pid})


def become_worker(request: dict[str, Any], start_env: dict[str, str]) -> None:
    """In the forked child: the worker's signals, parent-death signal, output, environment
    and name; then its script, or, where a fork cannot be exact, the command itself."""
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    if request.get("ignore_sigterm"):  # until the worker installs its own (launch/child.py)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    libc = ctypes.CDLL(None, use_errno=True)
    parent = int(request["parent"])
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != parent:
        os._exit(1)  # the preloader died before the signal was armed
    if request.get("session"):
        os.setsid()
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    env, argv = dict(request["env"]), list(request["argv"])
    here = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` does
    sys.path[sys.path.index(request["script_dir"])] = here
    why = _not_exact(env, start_env, set(request["own"]))
    if why is not None:
        print(f"preloader: starting {request['name']} with a fresh interpreter: {why}",
              flush=True)
        os.execve(sys.executable, [sys.executable, "-u", *argv], env)
    os.environ.clear()
    os.environ.update(env)
    libc.prctl(PR_SET_NAME, request["name"].encode()[:15], 0, 0, 0)  # `ps -o comm`, top
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def _not_exact(env: dict[str, str], start_env: dict[str, str], own: set[str]) -> str | None:
    differ = sorted(k for k in set(env) | set(start_env)
                    if env.get(k) != start_env.get(k) and k not in own)
    if differ:
        return f"its environment differs from the preloader's in {', '.join(differ[:5])}"
    for name in PRELOADED:
        module = sys.modules.get(name)
        if module is None:
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
        found = None if spec is None else \
            spec.origin if spec.origin not in (None, "namespace") else \
            list(spec.submodule_search_locations or [])
        preloaded = getattr(module, "__file__", None) or list(module.__path__)
        if found != preloaded:
            return f"its path finds {name} elsewhere than the preloaded one"
    return None


def main() -> None:
    script, request_fd, status_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    script_dir = sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT`
    # Ctrl-C or a scheduler's SIGTERM reach the whole process group: the launcher and its
    # workers act on them; the preloader ends when the launcher closes its request pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    start_env = dict(os.environ)
    why = preload(script)
    _send(status_fd, {"ready": why is None, "why": why})
    if why is not None:
        return
    request = serve(request_fd, status_fd)
    if request is not None:
        request["script_dir"] = script_dir
        become_worker(request, start_env)


if __name__ == "__main__":
    main()
