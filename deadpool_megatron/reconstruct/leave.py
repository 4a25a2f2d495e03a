"""The first step of a recovery: stop the broken generation on this rank. The training
thread stops where its state stays clean (a replica that lost nothing keeps its
micro-batches), the generation's connections are cut so nothing waits on a dead peer, the
snapshot worker is stopped or given up, the groups this rank may keep are agreed on, and
the rest dropped. Then recovery.py's `enter` joins the next generation."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import time
from typing import Any, Callable

from deadpool_megatron.metrics.laps import Laps
from deadpool_megatron.metrics.memory import PeakRss
from deadpool_megatron.reconstruct import keep
from deadpool_megatron.reconstruct.abort import GenerationCut
from deadpool_megatron.reconstruct.groups import forget_groups, open_connections
from deadpool_megatron.reconstruct.member import CannotContinue, Member, StoppableThread

log = logging.getLogger("deadpool_megatron.recovery")
STOP_TIMEOUT_S = 5.0  # a stopping thread, once its connections are cut, must end within this
RECUT_S = 0.05  # while a thread stops, connections are cut again this often
KEEP_PATIENCE_S = 0.25  # a thread still running this long after the cut: no group is kept
LATE_S = 1.0  # past STOP_TIMEOUT_S, what the abandoned pipeline and the last cut may free


def leave(member: Member, training: StoppableThread | None, generation: int,
          peak: PeakRss | None = None, since: float | None = None) -> None:
    """Stop the broken generation here for `generation`, the one declared to join next
    (waited for since `since`). `peak` is told when the training thread stopped."""
    ctl = member.ctl
    laps = Laps(since)
    flushing = ctl.flush_of(generation) is not None
    if ctl.members(generation).get(member.rank) != ctl.worker:
        raise CannotContinue(f"rank {member.rank} was declared lost in generation {generation}")
    replaced = {r for g in range(member.generation + 1, generation + 1) for r in ctl.replaced(g)}
    lost_replica = flushing or \
        member.replica_of(member.rank) in {member.replica_of(r) for r in replaced}
    member.groups.retire(member.generation)
    laps("declared")
    member.stamp("recovery")
    keepable = member.keepable(replaced, flushing)
    # A thread past the reduction's start may wait in any group: nothing is spared, so the
    # cut frees it at once; this rank then reports every keepable group broken.
    past = bool(keepable) and member.ledger.past_reduction_start()
    cut = member.cut(frozenset() if past else keep.spared(keepable, member.groups.sockets))
    asked = time.monotonic()
    stopped, severed = _stop_training(member, training, lost_replica, cut)
    # Where it is when its time is over (the abandoned pipeline and the cuts below may yet
    # free it: then this is what held it).
    where = training.where() if not stopped else ""
    if stopped and peak is not None:
        peak.training_stopped()
    if keepable and not lost_replica and not _at_barrier(member):
        # Its thread stopped between iterations: a replica peer already in the next one
        # may wait on it in any group. Nothing is spared, so the cut frees that peer (a
        # spared pipeline link held one until the grace ran out, and the ranks that went
        # on to the rendezvous were taken for hung).
        cut.cut_spared()
    laps("stopped")
    member.stamp("recovery")
    pipe = member.engine.abandon()
    severed += cut()
    laps("severed")
    waiting_since = time.monotonic()
    worker_stopped = member.engine.stop_worker(pipe, STOP_TIMEOUT_S)
    worker_s = time.monotonic() - waiting_since
    if not stopped and training.join(LATE_S):  # late, but stopped: nothing of it runs on
        log.warning("rank %d: the training thread stopped %.1f s after it was asked to; "
                    "it was at:\n%s", member.rank, time.monotonic() - asked, where)
        stopped = True
    held = {name: at for name, at in (("the training thread", "" if stopped else where),
                                      ("the snapshot worker", "" if worker_stopped else
                                       member.engine.worker_where(pipe))) if at}
    if list(held) == ["the snapshot worker"] and not flushing:
        # Given up, it is harmless (stop_worker): this rank goes on and the next
        # generation starts a worker of its own. (Before, the rank left the job: one lost
        # rank more, a spare spent, for a send gloo never failed.)
        log.warning("rank %d: the snapshot worker did not stop within %.0f s of its "
                    "connections being cut; going on without it (it ends at its group's "
                    "timeout), at:\n%s", member.rank, worker_s, _held_at(held))
        held = {}
    # Its threads stopped (or given up), nothing of this rank posts a send any more: the
    # write side goes too, and every peer reads the end of each connection at once, as it
    # would a dead process's. The read side alone leaves that to gloo's event loop here,
    # which never reads on a pair whose receive lost its buffer (pair.cc: prepareRead);
    # a peer waiting on such a pair waited out this process: ranks 1 and 2, blocked in
    # the job's first build on ranks that had left, for the 300 s every rank then spent in
    # generation 1's rendezvous, which ended the job.
    cut(both_ways=True)
    if flushing and held:
        # A flush needs only the snapshots held complete in host memory, which neither
        # stuck thread (a hung kernel, a collective that ignores the cut) writes: the
        # training thread never does, the worker only the slots it fills, none held (it
        # is given up: stop_worker). The caller writes them and exits; the groups are not
        # torn down under the thread. (CI: a flush asked while a snapshot was in flight
        # found one rank's worker still in it after 5 s, and nothing was flushed.)
        log.error("rank %d: %s did not stop within %.0f s of its connections being cut; "
                  "flushing this rank's snapshots without %s, at:\n%s", member.rank,
                  " and ".join(held),
                  STOP_TIMEOUT_S if "the training thread" in held else worker_s,
                  "them" if len(held) > 1 else "it",
                  _held_at(held))
        member.events.emit("abort", generation=member.generation, severed=severed,
                           thread_stopped=stopped, worker_stopped=worker_stopped,
                           lost_replica=lost_replica, laps_ms=laps.ms)
        return
    if held:
        faulthandler.dump_traceback(all_threads=True)  # every thread, into this rank's log
        raise CannotContinue(f"rank {member.rank}: a thread of generation {member.generation} "
                             f"did not stop within {STOP_TIMEOUT_S:.0f} s of its connections "
                             f"being cut ({severed} cut; still open: {open_connections()}), "
                             f"at:\n{_held_at(held)}")
    laps("worker")
    if member.keeps_groups and not flushing:
        # Waiting for peers' reports is no stall (a peer may still be finishing its
        # iteration): bounded by the agreement's timeout, and cut by a newer declaration.
        # With no candidate too: the peers that name a group with this rank learn that it
        # does not (its view differs: it left a generation that never formed).
        waiting = member.progress.long_operation(keep.AGREE_BUDGET_S) \
            if member.progress is not None else contextlib.nullcontext()
        with waiting:
            kept = keep.agree(ctl.store, generation, member.rank, keepable,
                              member.groups.sockets, broken=past or cut.spared_cut,
                              superseded=lambda: ctl.latest_declared() > generation)
        member.groups.keep(kept)
        laps("agreed")
        if keepable:
            log.info("rank %d: %d of its %d keepable groups kept: %s", member.rank,
                     len(member.groups.kept), len(keepable),
                     ", ".join(key[0] for key in member.groups.kept) or "none")
    forget_groups()
    laps("dropped")
    member.events.emit("abort", generation=member.generation, severed=severed,
                       thread_stopped=stopped, lost_replica=lost_replica, laps_ms=laps.ms,
                       kept_groups=[[key[0], list(key[1])] for key in member.groups.kept])
    member.events.emit("left_generation", generation=member.generation, next=generation)


def _at_barrier(member: Member) -> bool:
    """The stopped thread holds every micro-batch of its iteration, unreduced: no peer of
    its replica can be waiting on it."""
    return member.state is not None and member.ledger.grads_intact(member.state)


def _held_at(held: dict[str, str]) -> str:
    """Where each thread that would not stop is held, by name."""
    return "\n".join(f"{name}:\n{at}" for name, at in held.items())


def _stop_training(member: Member, training: StoppableThread | None,
                   lost_replica: bool, cut: GenerationCut) -> tuple[bool, int]:
    """A rank of a replica that lost a rank stops at once (its micro-batches are recomputed
    anyway) and cuts its connections, which frees whoever waits on it. A rank of an intact
    replica lets its thread finish the iteration's micro-batches, which need no lost rank,
    and stop before the gradient reduction: its gradients are then kept, not recomputed.
    It cuts once its thread has stopped, or is waiting at the reduction barrier. With NCCL
    the cut aborts the communicators, and comes before any wait for the thread (abort.py)."""
    if training is None or not training.alive():
        return True, 0
    with _watching(member, training):
        return _stop(member, training, lost_replica, cut)


def _watching(member: Member, training: StoppableThread) -> contextlib.AbstractContextManager:
    """While this thread waits for the training thread, the hang analysis is told where
    that one is: waiting in a collective on a peer that stopped (a victim), or elsewhere.
    This thread's own wait is no collective: CI declared the ranks waiting on a stopped
    rank hung with it, 'blocked outside any collective', when the stop came moments before
    another rank's failure and the wait for their iteration outlasted the progress timeout."""
    if member.progress is None or training.ident is None:
        return contextlib.nullcontext()
    return member.progress.watching(training.ident)


