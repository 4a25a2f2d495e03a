"""Names of the control-plane keys in the launcher's TCPStore (one place, both sides)."""

GENERATION = "dp/generation"
SHUTDOWN = "dp/shutdown"


def members(generation: int) -> str:
    return f"dp/gen{generation}/members"  # json {rank: worker id}


def replaced(generation: int) -> str:
    return f"dp/gen{generation}/replaced"  # json {rank: worker id} of ranks taken by spares


def joined(generation: int) -> str:
    return f"dp/gen{generation}/joined"


def pg_prefix(generation: int) -> str:
    return f"dp/gen{generation}/pg/"


def heartbeat(worker: str) -> str:
    return f"dp/hb/{worker}"


def failure_report(worker: str) -> str:
    return f"dp/failed/{worker}"


def done(worker: str) -> str:
    return f"dp/done/{worker}"
