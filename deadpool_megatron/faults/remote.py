"""Faults injected into a running job through its control plane (deadpool-inject).

A request is a signed JSON value under the current epoch's prefix, `dp/inject/<id>`, then a
bump of `dp/injects`. Its target is resolved by the injector against the current
generation's members, so it names worker processes, not ranks: after a hot swap, rank 5 may
be a spare. Two deliveries:
- `signal` (kill, term, hang with neither iter= nor phase=): a signal request per worker,
  `dp/signal/<worker>`, that the launcher of the host running that worker carries out (it
  wakes on the kill counter, as for host 0's kill requests);
- `worker` (raise, and anything with iter= or phase=): the launcher of the worker's host
  (woken by the same counter) nudges the worker (faults/nudge.py: a counter in shared
  memory); the worker's own FaultInjector then reads the new requests at its next
  iteration boundary and fires them like a --deadpool-inject fault. A worker reads the
  store only when nudged (and once when it starts training), so thousands of ranks do not
  each query host 0 every iteration.
Host 0's coordinator logs each request as a `fault_requested` event.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import asdict, dataclass

from deadpool_megatron.control import keys
from deadpool_megatron.faults.spec import FaultSpec, FaultSpecError, parse_fault, target_ranks
from deadpool_megatron.topology import ParallelSizes

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "hang": signal.SIGSTOP}
log = logging.getLogger("deadpool_megatron.faults")


@dataclass(frozen=True)
class JobShape:
    """What host 0's launcher publishes so a target can be resolved from outside."""
    world: int
    tp: int
    pp: int
    cp: int
    ranks_per_node: int

    def sizes(self) -> ParallelSizes:
        return ParallelSizes.from_world(self.world, self.tp, self.pp, self.cp)


@dataclass(frozen=True)
class InjectRequest:
    id: int
    spec: str  # as given, in the --deadpool-inject grammar (iter=/phase= optional)
    ranks: list[int]
    workers: list[str]  # the current members holding those ranks
    generation: int  # the generation they were resolved against
    delivery: str  # "signal" (the workers' launchers) or "worker" (their FaultInjector)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> "InjectRequest":
        data = json.loads(raw)
        return cls(id=int(data["id"]), spec=str(data["spec"]),
                   ranks=[int(r) for r in data["ranks"]],
                   workers=[str(w) for w in data["workers"]],
                   generation=int(data["generation"]), delivery=str(data["delivery"]))

    @property
    def fault(self) -> FaultSpec:
        return parse_fault(self.spec, when_required=False)


def job_shape(tp: int, pp: int, cp: int, world: int, ranks_per_node: int) -> dict:
    """The shape host 0 publishes, from the training script's own flags."""
    return asdict(JobShape(world=world, tp=tp, pp=pp, cp=cp, ranks_per_node=ranks_per_node))


def delivery_of(fault: FaultSpec) -> str:
    if fault.action == "corrupt":
        raise FaultSpecError(f"'{fault}': corrupt applies to a snapshot being taken; use it "
                             "with --deadpool-inject at launch")
    now = fault.iteration is None and fault.phase is None and not fault.after_commit
    return "signal" if now and fault.action in SIGNALS else "worker"


def resolve(fault: FaultSpec, shape: JobShape, members: dict[int, str]) -> list[int]:
    """The ranks the fault hits (errors name what is out of range)."""
    ranks = target_ranks(fault, shape.sizes(), shape.ranks_per_node)
    missing = [r for r in ranks if r not in members]
    if missing:
        raise FaultSpecError(f"'{fault}': ranks {missing} are not in the current membership")
    return ranks


class RequestReader:
    """Reads the requests in id order, once each. An id handed out whose request is not
    written yet stops the read there (its writer is between `add` and `set`), for at most
    GAP_GRACE_S: a deadpool-inject that died between the two would otherwise stall every
    reader for good, so its id is then skipped (with a warning)."""

    GAP_GRACE_S = 10.0

    def __init__(self) -> None:
        self.seen = 0
        self.waiting = False  # the last read stopped at an id not written yet
        self._gap: tuple[int, float] | None = None  # (missing id, when first seen missing)

    def read(self, store, now: float | None = None) -> list[InjectRequest]:
        """The new requests (one counter read when there are none)."""
        now = time.monotonic() if now is None else now
        count = store.add(keys.INJECTS, 0)
        out: list[InjectRequest] = []
        self.waiting = False
        while self.seen < count:
            key = keys.inject_request(self.seen + 1)
            if not store.check([key]):
                if not self._gap_expired(self.seen + 1, now):
                    self.waiting = True  # its writer has not written it yet: read again
                    break
                log.warning("deadpool-inject request #%d was never written (its writer "
                            "died?); skipped", self.seen + 1)
                self.seen += 1
                continue
            self.seen += 1
            raw = store.read(key)  # None: not signed with the job token (logged by the store)
            if raw is not None:
                try:
                    out.append(InjectRequest.from_json(raw))
                except (ValueError, KeyError, TypeError):
                    pass
        return out

    def _gap_expired(self, missing: int, now: float) -> bool:
        if self._gap is None or self._gap[0] != missing:
            self._gap = (missing, now)
        return now - self._gap[1] >= self.GAP_GRACE_S
