"""Launch N local training processes with bounded time, keep every rank's log, leave nothing.

The harness hosts the rendezvous TCPStore itself on an OS-chosen port (no free-port race)
and the ranks join it as clients (TORCHELASTIC_USE_AGENT_STORE), as under torchrun.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from deadpool_megatron.control.sockets import store_server
from deadpool_megatron.launch.preload import PreloadedProcess, PreloadError, start_preloader

REPO = Path(__file__).resolve().parents[2]
# The reduced loop (a test fixture): most jobs of the suite; Megatron-LM's loop is
# MEGATRON_GPT (pretrain_scripts/pretrain_gpt.py, what users run).
PRETRAIN_GPT = REPO / "deadpool_megatron" / "testing" / "reduced_pretrain_gpt.py"
MEGATRON_GPT = REPO / "pretrain_scripts" / "pretrain_gpt.py"
# The 3D-parallel job most tests use: 8 ranks, distributed optimizer, dropout on (so RNG
# state matters), a few dozen iterations.
GPT_3D_ARGS = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--use-distributed-optimizer", "--distributed-backend", "gloo", "--mock-data",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3",
    "--lr-warmup-iters", "2", "--seed", "1234",
]

# Also as deadpool-launch's console shows them, after "[time worker] ".
FINGERPRINT = re.compile(r"^(?:\[[^\]\n]*\] )?state fingerprint: ([0-9a-f]{64})$", re.M)
LOSS = re.compile(r"iteration +(\d+)/ *\d+ \|.*lm loss: ([0-9.E+-]+)")
PARAM_NORM = re.compile(r"^(?:\[[^\]\n]*\] )?parameter norm: ([0-9.e+-]+)$", re.M)


@dataclass
class JobResult:
    """logs[h]: everything host h printed, as if every worker wrote to the console: its
    launcher's own lines, then each worker's full log. consoles[h]: what host h's console
    really showed (launch/console.py), for a launched job."""
    returncodes: list[int | None]
    logs: dict[int, str]
    log_dir: Path
    timed_out: bool
    elapsed_s: float
    consoles: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    @property
    def output(self) -> str:
        return "\n".join(self.logs[r] for r in sorted(self.logs))

    @property
    def fingerprint(self) -> str | None:
        found = FINGERPRINT.findall(self.output)
        return found[-1] if found else None

    @property
    def param_norm(self) -> float | None:
        found = PARAM_NORM.findall(self.output)
        return float(found[-1]) if found else None

    @property
    def losses(self) -> dict[int, float]:
        return {int(i): float(v) for i, v in LOSS.findall(self.output)}

    def describe(self) -> str:
        """Everything needed to debug a failed job: exit codes and each rank's log tail."""
        parts = [f"returncodes={self.returncodes} timed_out={self.timed_out} "
                 f"elapsed={self.elapsed_s:.1f}s logs in {self.log_dir}"]
        for rank in sorted(self.logs):
            tail = "\n".join(self.logs[rank].splitlines()[-25:])
            parts.append(f"--- rank {rank} ---\n{tail}")
        for host in sorted(self.consoles):
            tail = "\n".join(self.consoles[host].splitlines()[-40:])
            parts.append(f"--- host {host}'s console ---\n{tail}")
        return "\n".join(parts)


def _kill_group(proc: subprocess.Popen | PreloadedProcess) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a zombie the kernel will reap
        pass


