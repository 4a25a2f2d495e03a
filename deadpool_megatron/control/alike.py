"""Errors a spare would meet too: when ranks failing of their own errors end hot-swap.

A spare takes a failed rank's place and redoes its work. That cures a fault of the rank's
machine (a GPU, a host), not one of the work itself: a configuration every rank meets, a
NaN, a bad sample, a bug at some iteration. Such errors show as the same error on several
ranks, or again on the spare. Replacing them rank by rank would only spend the spares, and
then end as 'spares exhausted' or 'shards lost', the real cause in the workers' logs.
An error that names a fault of the machine itself (MACHINE_SIGNS: a GPU's uncorrectable
memory or link error, a GPU gone from its bus) is never alike: two such errors in one
iteration are two machines' faults, each cured by a spare. The signs are CUDA's and the
driver's own words for hardware, kept narrow on purpose: an error that is sometimes the
work's (an illegal address, an unspecified launch failure, out of memory) is not one.
Pure functions over plain data, as the other policies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


# CUDA runtime's and driver's messages for a fault of the GPU or its links, not of the
# work (cudaErrorECCUncorrectable, cudaErrorNvlinkUncorrectable, cudaErrorHardwareStackError,
# the driver's "fallen off the bus" and "GPU is lost").
MACHINE_SIGNS = (
    "uncorrectable ECC error", "uncorrectable NVLink error", "hardware stack error",
    "fallen off the bus", "GPU is lost",
)


def names_a_machine(kind: str) -> bool:
    """Whether an error's kind (error_kind) names a fault of the machine, never alike."""
    return any(sign.lower() in kind.lower() for sign in MACHINE_SIGNS)


def error_kind(report: str, host_name: str = "") -> str:
    """What two workers' own errors share when they are alike: the report's first line with
    the reporter's identity masked (its host name, and every number: rank, device,
    iteration, port). Empty for an empty report."""
    lines = report.strip().splitlines()
    if not lines:
        return ""
    first = lines[0]
    if host_name:
        first = re.sub(rf"(?<![\w.-]){re.escape(host_name)}(?![\w-])", "HOST", first)
    return re.sub(r"\d+", "N", first)


@dataclass(frozen=True)
class Failure:
    """One failure of a rank's worker as host 0 saw it."""
    worker: str
    rank: int
    generation: int  # current when host 0 saw it
    kind: str = ""  # error_kind of its own error's report; "" for a kill, hang or lost host
    iteration: int | None = None  # the training iteration of its own error (None: before)
    text: str = ""  # the report's first line, for the message
    after: bool = False  # between `iteration` and the next (a save, an evaluation)

    @property
    def when(self) -> str:
        return (f"after iteration {self.iteration}, outside its training step" if self.after
                else f"in iteration {self.iteration}")


def alike_before_built(failures: list[Failure]) -> Failure | None:
    """Two or more own errors, all alike, before the job had built its state: the
    configuration's or the machine image's (a flag Megatron accepts but cannot run here, a
    missing package). None if fewer than two, or if they differ: then each is a rank's own
    failure, replaced as usual."""
    own = [f for f in failures if f.kind and not names_a_machine(f.kind)]
    if len(own) < 2 or len({f.kind for f in own}) != 1:
        return None
    return min(own, key=lambda f: f.worker)


def alike_in_training(failures: list[Failure], ranks_per_node: int) -> list[Failure]:
    """Own errors in training that a spare would meet too (empty if none), either
    - alike, in the same iteration, on ranks of two failure domains or more: a machine's
      fault stays in its machine; an error of the computation follows the data through
      every domain (a NaN spreads through the pipeline and the gradient reduction), and
      one of the job's storage reaches every writer (a full file system in a save); or
    - alike, in the same iteration, twice on one rank: the spare that redid the rank's work
      met its predecessor's error.
    The same iteration is the same place in it: in its step, or after it (between it and
    the next: a save, an evaluation).
    They must be the only failures of the generations in which they came: a dead peer's
    consequences can look alike on many ranks, and are not an error of their own."""
    groups: dict[tuple[str, int, bool], list[Failure]] = {}
    for f in failures:
        if f.kind and f.iteration is not None and not names_a_machine(f.kind):
            groups.setdefault((f.kind, f.iteration, f.after), []).append(f)
    for key, group in sorted(groups.items(), key=lambda item: item[0][1:]):
        ranks = [f.rank for f in group]
        domains = {r // ranks_per_node for r in ranks}
        if len(domains) < 2 and len(set(ranks)) == len(ranks):
            continue
        generations = {f.generation for f in group}
        if all((f.kind, f.iteration, f.after) == key for f in failures
               if f.generation in generations):
            return group
    return []
