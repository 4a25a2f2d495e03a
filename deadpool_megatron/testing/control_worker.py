"""A stand-in training script for launcher tests: it joins the control plane,
follows generations and can fail on cue, but trains nothing (starts in ~2 s, not ~10).

Active workers run for --seconds, then report done; a spare reports done as soon as it is
given a rank. Failures fire only in the first epoch, like real injected faults.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from deadpool_megatron.control.client import ControlClient, JobShutdown


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--fail-rank", type=int, action="append", default=[])
    parser.add_argument("--fail-after", type=float, default=1.0)
    parser.add_argument("--fail-by", choices=("exit", "sigkill"), default="exit",
                        help="how a --fail-rank fails: exit 1, or SIGKILL itself")
    parser.add_argument("--child", action="store_true",
                        help="each worker starts a child process that outlives it unless "
                             "stopped (as Megatron's checkpoint writer starts a Manager)")
    parser.add_argument("--cue", help="a file: --seconds and --fail-after count from when it "
                                      "appears (a test's cue), not from the start")
    parser.add_argument("--cue-rank", type=int, action="append", default=[],
                        help="with --cue: the ranks that wait for it (default: every rank)")
    parser.add_argument("--deadpool", action="store_true")  # what the launcher looks for
    parser.add_argument("--save")  # accepted (the launcher reads it), unused
    parser.add_argument("--load")
    args = parser.parse_args()
    ctl = ControlClient.from_env()
    if ctl is None:
        sys.exit("control_worker.py runs under deadpool-launch only")
    first_epoch = ctl.epoch == 0
    print(f"worker {ctl.worker} device slot {os.environ['DEADPOOL_DEVICE_SLOT']}", flush=True)
    if args.child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"worker {ctl.worker} started child pid {child.pid}", flush=True)
    try:
        if ctl.is_spare:
            generation, rank = ctl.wait_for_assignment()
            print(f"worker {ctl.worker} took rank {rank} in generation {generation}", flush=True)
        else:
            rank = int(os.environ["RANK"])
            start = time.monotonic()
            print(f"worker {ctl.worker} is rank {rank} in epoch {ctl.epoch}", flush=True)
            cued = args.cue is None or bool(args.cue_rank) and rank not in args.cue_rank
            while not cued or time.monotonic() - start < args.seconds:
                if not cued and os.path.exists(args.cue):
                    cued, start = True, time.monotonic()
                if cued and first_epoch and rank in {*args.fail_rank, *args.cue_rank} and \
                        time.monotonic() - start > args.fail_after:
                    print(f"rank {rank} fails on cue", flush=True)
                    if args.fail_by == "sigkill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    os._exit(1)
                ctl.check_shutdown()
                time.sleep(0.05)
        ctl.mark_done()
    except JobShutdown as end:
        print(f"worker {ctl.worker}: job ended: {end}", flush=True)
        return 0 if str(end) == "done" else 1
    finally:
        ctl.close()
    print(f"worker {ctl.worker} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
