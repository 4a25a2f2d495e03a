"""What the launcher's console shows of its workers' output: pure functions over lines.

Every worker's full output stays in its log file (launch/console.py); the console is for
a person. It shows a status line per iteration (from the iteration line a worker already
prints: no new work in the training loop), the fault-tolerance events, every traceback and
stack dump, and each third-party warning or notice once, with the number of workers that
printed it, instead of once per process. Routine lines of our own workers (a spare
waiting, each survivor noting the broken generation) stay in the files.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

# Megatron's iteration line (training/loop.py), printed by one rank per iteration.
ITERATION = re.compile(r"iteration +(\d+)/ *(\d+) \|.*?elapsed time per iteration \(ms\): "
                       r"([0-9.]+).*?lm loss: ([0-9.E+-]+|nan|inf)")
# The workers' own log format (training/main.py): "[2026-12-01 03:31:27,758 rank5] message".
OWN = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank[^\]]*\] (.*)$")
# Messages of our own code (as opposed to a library logging through the same handler):
# shown at once, in order with the status lines; anything else is held and deduplicated.
OURS = re.compile(r"^(rank \d+:|spare \S+ |recovery:|deadpool|restore check:|"
                  r"injecting fault|training GPT:|loaded |saved checkpoint|no checkpoint|"
                  r"worker \S+:|control plane:|group audit|aborting the broken)")
# Our own messages that only repeat what the launcher's events already say, or are routine.
ROUTINE = re.compile(
    r"^(spare \S+ ready \(imports done\)|spare \S+ released:|rank \d+: generation \d+ broken|"
    r"deadpool snapshots: every|group audit on rank|aborting the broken generation|"
    r"rank \d+: job ended by the launcher: done)")
# Where a worker's stream enters a new generation (exact per stream, unlike the clock).
BROKEN = re.compile(r"^rank \d+: generation (\d+) broken")
TAKES = re.compile(r"^spare \S+ takes rank \d+ \(generation (\d+)\)")
# A traceback or a faulthandler stack dump starts a block shown whole, at once.
BLOCK_START = re.compile(r"^(Traceback \(most recent call last\):|Fatal Python error|"
                         r"(Current thread|Thread) 0x[0-9a-f]+ |Stack \(most recent call first\)|"
                         r"During handling of the above exception|"
                         r"The above exception was the direct cause)")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: .*)?$")
# A Python warning's header: "path.py:29: UserWarning: message".
WARNING = re.compile(r"^(\S+?\.py):(\d+): (\w*Warning): (.*)$")
# torch's C++ log lines ("[W1201 03:41:48.010299115 socket.cpp:469] [c10d] ..."): their
# numbers (time, sockets, ports) differ per process while they say the same thing.
NUMBERED_NOTICE = re.compile(r"^\[[WIEF]\d{4} [\d:.]+ ")
# A third-party line waits for its copies from the other workers until every worker sent
# one, or none came for HOLD_S, or MAX_HOLD_S have passed since the first.
HOLD_S = 2.0
MAX_HOLD_S = 5.0
MAX_REMEMBERED = 10_000


@dataclass(frozen=True)
class Iteration:
    iteration: int
    total: int
    ms: float
    loss: float


@dataclass(frozen=True)
class JobView:
    """What host 0's coordinator knows that no worker line says (plain data)."""
    generation: int
    spares_left: int
    declared_wall: float  # when that generation was declared (time.time())


@dataclass
class _Stream:
    generation: int = 0
    in_block: bool = False
    record: list[str] = field(default_factory=list)  # an open third-party record


@dataclass
class _Pending:
    first_seen: float
    last_seen: float
    lines: list[str]
    workers: set[str]

    def ready(self, now: float, expected: int, hold_s: float, max_hold_s: float) -> bool:
        return (len(self.workers) >= expected or now - self.last_seen >= hold_s
                or now - self.first_seen >= max_hold_s)


def parse_iteration(line: str) -> Iteration | None:
    m = ITERATION.search(line)
    if m is None:
        return None
    return Iteration(int(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4)))


def own_message(line: str) -> tuple[str, str] | None:
    """(timestamp, message) of a line in the workers' own log format, else None."""
    m = OWN.match(line)
    return (m.group(1), m.group(2)) if m else None


def short_path(path: str) -> str:
    """A third-party file's path from its package on (site-packages/ dropped)."""
    return path.split("site-packages/", 1)[-1]


def render_record(lines: list[str]) -> str:
    """One line for a third-party record: a Python warning without the source line that
    raised it (the log file has it); anything else as printed, lines joined."""
    m = WARNING.match(lines[0])
    if m:
        return f"{m.group(3)}: {m.group(4)} [{short_path(m.group(1))}:{m.group(2)}]"
    return " | ".join(line.strip() for line in lines)


def record_key(lines: list[str]) -> str:
    """Equal for the same notice from different processes."""
    text = "\n".join(lines)
    return re.sub(r"\d+", "#", text) if NUMBERED_NOTICE.match(lines[0]) else text


