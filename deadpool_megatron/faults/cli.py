"""deadpool-inject: inject faults into a running job from outside, through its control plane.

    deadpool-inject --master-addr HOST --master-port PORT --job-token-file F 'kill tp=1,pp=0,dp=1'
    deadpool-inject ... --chaos --mtbf 20 --seed 1 --duration 600 --log chaos.jsonl
    deadpool-inject ... --replay chaos.jsonl

Each injection is printed as a JSON line (and, with --log, appended there); a chaos run's
log replays the same faults at the same iterations (--replay).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Sequence, TextIO

from deadpool_megatron.control.auth import ENV, TokenError, read_token_file
from deadpool_megatron.faults.job import InjectError, JobControl, JobEnded, Progress
from deadpool_megatron.faults.remote import delivery_of
from deadpool_megatron.faults.spec import FaultSpecError, parse_fault

CHAOS_ACTIONS = ("kill", "hang", "raise")
CHAOS_ALLOWED = ("kill", "term", "hang", "raise", "node")  # node: a failure domain killed
IN_RECOVERY_S = 0.8  # a fault during a recovery lands this long after its declaration, at most
# Actions that end a rank, so that a declaration follows. A worker's own SIGTERM (term) is
# left to its launcher, which acts only on its own: nothing is declared, nothing waited for.
DECLARED = ("kill", "hang", "raise")


@dataclass(frozen=True)
class PlannedFault:
    at_s: float  # seconds after the chaos run started
    spec: str
    # Injected this long after the last fault's declaration, during its recovery, instead
    # of at at_s after quiet iterations (None: the latter).
    in_recovery_s: float | None = None


def chaos_plan(seed: int, mtbf_s: float, duration_s: float, actions: Sequence[str],
               world: int, max_faults: int, ranks_per_node: int = 1,
               in_recovery: float = 0.0) -> list[PlannedFault]:
    """Exponential gaps of mean `mtbf_s` (failures as a Poisson process), each a random
    action on a random rank, or for the action `node` a whole failure domain killed at
    once (a host lost); with probability `in_recovery` a fault after the first lands
    during the last one's recovery instead, up to IN_RECOVERY_S after its declaration
    (what rehearses a failure during a recovery: the new members resolved, a spare
    restoring, its buddy, the groups forming). The same seed gives the same plan."""
    rng = random.Random(seed)
    plan: list[PlannedFault] = []
    t = 0.0
    while len(plan) < max_faults:
        t += rng.expovariate(1.0 / mtbf_s)
        if t > duration_s:
            break
        action = rng.choice(list(actions))
        spec = f"kill node={rng.randrange(world // ranks_per_node)}" if action == "node" \
            else f"{action} rank={rng.randrange(world)}"
        during = rng.uniform(0.0, IN_RECOVERY_S) if in_recovery and plan and \
            rng.random() < in_recovery else None
        plan.append(PlannedFault(round(t, 3), spec, during))
    return plan


def _emit(record: dict, log: TextIO | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if log is not None:
        log.write(line + "\n")
        log.flush()


def _inject(job: JobControl, spec: str, t0: float, log: TextIO | None,
            in_recovery_s: float | None = None) -> Progress:
    request, progress = job.inject(spec)
    _emit({"t": round(time.monotonic() - t0, 3), "id": request.id, "spec": spec,
           "ranks": request.ranks, "workers": request.workers,
           "generation": request.generation, "iteration": progress.iteration,
           "delivery": request.delivery,
           **({"in_recovery_s": in_recovery_s} if in_recovery_s is not None else {})},
          log)
    return progress


def _chaos(job: JobControl, args: argparse.Namespace, log: TextIO | None) -> int:
    plan = chaos_plan(args.seed, args.mtbf, args.duration, args.actions.split(","),
                      job.shape.world, args.max_faults, job.shape.ranks_per_node,
                      args.in_recovery)
    print(json.dumps({"chaos": {"seed": args.seed, "mtbf_s": args.mtbf,
                                "duration_s": args.duration, "planned": len(plan)}}),
          file=sys.stderr, flush=True)
    t0, last = time.monotonic(), -args.quiet_iterations
    injected = 0
    try:
        for fault in plan:
            if fault.in_recovery_s is not None:
                time.sleep(fault.in_recovery_s)  # the last one's declaration was just seen
            else:
                while (remaining := fault.at_s - (time.monotonic() - t0)) > 0:
                    job.check_running()
                    time.sleep(min(0.2, remaining))
                job.wait_for(max(last + args.quiet_iterations, args.after_iteration),
                             args.wait_timeout)
            injected_at = _inject(job, fault.spec, t0, log, fault.in_recovery_s)
            injected += 1
            if fault.spec.split()[0] in DECLARED:
                job.wait_taken(injected_at, args.wait_timeout)  # one fault at a time
            last = max(last, injected_at.iteration)  # -1 when injected during a recovery
    except JobEnded as end:
        print(f"deadpool-inject: chaos stopped after {injected} faults: {end}",
              file=sys.stderr)
    return 0


def _replay(job: JobControl, args: argparse.Namespace, log: TextIO | None) -> int:
    t0 = time.monotonic()
    with open(args.replay) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for record in records:
        during = record.get("in_recovery_s")
        if during is not None:  # after the last one's declaration, as in the chaos run
            time.sleep(during)
        else:
            job.wait_for(int(record["iteration"]), args.wait_timeout)
        injected_at = _inject(job, record["spec"], t0, log, during)
        if record["spec"].split()[0] in DECLARED:
            job.wait_taken(injected_at, args.wait_timeout)
    return 0


def _token(args: argparse.Namespace) -> str:
    if args.job_token_file:
        return read_token_file(args.job_token_file)
    if os.environ.get(ENV):
        return os.environ[ENV]
    raise TokenError("the job token is needed: launch the job with deadpool-launch "
                     "--job-token-file F (e.g. `umask 077; openssl rand -hex 32 > F`) and "
                     "pass the same --job-token-file F here")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deadpool-inject",
        description="Inject a fault into a running deadpool-launch job through its "
                    "authenticated control plane.")
    p.add_argument("spec", nargs="?", help="ACTION TARGET [iter=N] [phase=P] [wait=commit]: "
                   "ACTION kill (SIGKILL), term (SIGTERM), hang (SIGSTOP; with iter=/phase= "
                   "the rank stops itself there) or raise (an exception in the training "
                   "code); TARGET rank=N, node=N (a failure domain) or a coordinate "
                   "tp=1,pp=0,dp=1, resolved against the current generation's members; "
                   "without iter=/phase=: at once")
    p.add_argument("--master-addr", default="127.0.0.1", help="host 0 of the job")
    p.add_argument("--master-port", type=int, required=True,
                   help="the control-plane port deadpool-launch printed")
    p.add_argument("--job-token-file", help="the job's --job-token-file (default: "
                   f"${ENV})")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to reach the job's control plane")
    p.add_argument("--after-iteration", type=int, default=0,
                   help="first wait until every rank has reached this iteration")
    p.add_argument("--wait-timeout", type=float, default=600.0,
                   help="seconds any wait for the job's progress may take")
    p.add_argument("--log", help="append every injection (JSON lines) to this file")
    chaos = p.add_argument_group("chaos")
    chaos.add_argument("--chaos", action="store_true", help="inject random faults")
    chaos.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between faults")
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--duration", type=float, default=300.0, help="seconds of chaos")
    chaos.add_argument("--actions", default=",".join(CHAOS_ACTIONS),
                       help="comma-separated actions to draw from: kill, term, hang and "
                            "raise hit one rank; node kills a failure domain's ranks at "
                            "once, as a lost host")
    chaos.add_argument("--max-faults", type=int, default=1_000_000,
                       help="at most this many (keep it at or under the job's spares plus "
                            "deadpool-launch's --spare-respawns)")
    chaos.add_argument("--in-recovery", type=float, default=0.0, metavar="P",
                       help="the probability that a fault (after the first) lands during "
                            "the last one's recovery, up to %.1f s after its declaration, "
                            "instead of after --quiet-iterations" % IN_RECOVERY_S)
    chaos.add_argument("--quiet-iterations", type=int, default=2,
                       help="iterations the job must make after a fault (its recovery "
                            "included) before the next")
    p.add_argument("--replay", help="inject the faults of a --log file, each at the "
                   "iteration it was injected at")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    modes = bool(args.spec) + args.chaos + bool(args.replay)
    if modes != 1:
        p.error("give exactly one of: a fault spec, --chaos, --replay FILE")
    if args.chaos:
        bad = set(args.actions.split(",")) - set(CHAOS_ALLOWED)
        if bad or args.mtbf <= 0 or args.duration <= 0 or not 0 <= args.in_recovery <= 1:
            p.error(f"--chaos needs --mtbf > 0, --duration > 0, --in-recovery in [0, 1] "
                    f"and --actions from {','.join(CHAOS_ALLOWED)} (got {args.actions!r})")
    # torch's own connection retries print C++ stack traces; our error says it in one line
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    try:
        if args.spec:
            delivery_of(parse_fault(args.spec, when_required=False))  # before connecting
        token = _token(args)
        job = JobControl(args.master_addr, args.master_port, token, args.timeout)
        log = open(args.log, "a") if args.log else None
        try:
            if args.chaos:
                return _chaos(job, args, log)
            if args.replay:
                return _replay(job, args, log)
            if args.after_iteration:
                print(f"deadpool-inject: connected to the job at {job.where}; waiting for "
                      f"iteration {args.after_iteration}", file=sys.stderr, flush=True)
                job.wait_for(args.after_iteration, args.wait_timeout)
            _inject(job, args.spec, time.monotonic(), log)
            return 0
        finally:
            if log is not None:
                log.close()
    except (InjectError, FaultSpecError, TokenError) as err:
        print(f"deadpool-inject: {err}", file=sys.stderr)
        return 2
