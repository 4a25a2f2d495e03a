"""The recovery plan, a pure function of what every rank reports: which snapshot everyone
continues from, who restores what from where, and which micro-batches each rank computes
again. Plain data in and out, so it is tested at 100,000 simulated ranks.

The rules:
- The target T is the newest snapshot iteration that every survivor can stand on (it holds
  its own copy of T complete, or its live state is T) and whose copy of every replaced rank
  is complete on that rank's buddy. A buddy's copy without the replicated region (the
  rank's data-parallel peers hold those bytes, snapshot/manifest.py) counts only if one of
  its named holders (its source first, topology/replicas.py) is no spare and still holds T
  in its own slots; the replaced rank then takes the region from the first such holder
  (`replica_from`). Holders that all died too (topology.replicas_lost) leave no such T:
  the recovery is impossible, and says so.
- A replaced rank (a spare), or one that holds no snapshot of its own, restores from its
  buddy; a survivor whose live state is T restores nothing; any other survivor (it stepped
  past T, or a step was cut short) rolls back to its own copy of T. A partly stepped
  optimizer is never used: its live state does not count.
- Iteration T+1: a data-parallel replica whose every rank restored nothing and holds T+1's
  micro-batches accumulated, unreduced, keeps its gradients and recomputes nothing. Every
  other replica recomputes its micro-batches of T+1 from zeroed gradients, in their
  original order (bit-identical), or, with mode "spread", the lost micro-batches are dealt
  over all replicas (each computed once; not bit-identical: floating-point sums reassociate).
- Iterations T+2 .. F (the last one any rank had worked on) are recomputed whole: a deeper
  rollback happens only when snapshot T+1 is not complete everywhere.
- No common snapshot, but no survivor has begun an iteration since the job's start (a
  failure before the starting state's snapshot committed): every rank builds its state again
  as the start did (seeded initialisation, or the --load checkpoint): FRESH_START.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from deadpool_megatron.control.policy import RecoveryImpossible

MODES = ("local", "spread")
Holders = Sequence[Sequence[int]]  # per rank, the peers holding its replicated bytes
FRESH_START = -1  # the target of a plan that rebuilds the starting state


@dataclass(frozen=True)
class MicrobatchWork:
    """What one rank computes in one iteration."""

    keep_grads: bool = False  # gradients accumulated before a failure stay (not zeroed)
    # (data-parallel rank, index) pairs to compute; None: this rank's own N micro-batches.
    microbatches: tuple[tuple[int, int], ...] | None = None

    def items(self, dp_rank: int, num_microbatches: int) -> list[tuple[int, int]]:
        if self.microbatches is None:
            return [(dp_rank, i) for i in range(num_microbatches)]
        return list(self.microbatches)

    def count(self, num_microbatches: int) -> int:
        return num_microbatches if self.microbatches is None else len(self.microbatches)


OWN_MICROBATCHES = MicrobatchWork()
KEEP = MicrobatchWork(keep_grads=True, microbatches=())


@dataclass(frozen=True)
class RankReport:
    """One rank of the new generation, as it reports itself to the recovery."""

    own: tuple[int, ...]  # snapshot iterations of its own shard it holds complete
    ward: tuple[int, ...]  # snapshot iterations of its ward's shard it holds complete
    live: int | None  # completed iteration its live state is at (None: not usable)
    grads_intact: bool  # live+1's micro-batches all accumulated, unreduced
    reached: int  # the last iteration it did any work on
    at_start: bool = False  # its live state is the job's starting state, nothing begun since
    ward_partial: tuple[int, ...] = ()  # of `ward`, copies without the replicated region

    def plain(self) -> dict[str, Any]:
        """As plain data, for the all-gather of the recovery (never pickled)."""
        return {"own": list(self.own), "ward": list(self.ward), "live": self.live,
                "grads_intact": self.grads_intact, "reached": self.reached,
                "at_start": self.at_start, "ward_partial": list(self.ward_partial)}

    @classmethod
    def from_plain(cls, d: Any) -> "RankReport":
        """Parse a peer's report; ValueError names what is malformed."""
        def ints(x: Any) -> tuple[int, ...]:
            if not isinstance(x, list) or not all(_is_int(i) for i in x):
                raise ValueError(f"expected a list of iterations, got {x!r}")
            return tuple(x)

        if not isinstance(d, dict) or set(d) != {"own", "ward", "live", "grads_intact",
                                                  "reached", "at_start", "ward_partial"}:
            raise ValueError(f"not a rank report: {d!r}")
        if not (d["live"] is None or _is_int(d["live"])) or not _is_int(d["reached"]) or \
                not isinstance(d["grads_intact"], bool) or not isinstance(d["at_start"], bool):
            raise ValueError(f"malformed rank report: {d!r}")
        return cls(ints(d["own"]), ints(d["ward"]), d["live"], d["grads_intact"], d["reached"],
                   d["at_start"], ints(d["ward_partial"]))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


