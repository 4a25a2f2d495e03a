"""Turn the JSON-lines events of a run into recovery timelines (one per failure)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def load_events(prefix: str | Path) -> list[dict]:
    """All `PREFIX.rank*` files (the launcher writes PREFIX.rank-1), sorted by time."""
    prefix = Path(prefix)
    events: list[dict] = []
    for path in prefix.parent.glob(prefix.name + ".rank*"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
    return sorted(events, key=lambda e: e["t"])


@dataclass(frozen=True)
class Timeline:
    """Milliseconds after the failure (the fault's own timestamp) at which each phase ended
    on the last rank to finish it."""

    generation: int
    failed_ranks: tuple[int, ...]
    detected_ms: float
    declared_ms: float
    aborted_ms: float
    left_ms: float
    rebuilt_ms: float  # groups of the new generation formed (rendezvous included)
    restored_ms: float  # state transferred and restored on every rank
    replayed_ms: float  # the iteration that failed completed again on every rank
    # Micro-batches, summed over ranks: recomputed by this recovery; what a replay of whole
    # iterations from the same snapshot, and a restart from the newest durable checkpoint,
    # would have recomputed.
    recomputed: int = 0
    whole_iteration: int = 0
    checkpoint_restart: int = 0
    # For the reports (metrics/report.py): when the failure struck (unix time), the
    # iteration it interrupted, how each failed rank was found ("exit", "exception", "hang",
    # "host"), which spare took which rank, and the spares left after the declaration (None
    # in logs written before the launcher recorded it).
    failed_at: float = float("nan")
    failed_iteration: int | None = None
    detection: tuple[str, ...] = ()
    replaced: tuple[tuple[int, str], ...] = ()
    spares_left: int | None = None

    PHASES = ("detected", "declared", "aborted", "left", "rebuilt", "restored", "replayed")

    def rows(self) -> list[tuple[str, float]]:
        return [(p, getattr(self, f"{p}_ms")) for p in self.PHASES]

    def describe(self) -> str:
        parts = ", ".join(f"{p} +{ms:.0f} ms" for p, ms in self.rows())
        return (f"recovery into generation {self.generation} (ranks {list(self.failed_ranks)}"
                f" replaced): {parts}; micro-batches recomputed {self.recomputed} (whole-"
                f"iteration replay: {self.whole_iteration}, checkpoint restart: "
                f"{self.checkpoint_restart})")


def detection_kind(detected: dict) -> str:
    """How a `failure_detected` event's failure was found. Logs written before the launcher
    recorded it: an exit with the rank's own report of its error is that error."""
    if "detection" in detected:
        return str(detected["detection"])
    how = str(detected.get("how", "exit"))
    return "exception" if how == "exit" and detected.get("reason") else how


def timelines(events: list[dict]) -> list[Timeline]:
    out = []
    declarations = [e for e in events if e["event"] == "generation_declared"]
    for i, decl in enumerate(declarations):
        gen = decl["generation"]
        failed = tuple(decl["failed_ranks"])
        since = declarations[i - 1]["t"] if i else 0.0  # the previous declaration
        # When the failure struck: an injected fault, or a rank's own error as it left.
        faults = [e for e in events if e["event"] in ("fault_injected", "rank_failed")
                  and since < e["t"] <= decl["t"] and e["rank"] in failed]
        detected = [e for e in events if e["event"] == "failure_detected"
                    and since < e["t"] <= decl["t"]]
        if not detected:
            continue
        # Without a fault event (a hang found by the progress analysis), the failure
        # struck when the culprit's progress stopped.
        t0 = min(e["t"] for e in faults) if faults else \
            min(e["t"] - e.get("stalled_s", 0.0) for e in detected)
        failed_iteration = min((e["iteration"] for e in faults if "iteration" in e),
                               default=None)

        def last(kind: str, **match: object) -> float:
            ts = [e["t"] for e in events if e["event"] == kind and e["t"] >= t0
                  and all(e.get(k) == v for k, v in match.items())]
            return 1e3 * (max(ts) - t0) if ts else float("nan")

        recovered = [e for e in events if e["event"] == "recovered" and e["generation"] == gen]
        if failed_iteration is None:  # a hang: the iteration the survivors were running
            failed_iteration = min((e["last_iteration"] for e in recovered
                                    if "last_iteration" in e), default=None)
        rebuilt = max((1e3 * (e["t"] - e["total_s"] + e["groups_s"] - t0) for e in recovered),
                      default=float("nan"))
        out.append(Timeline(
            generation=gen, failed_ranks=failed,
            detected_ms=1e3 * (max(e["t"] for e in detected) - t0),
            declared_ms=1e3 * (decl["t"] - t0),
            aborted_ms=last("abort", generation=gen - 1),
            left_ms=last("left_generation", next=gen),
            rebuilt_ms=rebuilt,
            restored_ms=last("recovered", generation=gen),
            replayed_ms=last("step_completed", iteration=failed_iteration),
            recomputed=sum(e.get("microbatches_recomputed", 0) for e in recovered),
            whole_iteration=sum(e.get("whole_iteration_replay", 0) for e in recovered),
            checkpoint_restart=sum(e.get("checkpoint_restart", 0) for e in recovered),
            failed_at=t0, failed_iteration=failed_iteration,
            detection=tuple(detection_kind(e) for e in detected),
            replaced=tuple(sorted((int(r), w) for r, w in decl.get("replaced", {}).items())),
            spares_left=decl.get("spares_left"),
        ))
    return out
