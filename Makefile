# The README's two commands: `make run` (the main job) and `make test` (the suite).
PY := .venv/bin/python
export PYTHONWARNINGS ?= ignore

.venv/.ready: requirements.txt setup.py tools/setup_env.sh
	bash tools/setup_env.sh
	touch $@

setup: .venv/.ready

# A TP2 x PP2 x DP2 GPT pretraining run on CPU (8 processes, gloo, distributed optimizer).
run: .venv/.ready
	.venv/bin/torchrun --standalone --nproc-per-node 8 pretrain_scripts/pretrain_gpt.py \
	  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
	  --use-distributed-optimizer --distributed-backend gloo --mock-data \
	  --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
	  --max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 \
	  --train-iters 20 --lr 1e-3 --seed 1234

test: .venv/.ready
	$(PY) -m pytest tests -q

.PHONY: setup run test
