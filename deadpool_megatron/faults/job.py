"""A running job's control plane seen from outside: what deadpool-inject reads and writes.

Every read of a value that matters is authenticated with the job token (control/auth.py);
every write is signed with it, so the job acts on nothing else.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

from deadpool_megatron.control import keys
from deadpool_megatron.control.auth import SignedStore
from deadpool_megatron.faults.remote import (
    SIGNALS,
    InjectRequest,
    JobShape,
    delivery_of,
    resolve,
)
from deadpool_megatron.faults.spec import parse_fault

POLL_S = 0.05


class InjectError(RuntimeError):
    """The job cannot take the fault; the message says why and what to change."""


class JobEnded(InjectError):
    """The job has ended (or its control plane is gone)."""


@dataclass(frozen=True)
class Progress:
    generation: int
    iteration: int  # the lowest iteration any current member has reached
    members: dict[int, str]
    epoch: int = 0  # launches of the job's workers (a restart from --save begins the next)


class JobControl:
    """One connection to host 0's store (`deadpool-launch` at MASTER_ADDR:MASTER_PORT)."""

    def __init__(self, addr: str, port: int, token: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.where, self.timeout_s = f"{addr}:{port}", timeout_s
        try:
            self.raw = dist.TCPStore(addr, port, is_master=False,
                                     timeout=timedelta(seconds=timeout_s))
        except (dist.DistError, RuntimeError) as err:
            raise InjectError(f"job not reachable at {self.where} within {timeout_s:.0f} s "
                              f"({str(err).splitlines()[0][:200]}): is deadpool-launch "
                              f"running there (its log prints 'control plane on HOST:PORT')?"
                              ) from None
        self.root = SignedStore(self.raw, token)
        self.layout = json.loads(self._root_value(keys.LAYOUT))
        if "shape" not in self.layout:
            raise InjectError(f"the job at {self.where} was launched by a deadpool-launch "
                              f"without deadpool-inject support")
        self.shape = JobShape(**self.layout["shape"])
        self.store = self._epoch_store()

    def _root_value(self, key: str) -> bytes:
        """A root key host 0 writes: waits while unset (bounded), refuses a wrong token."""
        deadline = time.monotonic() + self.timeout_s
        while not self.raw.check([key]):
            if time.monotonic() > deadline:
                raise InjectError(f"{self.where} has no {key} after {self.timeout_s:.0f} s: "
                                  f"not a deadpool-launch control plane, or host 0 is still "
                                  f"starting")
            time.sleep(POLL_S)
        value = self.root.read(key)
        if value is None:
            raise InjectError(f"wrong job token: the job at {self.where} signs its control "
                              f"plane with another token; pass the --job-token-file the job "
                              f"was launched with")
        return value

    def _epoch_store(self) -> SignedStore:
        self.check_running()
        epoch = int(self._root_value(keys.EPOCH))
        return SignedStore(self.raw, self.root.token, keys.epoch_prefix(epoch))

    def check_running(self) -> None:
        try:
            end = self.root.read(keys.END) if self.raw.check([keys.END]) else None
        except RuntimeError as err:  # torch's DistError: host 0's launcher is gone
            raise JobEnded(f"lost the control plane at {self.where}: "
                           f"{str(err).splitlines()[0][:200]}") from None
        if end is not None:
            raise JobEnded(f"the job at {self.where} has ended (exit status "
                           f"{end.decode(errors='replace')})")

    def progress(self) -> Progress:
        """The current generation, its members and the lowest iteration they reached."""
        import torch.distributed as dist

        try:
            self.check_running()
            epoch = int(self._root_value(keys.EPOCH))
            if self.store.prefix != keys.epoch_prefix(epoch):  # a restart from --save
                self.store = SignedStore(self.raw, self.root.token, keys.epoch_prefix(epoch))
            generation = int(self.store.read(keys.GENERATION) or b"0")
            raw = self.store.read(keys.members(generation))
            members = {int(r): w for r, w in json.loads(raw or b"{}").items()}
            hosts = [keys.host_report(h) for h in range(self.layout["nnodes"])]
            present = [k for k in hosts if self.store.check([k])]
            views: dict[str, dict] = {}
            for raw_report in self.store.read_many(present) if present else []:
                if raw_report is not None:
                    report = json.loads(raw_report)
                    views.update(report.get("workers", {}))
                    views.update({w: {"g": g, "it": it}
                                  for w, (g, it) in report.get("it", {}).items()})
        except dist.DistError as err:
            raise JobEnded(f"lost the control plane at {self.where}: "
                           f"{str(err).splitlines()[0][:200]}") from None
        reached = [int(views[w]["it"]) if w in views and int(views[w]["g"]) == generation
                   else -1 for w in members.values()]
        return Progress(generation, min(reached, default=-1), members, epoch)

    def wait_taken(self, injected: Progress, timeout_s: float) -> Progress:
        """Wait until a fault injected at `injected` has been acted on: a newer generation
        declared (the failed ranks replaced) or a restart. Until then the job may go on for
        iterations (a signal is delivered by the target's launcher, a hang found only at the
        progress timeout), and a wait for iterations alone would count them as quiet ones
        after a recovery that has not begun."""
        deadline = time.monotonic() + timeout_s
        while True:
            p = self.progress()
            if (p.epoch, p.generation) > (injected.epoch, injected.generation):
                return p
            if time.monotonic() > deadline:
                raise InjectError(f"the job at {self.where} declared no generation after "
                                  f"{injected.generation} within {timeout_s:.0f} s of a fault")
            time.sleep(POLL_S)

    def wait_for(self, iteration: int, timeout_s: float) -> Progress:
        """Wait until every member of the current generation has reached `iteration` in
        it (so a recovery in progress is waited out too)."""
        deadline = time.monotonic() + timeout_s
        while True:
            p = self.progress()
            if p.iteration >= iteration:
                return p
            if time.monotonic() > deadline:
                raise InjectError(f"the job at {self.where} did not reach iteration "
                                  f"{iteration} within {timeout_s:.0f} s (generation "
                                  f"{p.generation}, every rank at {p.iteration} or later)")
            time.sleep(POLL_S)

    def inject(self, spec: str) -> tuple[InjectRequest, Progress]:
        """Resolve `spec` against the current members and write the request."""
        fault = parse_fault(spec, when_required=False)
        delivery = delivery_of(fault)
        p = self.progress()
        ranks = resolve(fault, self.shape, p.members)
        request_id = self.store.add(keys.INJECT_IDS, 1)
        request = InjectRequest(id=request_id, spec=spec, ranks=ranks,
                                workers=[p.members[r] for r in ranks],
                                generation=p.generation, delivery=delivery)
        self.store.set(keys.inject_request(request_id), request.to_json())
        if delivery == "signal":
            assert fault.action in SIGNALS
            for worker in request.workers:
                self.store.set(keys.signal_request(worker),
                               json.dumps({"id": request_id, "action": fault.action}))
        self.store.add(keys.INJECTS, 1)
        self.store.add(keys.KILLS, 1)  # wakes the launchers (a signal, or a nudge)
        return request, p