SPARE_REPORT = RankReport(own=(), ward=(), live=None, grads_intact=False, reached=-1)


def _holds_nothing(rep: RankReport) -> bool:
    """No snapshot and no usable live state: a spare, or a spare that took a rank in a
    generation broken before it restored anything (it built alone, then a newer
    generation was declared). With every other rank at the job's start, that is a fresh
    start (chaos soak seed 215: a whole node lost as a restarted epoch began, the spares
    that took it were counted as holding trained state, and hot-swap ended)."""
    return rep.live is None and not rep.own and not rep.ward


@dataclass(frozen=True)
class RecoveryPlan:
    target: int  # snapshot iteration every rank stands on after the restore
    restore: tuple[str, ...]  # per rank: "none", "own" or "buddy"
    work: tuple[dict[int, MicrobatchWork], ...]  # per rank: iteration -> work (T+1 .. F)
    last_iteration: int  # F: the last iteration any rank had worked on
    refill_ward: tuple[bool, ...]  # per rank: its ward copy of T is sent to it (a spare)
    num_microbatches: int  # per replica in iteration T+1
    # per rank: the data-parallel peer whose own slot of T gives it the replicated region
    # (its buddy holds T without it); None: nothing to take from a peer
    replica_from: tuple[int | None, ...] = ()
    # per replica in each of T+1 .. F where it differs from num_microbatches (a batch-size
    # schedule)
    counts: dict[int, int] = field(default_factory=dict)

    def count(self, iteration: int) -> int:
        """Micro-batches per replica in `iteration` (T+1 .. F)."""
        return self.counts.get(iteration, self.num_microbatches)

    def recomputed(self, rank: int) -> int:
        """Micro-batches `rank` computes for iterations T+1 .. F."""
        return sum(w.count(self.count(it)) for it, w in self.work[rank].items())

    def whole_iteration_replay(self) -> int:
        """What a replay of whole iterations from T would make each rank compute."""
        return sum(self.count(it) for it in range(self.target + 1, self.last_iteration + 1))

    def rewinds_rng(self, rank: int) -> bool:
        """A survivor that keeps its live state but recomputes T+1 from zeroed gradients
        must draw the same random numbers again: its RNG goes back to snapshot T's."""
        first = self.work[rank].get(self.target + 1)
        return self.restore[rank] == "none" and first is not None and not first.keep_grads


def choose_target(reports: list[RankReport], needs_buddy: list[bool],
                  buddies: list[int], holders: Holders | None = None) -> int | None:
    """The newest iteration every rank can stand on (see the module docstring)."""
    candidates: set[int] | None = None
    for rank, report in enumerate(reports):
        if needs_buddy[rank]:
            held = _held_for(rank, reports, needs_buddy, buddies, holders)
        else:
            held = set(report.own) | ({report.live} if report.live is not None else set())
        candidates = held if candidates is None else candidates & held
        if not candidates:
            return None
    return max(candidates) if candidates else None


def _held_for(rank: int, reports: list[RankReport], needs_buddy: list[bool],
              buddies: list[int], holders: Holders | None) -> set[int]:
    """Iterations a rank that restores from its buddy can get whole: the buddy's complete
    copies, and its partial ones whose replicated region one of the rank's holders holds in
    its own slots (a holder's live state does not count: only a slot can be sent)."""
    buddy = buddies[rank]
    if needs_buddy[buddy]:
        return set()
    ward = reports[buddy]
    partial = set(ward.ward_partial)
    from_peers = {t for peer in (holders[rank] if holders is not None else ())
                  if not needs_buddy[peer] for t in reports[peer].own}
    return {t for t in ward.ward if t not in partial or t in from_peers}


def _replica_source(rank: int, target: int, reports: list[RankReport],
                    needs_buddy: list[bool], holders: Holders) -> int | None:
    """The first of `rank`'s holders that can send its replicated region of `target`."""
    return next((peer for peer in holders[rank]
                 if not needs_buddy[peer] and target in reports[peer].own), None)


