"""Names of the control-plane keys in the launcher's TCPStore (one place, both sides)."""

GENERATION = "dp/generation"
SHUTDOWN = "dp/shutdown"
# json list, per rank: the data-parallel peer holding its replicated bytes instead of its
# buddy (null: its buddy holds all of its shard); written by rank 0 at the start
REPLICA_HOLDERS = "dp/replica_holders"


def members(generation: int) -> str:
    return f"dp/gen{generation}/members"  # json {rank: worker id}: for tools, O(N)


def declared(generation: int) -> str:
    # json control/declaration.Declaration, written last: what workers wait on and read
    return f"dp/gen{generation}/declared"


def replaced(generation: int) -> str:
    return f"dp/gen{generation}/replaced"  # json {rank: worker id} of ranks taken by spares


def joined(generation: int) -> str:
    return f"dp/gen{generation}/joined"


def ready(generation: int) -> str:
    return f"dp/gen{generation}/ready"  # set by the last worker to join the rendezvous


def pg_prefix(generation: int) -> str:
    return f"dp/gen{generation}/pg/"


def flush(generation: int) -> str:
    return f"dp/gen{generation}/flush"  # json {lost, reason}: this generation only flushes


def flush_report(worker: str) -> str:
    return f"dp/flushed/{worker}"  # json {rank, written}: the worker's flush is over


def flush_request(node: int) -> str:
    return f"dp/flush_request/{node}"  # a host's launcher got SIGTERM: flush and stop


def failure_report(worker: str) -> str:
    return f"dp/failed/{worker}"


def failure_kind(worker: str) -> str:
    return f"dp/failed_kind/{worker}"  # json {kind, iteration}: control/alike.py


def done(worker: str) -> str:
    return f"dp/done/{worker}"


# -- launcher-to-launcher keys (one set per epoch, under epoch_prefix) -------------------
EXITS = "dp/exits"  # counter: bumped after each exit_report
# the workers whose exit reports were written, "w3,s1.0,...", appended (unsigned: a hint of
# which signed report to read)
EXITED = "dp/exited"
KILLS = "dp/kills"  # counter: bumped after kill, respawn and signal requests and shutdown
FLUSH_REQUESTS = "dp/flush_requests"  # counter: bumped after each flush_request


def exit_report(worker: str) -> str:
    return f"dp/exit/{worker}"  # the worker's return code, written by its host's launcher


def kill_request(worker: str) -> str:
    return f"dp/kill/{worker}"  # host 0 asks the worker's host to SIGKILL it (hung)


def respawn_request(worker: str) -> str:
    return f"dp/respawn/{worker}"  # host 0 asks for a new spare in the failed worker's slot


# deadpool-inject (faults/remote.py): a request per fault, then a counter bump; a signal
# request per worker for its host's launcher (which wakes on KILLS).
INJECT_IDS = "dp/inject_ids"  # counter: hands out request ids
INJECTS = "dp/injects"  # counter: bumped after each inject_request is written


def inject_request(request_id: int) -> str:
    return f"dp/inject/{request_id}"  # json, see faults/remote.py


def signal_request(worker: str) -> str:
    return f"dp/signal/{worker}"  # json {id, signal}: the worker's launcher sends it


def host_report(node: int) -> str:
    return f"dp/host/{node}"  # json {seq, inc, workers: {id: view}}: heartbeat + progress


def node_spares(node: int) -> str:
    return f"dp/node{node}/spares"  # json list of the spare ids that host started


def host_starts(node: int) -> str:
    return f"dp/node{node}/starts"  # counter: that host's launcher starts in this epoch


# -- keys outside every epoch: the launchers' own lifecycle -----------------------------
# json {nnodes, nproc_per_node, standby_hosts, control_only, shape}, set by host 0; shape: {world, tp, pp,
# cp, ranks_per_node}, what deadpool-inject resolves a target with
LAYOUT = "launch/layout"
EPOCH = "launch/epoch"  # the current epoch (a whole-job restart opens the next)
END = "launch/end"  # the job's exit status, set once by host 0


def epoch_port(epoch: int) -> str:
    return f"launch/port/{epoch}"  # without --deadpool: the store of that epoch's workers


def epoch_prefix(epoch: int) -> str:
    return f"ep{epoch}/"


def bye(node: int) -> str:
    return f"launch/bye/{node}"  # a host's launcher has read END and is leaving
