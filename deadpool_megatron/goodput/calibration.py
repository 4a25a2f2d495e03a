"""DeadPool's recovery, phase by phase, from what tools/bench_recovery.py measured, and how
each phase scales with the number of ranks N.

The measured job (TP2 x PP2 x DP N/4 on 2 shared CPU cores) gives each phase's time at
the reference size (4 ranks). A phase's time at N is

    phase(N) = phase(ref) x contention(N) ** e + extra(N)

- contention(N): how much slower every rank runs at N than at the reference because the
  ranks share the machine's cores; on the CPU rehearsal the measured iteration time ratio
  iteration(N) / iteration(ref) (an input from the same benchmark, not the predicted
  quantity); on a cluster, where every rank has its own GPU and cores, 1.
- e = 1 for phases that every rank works through at once (detect: the killed process is
  torn down while every other rank trains; leave; rebuild: every rank makes its groups;
  restore), e = 0 for phases one process or one replica does while the rest wait (declare:
  the coordinator; replay: the failed replica recomputes its micro-batches).
- extra(N): what the CPU run does not contain, by stated formula (strategies.py): the
  control plane's per-rank cost, NCCL's abort and communicator set-up, the shard's transfer
  over the NIC. The detection of a lost host or a hang is a timeout, not a measured phase.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MEASURED = Path(__file__).resolve().parent / "measured" / "bench_recovery_cpu.json"
PHASES = ("detect", "declare", "leave", "rebuild", "restore", "replay")
CONTENTION_EXPONENT = {"detect": 1, "declare": 0, "leave": 1, "rebuild": 1, "restore": 1,
                       "replay": 0}
REFERENCE_RANKS = 4


@dataclass(frozen=True)
class MeasuredPhases:
    """One world size's medians (seconds), each phase's own duration."""

    ranks: int
    iteration_s: float
    kill_to_done_s: float
    max_kill_to_done_s: float
    durations: dict[str, float]

    @property
    def replay_ratio(self) -> float:
        """The failed iteration done again, in failure-free iterations."""
        return self.durations["replay"] / self.iteration_s


@dataclass(frozen=True)
class Platform:
    """Where the recovery runs: see the module docstring."""

    contention: float = 1.0
    detect_s: float | None = None  # None: the measured process-exit detection, scaled
    iteration_s: float | None = None  # the replay's iteration; None: the measured one
    replay_fraction: float = 1.0  # local replay 1; spread: JobShape.spread_fraction()
    extra_s: dict[str, float] = field(default_factory=dict)


def from_bench(world: int, entry: dict) -> MeasuredPhases:
    """bench_recovery.py's --out entry for one world size (cumulative ms after the kill)."""
    cum = entry["phases_ms"]
    marks = [cum["detected"], cum["declared"], cum["left"], cum["rebuilt"], cum["restored"],
             cum["replayed"]]
    steps = [marks[0]] + [b - a for a, b in zip(marks, marks[1:])]
    return MeasuredPhases(ranks=world, iteration_s=entry["iteration_ms"] / 1e3,
                          kill_to_done_s=entry["kill_to_done_ms"] / 1e3,
                          max_kill_to_done_s=entry["max_kill_to_done_ms"] / 1e3,
                          durations={p: max(0.0, s / 1e3) for p, s in zip(PHASES, steps)})


def load(path: Path = MEASURED) -> dict[int, MeasuredPhases]:
    raw = json.loads(Path(path).read_text())
    return {int(w): from_bench(int(w), e) for w, e in raw.items()}


def recovery_phases(ref: MeasuredPhases, platform: Platform) -> dict[str, float]:
    """Each phase's seconds on `platform`, from the reference measurement."""
    out = {}
    for ph in PHASES:
        if ph == "replay":
            it = platform.iteration_s if platform.iteration_s is not None else ref.iteration_s
            v = ref.replay_ratio * it * platform.replay_fraction
        elif ph == "detect" and platform.detect_s is not None:
            v = platform.detect_s
        else:
            v = ref.durations[ph] * platform.contention ** CONTENTION_EXPONENT[ph]
        out[ph] = v + platform.extra_s.get(ph, 0.0)
    return out


def cpu_platform(measured: dict[int, MeasuredPhases], ranks: int,
                 control_plane_per_rank_s: float) -> Platform:
    """The CPU rehearsal at `ranks`: contention from the measured iteration times."""
    ref = measured[REFERENCE_RANKS]
    return Platform(contention=measured[ranks].iteration_s / ref.iteration_s,
                    extra_s={"declare": control_plane_per_rank_s * (ranks - ref.ranks)})


def predicted_kill_to_done_s(measured: dict[int, MeasuredPhases], ranks: int,
                             control_plane_per_rank_s: float) -> float:
    """The model's kill-to-done at `ranks` on the CPU rehearsal, from the reference alone."""
    platform = cpu_platform(measured, ranks, control_plane_per_rank_s)
    return sum(recovery_phases(measured[REFERENCE_RANKS], platform).values())