def plan_recovery(reports: list[RankReport], replaced: set[int], buddies: list[int],
                  replica_of: list[int], num_microbatches: int | Callable[[int], int],
                  mode: str = "local", holders: Holders | None = None) -> RecoveryPlan:
    """See the module docstring. replica_of[r] is rank r's data-parallel rank; holders[r]
    the data-parallel peers holding its replicated bytes, in the order to ask them
    (topology/replicas.py);
    num_microbatches: per replica, the same in every iteration or a function of the
    iteration (a batch-size schedule)."""
    if mode not in MODES:
        raise ValueError(f"replay mode {mode!r}: use one of {', '.join(MODES)}")
    per_iteration: Callable[[int], int] = num_microbatches if callable(num_microbatches) \
        else (lambda iteration: num_microbatches)
    world = len(reports)
    needs_buddy = [r in replaced or not reports[r].own for r in range(world)]
    target = choose_target(reports, needs_buddy, buddies, holders)
    survivors = [rep for r, rep in enumerate(reports) if r not in replaced]
    if target is None and all(rep.at_start or _holds_nothing(rep) for rep in survivors):
        return RecoveryPlan(target=FRESH_START, restore=("fresh",) * world,
                            work=tuple({} for _ in range(world)), last_iteration=FRESH_START,
                            refill_ward=(False,) * world, num_microbatches=per_iteration(1))
    if target is None:
        lost = sorted(r for r in range(world) if needs_buddy[r])
        without = _replicas_gone(lost, reports, needs_buddy, buddies, holders)
        if without:
            raise RecoveryImpossible(
                f"the replicated bytes of ranks {sorted(without)} are lost: their buddies "
                f"hold only their unique bytes, and their data-parallel holders "
                f"{sorted({p for r in without for p in without[r]})} failed too or no longer "
                f"hold the snapshot; no in-memory snapshot rebuilds them (restart from the "
                f"flush or "
                f"the newest checkpoint; --deadpool-send-replicated keeps whole copies at "
                f"the buddies)")
        raise RecoveryImpossible(
            f"no snapshot iteration is held by every survivor and by the buddies of ranks "
            f"{lost} (own/ward iterations held: "
            f"{ {r: (rep.own, rep.ward) for r, rep in enumerate(reports)} })")
    restore = tuple("buddy" if needs_buddy[r] else
                    "none" if reports[r].live == target else "own" for r in range(world))
    last = max([target] + [rep.reached for r, rep in enumerate(reports) if not needs_buddy[r]])
    replicas = sorted(set(replica_of))
    keeps = {d: True for d in replicas}
    for r in range(world):
        rep = reports[r]
        if restore[r] != "none" or not rep.grads_intact or rep.live != target:
            keeps[replica_of[r]] = False
    first_count = per_iteration(target + 1)
    work: list[dict[int, MicrobatchWork]] = [{} for _ in range(world)]
    if last > target:
        first = _first_iteration(keeps, replicas, first_count, mode)
        for r in range(world):
            work[r][target + 1] = first[replica_of[r]]
            for it in range(target + 2, last + 1):
                work[r][it] = OWN_MICROBATCHES
    wards = [0] * world
    for r, b in enumerate(buddies):
        wards[b] = r
    refill = tuple(needs_buddy[r] and not needs_buddy[wards[r]]
                   and target in reports[wards[r]].own for r in range(world))
    replica_from = tuple(
        _replica_source(r, target, reports, needs_buddy, holders) if holders is not None
        and needs_buddy[r] and target in reports[buddies[r]].ward_partial else None
        for r in range(world))
    counts = {it: per_iteration(it) for it in range(target + 2, last + 1)}
    return RecoveryPlan(target=target, restore=restore, work=tuple(work), last_iteration=last,
                        refill_ward=refill, num_microbatches=first_count,
                        replica_from=replica_from,
                        counts={it: n for it, n in counts.items() if n != first_count})


def _replicas_gone(lost: list[int], reports: list[RankReport], needs_buddy: list[bool],
                   buddies: list[int], holders: Holders | None) -> dict[int, Sequence[int]]:
    """Of the ranks restoring from their buddies, those whose buddy holds partial copies
    only and none of whose holders can give the region back: {rank: holders}."""
    gone = {}
    for r in lost:
        buddy = buddies[r]
        if needs_buddy[buddy] or not reports[buddy].ward_partial:
            continue
        if holders is not None and holders[r] \
                and not _held_for(r, reports, needs_buddy, buddies, holders):
            gone[r] = holders[r]
    return gone


def _first_iteration(keeps: dict[int, bool], replicas: list[int], num_microbatches: int,
                     mode: str) -> dict[int, MicrobatchWork]:
    """Per replica, the work of iteration T+1 (the one a failure usually cuts short)."""
    kept = [d for d in replicas if keeps[d]]
    if mode == "local" or not kept:
        return {d: KEEP if keeps[d] else OWN_MICROBATCHES for d in replicas}
    lost = [(d, i) for d in replicas if not keeps[d] for i in range(num_microbatches)]
    shares: dict[int, list[tuple[int, int]]] = {d: [] for d in replicas}
    for n, item in enumerate(lost):
        shares[replicas[n % len(replicas)]].append(item)
    return {d: MicrobatchWork(keep_grads=keeps[d], microbatches=tuple(shares[d]))
            for d in replicas}
