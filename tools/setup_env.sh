#!/usr/bin/env bash
# Create .venv with torch, megatron-core and the test tools. Idempotent; used by the Makefile.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements.txt
# megatron-core 0.19.2 declares Python >=3.12 but runs on 3.11 (see requirements.txt).
.venv/bin/pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
.venv/bin/pip install -q --no-deps -e .
.venv/bin/python -c "import torch, numpy; print('torch', torch.__version__)"
