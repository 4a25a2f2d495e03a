#!/usr/bin/env bash
# What only a real GPU can check, in one command, in under 10 minutes on a single GPU:
#   1. the device: CUDA visible, its name, count and memory;
#   2. the snapshot overhead on a model of at least 1B parameters: iteration time with
#      snapshots off and on, the snapshot being a side-stream copy into pinned host memory;
#   3. the elastic path: a rank killed mid-run, a warm spare takes it (on the same GPU when
#      there is only one), the job ends with the failure-free run's state fingerprint.
# It prints the figures (overhead ratio, copy and transfer per snapshot, host memory, the
# fingerprints) and writes them under runs/gpu_check/.
#
#   tools/gpu_check.sh              run it (a GPU machine, after `make setup` there)
#   tools/gpu_check.sh --dry-run    walk every step, check its flags, say what would run
#   tools/gpu_check.sh --dry-run --devices 8   ... as on a host with 8 GPUs
#
# NCCL refuses two ranks of one communicator on one GPU: with fewer GPUs than a step's
# processes, that step runs its collectives with gloo over the CUDA tensors (the model,
# optimizer and snapshot copies stay on the GPU path); with enough GPUs, with nccl.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PY:-$REPO/.venv/bin/python}"
OUT="${GPU_CHECK_OUT:-$REPO/runs/gpu_check}"
DRY=0
DEVICES=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --devices) DEVICES="${2:?--devices needs a GPU count}"; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --devices N)" >&2; exit 2 ;;
  esac
  shift
done

step() { echo; echo "== $*"; }

# Runs a tool under a time limit; in a dry run says what it would run, then runs the tool
# with --dry-run (it checks its jobs' flags as the training script would, and runs nothing).
run() {
  local limit="$1"; shift
  if [ "$DRY" = 1 ]; then
    echo "would run (limit ${limit} s): $(printf '%q ' "$@")"
    "$@" --dry-run
  else
    echo "\$ $(printf '%q ' "$@")"
    timeout "$limit" "$@"
  fi
}

step "1/3 the device"
if [ "$DRY" = 1 ]; then
  DEVICES="${DEVICES:-1}"
  echo "would check that CUDA is visible and print each device's name and memory"
  echo "(dry run: planning for $DEVICES GPU(s); --devices N to plan for another host)"
else
  "$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device visible"
print("torch", torch.__version__, "CUDA", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"device {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB")'
  DEVICES="${DEVICES:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}"
fi
[ "$DRY" = 1 ] || mkdir -p "$OUT"
backend_for() { if [ "$DEVICES" -ge "$1" ]; then echo nccl; else echo gloo; fi; }

step "2/3 snapshot overhead: 1.07B-parameter GPT, TP2, snapshots off vs on"
SNAP_BACKEND="$(backend_for 2)"
echo "backend $SNAP_BACKEND for 2 ranks on $DEVICES GPU(s)"
run 420 "$PY" tools/bench_snapshot.py --backend "$SNAP_BACKEND" --tp 2 --nproc 2 \
  --layers 20 --hidden 2048 --vocab 32000 --seq 256 --iters 10 --warmup 3 --rounds 1 \
  --out "$OUT/snapshot.json"

step "3/3 elastic path: 2 ranks + 1 warm spare, rank 1 killed in iteration 4"
ELASTIC_BACKEND="$(backend_for 3)"
echo "backend $ELASTIC_BACKEND for 2 ranks and a spare on $DEVICES GPU(s)"
MODEL="--distributed-backend $ELASTIC_BACKEND --mock-data --num-layers 4 --hidden-size 256"
MODEL="$MODEL --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128"
MODEL="$MODEL --micro-batch-size 2 --global-batch-size 8 --train-iters 8 --lr 1e-3 --seed 1234"
run 300 "$PY" tools/rehearse.py --nproc 2 --spares 1 --logical-nodes 2 --out "$OUT/elastic" \
  --kill "kill rank=1 iter=4 phase=backward" --model "$MODEL"

step "figures"
if [ "$DRY" = 1 ]; then
  echo "would print: on/off iteration-time ratio, MB copied and sent per snapshot, copy and"
  echo "transfer ms, host memory per rank (from $OUT/snapshot.json), and both fingerprints"
  echo "dry run complete: every step checked, nothing run"
else
  "$PY" - "$OUT/snapshot.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"snapshot overhead ({s['backend']}, {s['model_parameters'] / 1e9:.2f} B parameters): "
      f"ratio on/off {s['ratio_on_off']:.3f} (median), {s['mean_ratio_on_off']:.3f} (mean); "
      f"{s.get('copied_mb')} MB copied in {s.get('copy_ms')} ms and {s.get('sent_mb')} MB "
      f"sent in {s.get('transfer_ms')} ms per snapshot; {s.get('host_mb_per_rank')} MB host "
      f"memory per rank")
EOF
  echo "elastic path: fingerprints above (bit-identical: yes)"
fi
