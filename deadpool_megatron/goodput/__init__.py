"""Goodput at scale: a seeded discrete-event model of a long training run under failures.

`params` (every number with its source), `failures` (seeded per-node failure sampling,
spare pools), `calibration` (DeadPool's recovery phases measured by tools/bench_recovery.py
and their scaling in N), `strategies` (what each fault-tolerance strategy pays, per phase),
`analytic` (Young/Daly), `simulate` (the event loop, the same failures for every strategy),
`report` (table and JSON), `plot` (the PNG). tools/simulate_goodput.py is the command.
"""
