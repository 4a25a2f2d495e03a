"""Whose failure is an error? A rank's own (it must leave, to be replaced) or the
consequence of a peer's (it stays and recovers). Pure, over the error alone.

Our own code says it by class: every error it raises because of another rank or the job's
control (a generation abandoned or superseded, a snapshot transfer torn, the job ended)
is a `PeerFailure`. The communication libraries say it only in their messages: a peer's
death or cut reaches a survivor as a connection reset or closed, a read or write error, a
timed-out receive, an aborted communicator (PEER_SIGNS). Anything else (a CUDA error, out
of memory, a data error, a bug) is the rank's own. When unsure it counts as own: a rank
that leaves wrongly costs a spare; one that stays wrongly waits for a declaration nobody
makes.
"""

from __future__ import annotations

from deadpool_megatron.metrics.errors import error_chain

# gloo's, NCCL's and torch.distributed's words for a peer gone (their errors are plain
# RuntimeErrors, DistBackendErrors, ...).
PEER_SIGNS = (
    "Connection reset by peer", "Connection closed by peer", "Read error", "Write error",
    "Broken pipe", "Timed out waiting", "Socket Timeout", "Connection refused",
    "Connection was likely closed", "Failed to recv", "Failed to send",
    "NCCL communicator was aborted", "ncclRemoteError", "remote process exited",
    "Connect timeout",  # gloo: a group's peer never connected (it died while creating it)
)


class PeerFailure(RuntimeError):
    """Raised by our code because of another rank's failure or the job's control, never
    because of this rank's own: the rank stays and recovers."""


def caused_by_a_peer(err: BaseException) -> bool:
    """True if `err`, or an error it was raised from, shows a peer's failure."""
    for e in error_chain(err):
        if isinstance(e, PeerFailure):
            return True
        if any(sign in str(e) for sign in PEER_SIGNS):
            return True
    return False
