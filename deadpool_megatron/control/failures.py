"""Whose failure is an error? A rank's own (it must leave, to be replaced) or the
consequence of a peer's (it stays and recovers). Pure, over the error alone.

A peer's death or cut reaches a survivor as a communication error: a connection reset or
closed, a read or write error, a timed-out receive, an aborted communicator, a snapshot
transfer torn; or as our own stop of a broken generation. Anything else (a CUDA error, out
of memory, a data error, a bug) is the rank's own. When unsure it counts as own: a rank
that leaves wrongly costs a spare; one that stays wrongly waits for a declaration nobody
makes.
"""

from __future__ import annotations

from deadpool_megatron.metrics.errors import error_chain

PEER_SIGNS = (
    "Connection reset by peer", "Connection closed by peer", "Read error", "Write error",
    "Broken pipe", "Timed out waiting", "Socket Timeout", "Connection refused",
    "Connection was likely closed", "Failed to recv", "Failed to send",
    "NCCL communicator was aborted", "ncclRemoteError", "remote process exited",
    "this generation was abandoned", "a new generation was declared",
    "snapshot generation abandoned",
)


def caused_by_a_peer(err: BaseException) -> bool:
    """True if `err`, or an error it was raised from, shows a peer's failure."""
    for e in error_chain(err):
        if type(e).__name__ in ("GenerationBroken", "TornTransfer", "JobShutdown"):
            return True
        if any(sign in str(e) for sign in PEER_SIGNS):
            return True
    return False