def run_job(nproc: int, args: Sequence[str], log_dir: Path, timeout_s: float = 300.0,
            script: Path = PRETRAIN_GPT, env: dict[str, str] | None = None,
            preload: bool = True) -> JobResult:
    """Run `script args` as ranks 0..nproc-1; kill all of them on failure or timeout."""
    log_dir.mkdir(parents=True, exist_ok=True)
    store = store_server("127.0.0.1", 0, timeout_s, world_size=nproc + 1)
    base_env = {**os.environ, **(env or {})}
    base_env.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc), "TORCHELASTIC_USE_AGENT_STORE": "True",
        "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
    })
    procs: list[subprocess.Popen | PreloadedProcess] = []
    files = []
    start = time.monotonic()
    timed_out = False
    # The ranks fork from one process that imported torch and Megatron-Core (as under
    # deadpool-launch, launch/preload.py), each in its own session as before.
    preloader = start_preloader(str(script), str(log_dir / "preload.log"), base_env,
                                str(REPO)) if preload else None
    try:
        for rank in range(nproc):
            own = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
            path = log_dir / f"rank{rank}.log"
            path.write_bytes(b"")
            if preloader is not None:
                try:
                    procs.append(preloader.spawn([str(script), *args], {**base_env, **own},
                                                 str(path), f"rank{rank}", own, session=True))
                    continue
                except PreloadError:
                    preloader = None
            f = open(path, "w")
            files.append(f)
            procs.append(subprocess.Popen(
                [sys.executable, "-u", str(script), *args], env={**base_env, **own}, stdout=f,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                cwd=str(REPO),
            ))
        deadline = start + timeout_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                # One rank failed: give the others a moment to report, then stop them all.
                grace = time.monotonic() + 5.0
                while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                    time.sleep(0.05)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
        for f in files:
            f.close()
        if preloader is not None:
            preloader.close()
        del store
    logs = {r: (log_dir / f"rank{r}.log").read_text(errors="replace") for r in range(nproc)}
    return JobResult(
        returncodes=[p.returncode for p in procs], logs=logs, log_dir=log_dir,
        timed_out=timed_out, elapsed_s=time.monotonic() - start,
    )


def run_launched(launch_args: Sequence[str], script_args: Sequence[str], log_dir: Path,
                 timeout_s: float = 400.0, env: dict[str, str] | None = None,
                 script: Path = PRETRAIN_GPT, term_at: str | None = None,
                 on_port: Callable[[int], None] | None = None) -> JobResult:
    """Run a job under one deadpool-launch; its combined output is logs[0]. term_at: send
    SIGTERM to the launcher and its workers when this text appears in the output. on_port:
    see run_hosts."""
    return run_hosts([list(launch_args)], script_args, log_dir, timeout_s, env, script,
                     term_host=(0, term_at) if term_at else None, on_port=on_port)


PORT = re.compile(r"control plane on [^:\s]+:(\d+)")
# A console line made from a worker's output (launch/console.py), not the launcher's own.
FROM_WORKERS = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ (status|job|workers|[ws][\d.]+)\] ")


def _worker_logs(directory: Path) -> list[Path]:
    """Every worker log under a launcher's --log-dir, epoch by epoch, ranks in order."""
    def order(path: Path) -> tuple:
        epoch = int(path.parent.name.removeprefix("epoch") or 0)
        name = path.stem
        return (epoch, name[0] != "w", [int(n) for n in re.findall(r"\d+", name)])
    return sorted(directory.glob("epoch*/*.log"), key=order)


def _host_output(console: Path, workers: Path) -> str:
    """The launcher's own lines and every worker's full log (see JobResult.logs)."""
    own = "".join(line for line in console.read_text(errors="replace").splitlines(True)
                  if not FROM_WORKERS.match(line))
    return own + "".join(path.read_text(errors="replace") for path in _worker_logs(workers))


def job_token_file(directory: Path) -> Path:
    """A job token file readable by its owner only, as every host of a job is given."""
    from deadpool_megatron.control.auth import new_token

    path = directory / "job.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_token())
    return path