def _stop(member: Member, training: StoppableThread, lost_replica: bool,
          cut: GenerationCut) -> tuple[bool, int]:
    severed = 0
    if lost_replica:
        if cut.nccl:
            severed = cut()  # a thread blocked on an NCCL kernel sees no flag until then
            training.stop_now()
        else:
            training.stop_now()
            severed = cut()
    else:
        training.stop_before_reduction()
        grace = time.monotonic() + max(5.0, 3 * member.ledger.longest_iteration_s)
        while training.alive() and time.monotonic() < grace:
            entry = member.ledger.entry
            if entry is not None and entry.accumulated:
                break  # at the barrier: waiting on replicas that will never come
            training.join(0.002)
        if training.alive():  # in the barrier (or the grace is over): its group is cut
            cut.unspare(member.barrier_sockets())
            severed = cut()
    return join_cutting(training, severed, cut, member.engine.release_waiters,
                         member.progress)


def join_cutting(training: StoppableThread, severed: int, cut: GenerationCut,
                  release: Callable[[], None], board: Any = None) -> tuple[bool, int]:
    """Wait for the stopping thread, cutting again every RECUT_S: a connection that was
    still being set up at the first cut (not yet connected, so not cut) can hold it. A
    wait on the snapshot pipeline is released first (`release`): its worker may wait on a
    peer, and before, only the pipeline's abandonment after STOP_TIMEOUT_S freed such a
    thread (tests/test_abort_order.py). After
    KEEP_PATIENCE_S the connections of the groups it might have kept are cut too. A thread
    inside a durable save (`board`: writing its shard) is waited for past STOP_TIMEOUT_S,
    within the save's budget: its slow work is local, and it stops at its next collective,
    which the cut fails (a kill during Megatron's save had
    every survivor leave after 5 s, and the job end: chaos soak --loop megatron)."""
    start = time.monotonic()
    deadline = start + STOP_TIMEOUT_S
    release()
    while training.alive():
        if time.monotonic() >= deadline:
            if board is None or board.durable_save_left_s() <= 0:
                break
            deadline = time.monotonic() + RECUT_S
        if training.join(RECUT_S):
            break
        patience_over = time.monotonic() > start + KEEP_PATIENCE_S
        if patience_over:
            cut.cut_spared()
        severed += cut(both_ways=patience_over)
    return not training.alive(), severed
