"""The training loop and the narrow hooks through which the fault-tolerance layer reaches it."""