def run_hosts(hosts: Sequence[Sequence[str]], script_args: Sequence[str], log_dir: Path,
              timeout_s: float = 400.0, env: dict[str, str] | None = None,
              script: Path = PRETRAIN_GPT,
              kill_host: tuple[int, str, float] | None = None,
              restart_host: Sequence[str] | None = None,
              freeze_host: tuple[int, str, str] | None = None,
              term_host: tuple[int, str] | None = None,
              on_port: Callable[[int], None] | None = None,
              hold: threading.Event | None = None) -> JobResult:
    """One deadpool-launch per simulated host on this machine, as under Slurm: host 0 picks
    a free control-plane port, which the others are then given (no free-port race).
    logs[h] is host h's combined output. kill_host=(h, text, delay): SIGKILL host h's
    launcher with all its workers `delay` s after `text` appears in any host's log (a lost
    host). restart_host: the killed host's launcher is started again at once with these
    flags (a host restarted after a crash or a repair); returncodes[h] is then the new one's.
    freeze_host=(h, text, thaw): SIGSTOP host h's launcher and workers when `text` appears
    in its log, SIGCONT them when `thaw` appears in host 0's (a host cut off for a while).
    term_host=(h, text): SIGTERM to host h's launcher and workers when `text` appears in its
    log (a scheduler stopping the job). on_port(port): called in a thread of its own once
    host 0 printed its control-plane port (e.g. to inject faults from outside with
    deadpool-inject; it must bound its own waits). hold: hosts 1.. are launched only once
    it is set (or at the deadline): the job cannot train before (generation 0 needs every
    host), so what on_port does first is certain to come before the job's first iteration.
    Every launcher is killed, with its workers, at the deadline."""
    log_dir.mkdir(parents=True, exist_ok=True)
    run_env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})}
    paths = [log_dir / ("launcher.log" if len(hosts) == 1 else f"host{h}.log")
             for h in range(len(hosts))]
    worker_dirs = [log_dir / ("workers" if len(hosts) == 1 else f"host{h}-workers")
                   for h in range(len(hosts))]
    files = [open(path, "w") for path in paths]
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    deadline = start + timeout_s
    timed_out, killed_at, frozen, termed = False, None, None, False
    outside: threading.Thread | None = None

    def text(h: int) -> str:
        return _host_output(paths[h], worker_dirs[h])

    def launch(h: int, port_args: list[str], flags: Sequence[str] | None = None) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deadpool_megatron.launch",
             *(hosts[h] if flags is None else flags), *port_args,
             "--log-dir", str(worker_dirs[h]), str(script), *script_args], stdout=files[h],
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=run_env, cwd=str(REPO),
            start_new_session=True)
        if h < len(procs):
            procs[h] = proc  # started again
        else:
            procs.append(proc)

    try:
        multi = ["--nnodes", str(len(hosts))] if len(hosts) > 1 else []
        if multi and not any("--job-token-file" in h for h in hosts):
            multi += ["--job-token-file", str(job_token_file(log_dir))]
        launch(0, [*multi, "--node-rank", "0"] if multi else [])
        port = None
        while port is None and (len(hosts) > 1 or on_port is not None):
            found = PORT.search(paths[0].read_text(errors="replace"))
            port = found.group(1) if found else None
            if procs[0].poll() is not None or time.monotonic() > deadline:
                timed_out = procs[0].poll() is None
                break
            time.sleep(0.05)
        if on_port is not None and port is not None:
            outside = threading.Thread(target=on_port, args=(int(port),), daemon=True)
            outside.start()
        if hold is not None and port is not None:
            hold.wait(max(0.0, deadline - time.monotonic()))
        for h in range(1, len(hosts) if port else 0):
            launch(h, [*multi, "--node-rank", str(h), "--master-port", port])
        while any(p.poll() is None for p in procs) and not timed_out:
            if time.monotonic() > deadline:
                timed_out = True
            elif kill_host is not None and killed_at is None and \
                    any(kill_host[1] in text(h) for h in range(len(paths))):
                killed_at = time.monotonic() + kill_host[2]
            elif killed_at is not None and time.monotonic() >= killed_at:
                _kill_group(procs[kill_host[0]])
                killed_at = float("inf")
                if restart_host is not None:
                    launch(kill_host[0], [*multi, "--node-rank", str(kill_host[0]),
                                          "--master-port", str(port)], restart_host)
            elif freeze_host is not None and frozen is None and \
                    freeze_host[1] in text(freeze_host[0]):
                os.killpg(procs[freeze_host[0]].pid, signal.SIGSTOP)
                frozen = True
            elif term_host is not None and not termed and \
                    term_host[1] in text(term_host[0]):
                os.killpg(procs[term_host[0]].pid, signal.SIGTERM)
                termed = True
            elif frozen and freeze_host[2] in text(0):
                os.killpg(procs[freeze_host[0]].pid, signal.SIGCONT)
                frozen = False
            time.sleep(0.05)
    finally:
        if outside is not None:
            outside.join(timeout=60)
        for proc in procs:
            if frozen:
                os.killpg(proc.pid, signal.SIGCONT)
            _kill_group(proc)  # each launcher's workers share its session
        for f in files:
            f.close()
    return JobResult(returncodes=[p.returncode for p in procs],
                     logs={h: text(h) for h in range(len(paths))},
                     log_dir=log_dir, timed_out=timed_out, elapsed_s=time.monotonic() - start,
                     consoles={h: path.read_text(errors="replace")
                               for h, path in enumerate(paths)})
