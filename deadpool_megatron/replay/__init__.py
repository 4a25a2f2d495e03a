"""Which work a failure lost, and who recomputes it: the micro-batch ledger and the plan."""
