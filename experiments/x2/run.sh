#!/usr/bin/env bash
# Issue 21 on two GPUs (x2 fallback of the 8-GPU run): one `sparecycles up --gpus auto --optimizer zocurv-global`
# (AdamW alone on GPU 0 as the baseline, then zocurv-global on GPU 0 with its line rounds evaluated by a probe
# worker on GPU 1, through embedded Valkey, the coordinator and Celery), both at issue 17's tuned setting
# (experiments/zocurv_fair/fair.py: gpt2-small 16x512, lr 6e-4, warmup 10%, cosine to 0.1x, wd 0.1, clip 1.0,
# refresh every 50 steps, probe batch 8) for T steps on classics-small; then, as long as the call's time allows,
# the same zocurv-global run probing in process on GPU 0. `nvidia-smi dmon` per GPU all along;
# experiments/x2/report.py turns it into x2_summary.json + x2_val_loss_vs_wall.png under $OUT.
# Pack first, here: bash experiments/gpu_runs/fleet_up.sh pack  (fills .dev/whl2 and .dev/h200lm, git-ignored; carry both).
# On the GPU machine: bash experiments/x2/run.sh [steps] [budget_s]   (defaults 400, 540: the whole call's seconds)
# Env: UP_S (seconds for up; default budget - 130), INPROC=0 skips the in-process run, BENCH_S=N adds
# `bench fleet` (worker on GPU 1, trainer on GPU 0: publish -> ready, trainer cost per version) for N seconds.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
steps=${1:-400}
budget=${2:-540}
out=${OUT:-/tmp/x2-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPARECYCLES_CACHE=$PWD/.dev/h200lm/cache SPARECYCLES_RUNS=/tmp/runs
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$out/gpus.txt"
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)' | tee -a "$out/gpus.txt"
date -u +%FT%TZ >> "$out/gpus.txt"
warm=$(( steps / 10 ))
sets=(--set lr=6e-4 --set min_lr=6e-5 --set warmup_steps=$warm --set weight_decay=0.1 --set beta1=0.9
      --set beta2=0.95 --set grad_clip=1.0 --set eval_every=25 --set eval_batches=64 --set checkpoint_every=1000000
      --set probe_batch_size=8 --set seed=0)
common=(--preset gpt2-small --steps "$steps" --batch-size 16 --seq-len 512 --curvature-interval 50)
mkdir -p /tmp/logs
nvidia-smi dmon -s u -o DT -d 1 -i 0 > /tmp/logs/dmon_gpu0.log 2>&1 & d0=$!
nvidia-smi dmon -s u -o DT -d 1 -i 1 > /tmp/logs/dmon_gpu1.log 2>&1 & d1=$!
echo "up: $(date -u +%T)"
timeout "${UP_S:-$(( budget - 130 ))}" python3 -m sparecycles.cli up --gpus auto --optimizer zocurv-global "${common[@]}" "${sets[@]}" \
  --run-dir /tmp/up --no-progress --no-export > /tmp/logs/up.log 2>&1
echo "up rc=$? after $(( $(date +%s) - T0 )) s" | tee -a /tmp/logs/up.log
left=$(( budget - 45 - ( $(date +%s) - T0 ) ))
if [ "${INPROC:-1}" != 0 ] && [ "$left" -gt 60 ]; then
  echo "in-process zocurv-global for at most $left s"
  timeout "$left" python3 - "$steps" $warm > /tmp/logs/inproc.log 2>&1 <<'PY'
import sys
from pathlib import Path
from trainer.config import resolve_preset
from trainer.train import train
steps, warm = int(sys.argv[1]), int(sys.argv[2])
cfg = resolve_preset("gpt2-small", {"optimizer": "zocurv-global", "steps": steps, "batch_size": 16, "seq_len": 512,
                     "curvature_interval": 50, "staleness": 100, "lr": 6e-4, "min_lr": 6e-5, "warmup_steps": warm,
                     "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "eval_every": 25,
                     "eval_batches": 64, "checkpoint_every": 1000000, "probe_batch_size": 8, "seed": 0,
                     "device": "cuda:0", "run_dir": Path("/tmp/inproc")})
print(train(cfg, progress=False, export=False).summary)
PY
  echo "inproc rc=$?" >> /tmp/logs/inproc.log
fi
kill "$d0" "$d1" 2>/dev/null
if [ -n "${BENCH_S:-}" ]; then
  bash tools/valkey_up.sh 6390
  SPARECYCLES_BENCH_KEEP=1 timeout "$BENCH_S" python3 -m sparecycles.cli bench fleet --workers 1 --device cuda:1 \
    --trainer-device cuda:0 --preset gpt2-small --seeds 64 --seeds-per-task 8 --batch-size 16 --seq-len 512 --threads 4 \
    --ready-preset gpt2-small --compare-seeds 8 --interval 20 --redis-url redis://127.0.0.1:6390/0 \
    --json-out "$out/fleet.json" > /tmp/logs/bench_fleet.log 2>&1
  echo "bench fleet rc=$?" | tee -a /tmp/logs/bench_fleet.log; tail -n 12 /tmp/logs/bench_fleet.log
fi
python3 -m experiments.x2.report /tmp/up "$out" --inproc /tmp/inproc \
  --dmon gpu0=/tmp/logs/dmon_gpu0.log gpu1=/tmp/logs/dmon_gpu1.log > /tmp/logs/report.log 2>&1
echo "report rc=$?" >> /tmp/logs/report.log
cp /tmp/up/summary.json "$out/up_summary.json" 2>/dev/null
for d in /tmp/up/adamw /tmp/up/zocurv-global /tmp/inproc; do
  [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "/tmp/logs/$(basename "$d")_metrics.jsonl"
done
cp /tmp/up/logs/*.log /tmp/logs/ 2>/dev/null
tar czf "$out/logs.tgz" -C /tmp logs
tail -n 40 /tmp/logs/report.log
echo "total $(( $(date +%s) - T0 )) s"; ls -la "$out"
