"""Parse fault specs such as 'kill rank=5 iter=3 phase=backward' and resolve their targets.

Pure functions over plain data, so a rehearsal script can be checked before any process
starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from deadpool_megatron.topology import ParallelSizes, coord_of, node_of

ACTIONS = ("kill", "hang", "raise", "corrupt", "term")
# 'reduction' fires once the data-parallel gradient reduction is about to begin (after the
# barrier: every peer is reducing); 'optimizer' just before the optimizer step; 'groups'
# while generation iter=N creates its process groups (the default one made, Megatron's
# not yet); 'recovery' while the rank recovers into generation iter=N, its groups made.
PHASES = ("forward", "backward", "reduction", "optimizer", "snapshot", "groups", "recovery")
COORD_KEYS = ("tp", "cp", "pp", "dp")


class FaultSpecError(ValueError):
    """A --deadpool-inject value that cannot be understood; says what to write instead."""


@dataclass(frozen=True)
class FaultSpec:
    action: str
    # The iteration during which it fires (1-based, as logged); None (deadpool-inject only):
    # the next one.
    iteration: int | None
    phase: str | None  # None (deadpool-inject only): the next phase of the training loop
    rank: int | None = None
    node: int | None = None
    coord: tuple[tuple[str, int], ...] | None = None  # partial coordinate, e.g. (("tp", 1),)
    # wait=commit: first wait until this rank's snapshot of the previous iteration has
    # committed (a failure with the newest snapshot safe, whatever the machine's speed).
    after_commit: bool = False

    def __str__(self) -> str:
        if self.rank is not None:
            target = f"rank={self.rank}"
        elif self.node is not None:
            target = f"node={self.node}"
        else:
            target = ",".join(f"{k}={v}" for k, v in self.coord or ())
        when = "".join(f" {key}={value}" for key, value in (("iter", self.iteration),
                                                             ("phase", self.phase))
                       if value is not None)
        wait = " wait=commit" if self.after_commit else ""
        return f"{self.action} {target}{when}{wait}"


USAGE = ("expected 'ACTION TARGET iter=N phase=PHASE' with ACTION in "
         f"{'/'.join(ACTIONS)}, TARGET rank=N, node=N or a coordinate like tp=1,pp=0,dp=1, "
         f"PHASE in {'/'.join(PHASES)}, optionally wait=commit; "
         "e.g. 'kill rank=5 iter=3 phase=backward'")


def _int(text: str, what: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise FaultSpecError(f"--deadpool-inject {spec!r}: {what} must be an integer") from None
    if value < 0:
        raise FaultSpecError(f"--deadpool-inject {spec!r}: {what} must be >= 0")
    return value


def parse_fault(spec: str, when_required: bool = True) -> FaultSpec:
    """`when_required=False` (deadpool-inject into a running job): iter= and phase= may be
    left out, meaning the next iteration or phase."""
    words = spec.split()
    if not words or words[0] not in ACTIONS:
        raise FaultSpecError(f"--deadpool-inject {spec!r}: {USAGE}")
    fields: dict[str, object] = {"action": words[0]}
    coord: dict[str, int] = {}
    for word in words[1:]:
        for item in word.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise FaultSpecError(f"--deadpool-inject {spec!r}: bad item {item!r}; {USAGE}")
            if key in ("rank", "node"):
                fields[key] = _int(value, key, spec)
            elif key == "iter":
                fields["iteration"] = _int(value, key, spec)
            elif key == "phase":
                if value not in PHASES:
                    raise FaultSpecError(f"--deadpool-inject {spec!r}: unknown phase {value!r}; "
                                         f"use one of {', '.join(PHASES)}")
                fields["phase"] = value
            elif key == "wait":
                if value != "commit":
                    raise FaultSpecError(f"--deadpool-inject {spec!r}: wait={value!r}: the only "
                                         "wait is wait=commit")
                fields["after_commit"] = True
            elif key in COORD_KEYS:
                coord[key] = _int(value, key, spec)
            else:
                raise FaultSpecError(f"--deadpool-inject {spec!r}: unknown key {key!r}; {USAGE}")
    targets = ("rank" in fields) + ("node" in fields) + bool(coord)
    if targets != 1:
        raise FaultSpecError(f"--deadpool-inject {spec!r}: name exactly one target; {USAGE}")
    if fields["action"] == "term" and when_required:
        raise FaultSpecError(f"--deadpool-inject {spec!r}: term is for deadpool-inject (a "
                             f"SIGTERM delivered by the worker's launcher); {USAGE}")
    if when_required and ("iteration" not in fields or "phase" not in fields):
        raise FaultSpecError(f"--deadpool-inject {spec!r}: iter= and phase= are required; {USAGE}")
    fields.setdefault("iteration", None)
    fields.setdefault("phase", None)
    if fields["action"] == "corrupt" and fields["phase"] != "snapshot":
        raise FaultSpecError(f"--deadpool-inject {spec!r}: corrupt applies to phase=snapshot")
    if fields.get("after_commit") and fields["phase"] == "snapshot":
        raise FaultSpecError(f"--deadpool-inject {spec!r}: wait=commit cannot apply to "
                             "phase=snapshot (the fault would wait on its own snapshot)")
    if coord:
        fields["coord"] = tuple(sorted(coord.items()))
    return FaultSpec(**fields)  # type: ignore[arg-type]


def target_ranks(fault: FaultSpec, sizes: ParallelSizes, ranks_per_node: int) -> list[int]:
    """Global ranks the fault hits; an unknown rank, node or coordinate is an error."""
    world = sizes.world_size
    if fault.rank is not None:
        if fault.rank >= world:
            raise FaultSpecError(f"fault '{fault}': rank {fault.rank} >= world size {world}")
        return [fault.rank]
    if fault.node is not None:
        hit = [r for r in range(world) if node_of(r, ranks_per_node) == fault.node]
        if not hit:
            raise FaultSpecError(f"fault '{fault}': no node {fault.node} "
                                 f"({world // ranks_per_node} nodes)")
        return hit
    wanted = dict(fault.coord or ())
    for key, value in wanted.items():
        if value >= getattr(sizes, key):
            raise FaultSpecError(f"fault '{fault}': {key}={value} but the {key} size is "
                                 f"{getattr(sizes, key)}")
    return [r for r in range(world)
            if all(getattr(coord_of(r, sizes), k) == v for k, v in wanted.items())]