def with_count(text: str, count: int) -> str:
    return f"{text} (x{count} workers)" if count > 1 else text


def status_line(it: Iteration, generation: int, spares_left: int | None) -> str:
    spares = "" if spares_left is None else f" | spares left {spares_left}"
    return (f"iter {it.iteration}/{it.total} | loss {it.loss:.6E} | {it.ms:.0f} ms/it | "
            f"generation {generation}{spares}")


class ConsoleFilter:
    """Turns the workers' lines into the console's: feed() each worker's new complete lines,
    tick() now and then (held third-party lines come out), close() at the end. Outputs are
    (source, text): source is "status", "job", a worker id, or "workers" (deduplicated)."""

    def __init__(self, hold_s: float = HOLD_S, max_hold_s: float = MAX_HOLD_S) -> None:
        self.hold_s, self.max_hold_s = hold_s, max_hold_s
        self.streams: dict[str, _Stream] = {}
        self.pending: OrderedDict[str, _Pending] = OrderedDict()
        self.shown: OrderedDict[str, int] = OrderedDict()  # key -> copies seen
        self.recovered = 0  # the newest generation whose first iteration was reported
        self.expected = 0  # how many workers print start-up notices (the streams known)

    def add_worker(self, worker: str) -> None:
        self.streams.setdefault(worker, _Stream())
        self.expected = len(self.streams)

    def feed(self, worker: str, lines: list[str], now: float,
             job: JobView | None = None) -> list[tuple[str, str]]:
        self.add_worker(worker)
        stream, out = self.streams[worker], []
        for line in lines:
            out += self._line(worker, stream, line, now, job)
        self._close_record(worker, stream, now)  # a record is written in one go
        return out + self.tick(now)

    def _line(self, worker: str, stream: _Stream, line: str, now: float,
              job: JobView | None) -> list[tuple[str, str]]:
        if stream.in_block:
            if not line.strip() or line[0].isspace() or BLOCK_START.match(line):
                return [(worker, line)]
            stream.in_block = False
            if EXCEPTION_LINE.match(line):
                return [(worker, line)]  # the exception that ends a traceback
        if BLOCK_START.match(line):
            self._close_record(worker, stream, now)
            stream.in_block = True
            return [(worker, line)]
        if stream.record and line[:1].isspace():
            stream.record.append(line)  # a warning's source line, a wrapped notice
            return []
        self._close_record(worker, stream, now)
        it = parse_iteration(line)
        if it is not None:
            return self._status(it, stream.generation, job, own_message(line))
        own = own_message(line)
        if own is not None:
            message = own[1]
            if (m := BROKEN.match(message)) is not None:
                stream.generation = max(stream.generation, int(m.group(1)) + 1)
            elif (m := TAKES.match(message)) is not None:
                stream.generation = max(stream.generation, int(m.group(1)))
            if ROUTINE.match(message):
                return []
            if OURS.match(message):
                return [(worker, message)]
            stream.record = [message]  # a library's message through our log format
            return []
        if line.strip():
            stream.record = [line]
        return []

    def _status(self, it: Iteration, generation: int, job: JobView | None,
                own: tuple[str, str] | None) -> list[tuple[str, str]]:
        out = []
        if generation > self.recovered:
            self.recovered = generation
            took = ""
            if job is not None and job.generation == generation and own is not None:
                took = f", {_wall(own[0]) - job.declared_wall:.2f} s after it was declared"
            out.append(("job", f"recovery done: generation {generation} completed "
                               f"iteration {it.iteration}{took}"))
        spares = job.spares_left if job is not None else None
        out.append(("status", status_line(it, generation, spares)))
        return out

    def _close_record(self, worker: str, stream: _Stream, now: float) -> None:
        if not stream.record:
            return
        lines, stream.record = stream.record, []
        key = record_key(lines)
        if key in self.shown:
            self.shown[key] += 1
            return
        pending = self.pending.setdefault(key, _Pending(now, now, lines, set()))
        if worker not in pending.workers:  # a worker repeating itself does not hold it back
            pending.workers.add(worker)
            pending.last_seen = now

    def tick(self, now: float) -> list[tuple[str, str]]:
        """Held lines whose copies are all in, or whose wait is over, in arrival order."""
        return [self._show(key) for key, held in list(self.pending.items())
                if held.ready(now, self.expected, self.hold_s, self.max_hold_s)]

    def _show(self, key: str) -> tuple[str, str]:
        head = self.pending.pop(key)
        self.shown[key] = len(head.workers)
        while len(self.shown) > MAX_REMEMBERED:
            self.shown.popitem(last=False)
        source = "workers" if len(head.workers) > 1 else next(iter(head.workers))
        return (source, with_count(render_record(head.lines), len(head.workers)))

    def close(self, now: float) -> list[tuple[str, str]]:
        for worker, stream in self.streams.items():
            self._close_record(worker, stream, now)
        return [self._show(key) for key in list(self.pending)]


def _wall(stamp: str) -> float:
    """A worker log timestamp (local time) as time.time()."""
    import datetime

    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
