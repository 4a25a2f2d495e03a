# The README's two commands: `make run` (the main job) and `make test` (the suite).
PY := .venv/bin/python
export PYTHONWARNINGS ?= ignore

.venv/.ready: requirements.txt setup.py tools/setup_env.sh
	bash tools/setup_env.sh
	touch $@

setup: .venv/.ready

# The main job, as a rehearsal: TP2 x PP2 x DP2 GPT on CPU (8 processes, gloo, distributed
# optimizer) under deadpool-launch with 2 warm spares; rank 5 is killed mid-run and the job
# must end with the fingerprint of the same job run without failures (run first).
run: .venv/.ready
	$(PY) tools/rehearse.py

# The suite but the long fault matrix (under 20 minutes on 2 cores).
test: .venv/.ready
	$(PY) -m pytest tests -q -m "not fault_matrix"

# The long fault matrix alone (CI runs both).
test-faults: .venv/.ready
	$(PY) -m pytest tests -q -m fault_matrix

.PHONY: setup run test test-faults
