#!/usr/bin/env bash
# Issue 27 on one H200: the trainer's time ledger (trainer/ledger.py, summary.json's `time_ledger`) for
#   A. AdamW alone, evaluation on the trainer            (`sparecycles train`, no fleet)
#   B. AdamW, evaluation on a worker on the same GPU     (`sparecycles up --gpus auto`: its AdamW baseline)
#   C. zocurv-global, evaluation on the worker, --fleet-wait never   (the same `up`: its fleet-probed run)
# gpt2-small 16x1024 on classics-small, issue 17's tuned setting; evaluation every EVAL_EVERY steps on the whole
# validation split (170 windows of 1024 = 11 batches of 16: --eval-batches 64 caps at the split, so A scores the same
# windows the fleet scores in B and C). One GPU: trainer and worker share it, so B's and C's trainers are slowed by
# the worker's forwards (the trainer's own ledger is what the goal is about); a two-GPU run (nvidia-h200-x2) would put
# the worker on GPU 1 (`up --gpus auto` does that by itself) and needs nothing else.
#
# Pack first, here: bash experiments/gpu_runs/fleet_up.sh pack  (fills .dev/whl2 and .dev/h200lm, git-ignored; carry both).
# On the GPU machine, sized for one call (<= 600 s; the whole script stays under ~480 s at the defaults):
#   bash experiments/gpu_runs/ledger.sh all          # A then B+C at STEPS=500 (A ~90 s, up ~260 s, set-up ~40 s)
#   STEPS=1000 bash experiments/gpu_runs/ledger.sh train   # A alone at the issue's 1,000 steps (~200 s), one call
#   STEPS=1000 bash experiments/gpu_runs/ledger.sh up      # B and C at 1,000 steps (~420 s), a second call
# Estimates from issue 21's H200 figures (16x512 AdamW 0.075 s/step -> ~0.15 s/step at 16x1024); each stage runs under
# `timeout`, so a slower machine cuts a stage rather than the call. Writes $OUT/ledger_<run>.json (each run's
# time_ledger + final val loss + evaluations), $OUT/ledgers.json (all) and $OUT/logs.tgz.
# CPU dry run of the same commands (tiny settings, no packing):
#   SKIP_INSTALL=1 PY=.venv/bin/python PRESET=gpt2-tiny BATCH=4 SEQ=32 STEPS=6 EVAL_EVERY=3 CI=2 DEVICE=cpu GPUS= EVAL_WINDOWS=subset bash experiments/gpu_runs/ledger.sh all
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
part=${1:-all}
PY=${PY:-python3}  # the dry run passes the project venv's python
STEPS=${STEPS:-500}; PRESET=${PRESET:-gpt2-small}; BATCH=${BATCH:-16}; SEQ=${SEQ:-1024}
EVAL_EVERY=${EVAL_EVERY:-100}; CI=${CI:-50}; DEVICE=${DEVICE:-cuda:0}; GPUS=${GPUS-auto}; EVAL_WINDOWS=${EVAL_WINDOWS:-full}
out=${OUT:-/tmp/ledger-out}; mkdir -p "$out"
work=${WORK:-/tmp/ledger-runs}; logs=$work/logs; mkdir -p "$logs"
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/whl2/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD SPARECYCLES_CACHE=$PWD/.dev/h200lm/cache
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$out/gpus.txt"
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 SPARECYCLES_RUNS=$work
"$PY" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)' | tee -a "$out/gpus.txt"
date -u +%FT%TZ >> "$out/gpus.txt"
warm=$(( STEPS / 10 ))
sets=(--set lr=6e-4 --set min_lr=6e-5 --set warmup_steps=$warm --set weight_decay=0.1 --set beta1=0.9 --set beta2=0.95
      --set grad_clip=1.0 --set eval_every=$EVAL_EVERY --set eval_batches=${EVAL_BATCHES:-64} --set checkpoint_every=1000000
      --set probe_batch_size=8 --set seed=0)
opts=(--lr 6e-4 --warmup-steps $warm --eval-every $EVAL_EVERY --checkpoint-every 1000000 --seed 0)
common=(--preset "$PRESET" --steps "$STEPS" --batch-size "$BATCH" --seq-len "$SEQ")
left() { echo $(( ${BUDGET:-470} - ( $(date +%s) - T0 ) )); }

if [ "$part" = all ] || [ "$part" = train ]; then
  echo "A. adamw, evaluation on the trainer: $(date -u +%T)"
  # train has no --set: min_lr, wd, betas, clip and probe batch are TrainConfig's defaults there (6e-5 aside: the
  # cosine floor differs from B's by 1e-5 of the lr; the ledger, not the loss, is what A is for)
  reserve=10; [ "$part" = all ] && reserve=${UP_RESERVE:-300}  # seconds kept for B+C
  timeout $(( $(left) - reserve )) "$PY" -m sparecycles.cli train "${common[@]}" "${opts[@]}" \
    --optimizer adamw --eval-batches ${EVAL_BATCHES:-64} --device "$DEVICE" --run-dir "$work/adamw-trainer" --overwrite --no-progress \
    --no-export --eval-on trainer > "$logs/adamw_trainer.log" 2>&1
  echo "A rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$logs/adamw_trainer.log"
  tail -n 12 "$logs/adamw_trainer.log"
fi
if [ "$part" = all ] || [ "$part" = up ]; then
  echo "B+C. up: adamw and zocurv-global, evaluation on the worker, --fleet-wait never: $(date -u +%T)"
  place=(--gpus "$GPUS"); [ -z "$GPUS" ] && place=(--workers 1)
  timeout $(( $(left) - 15 )) "$PY" -m sparecycles.cli up "${common[@]}" --optimizer zocurv-global --curvature-interval "$CI" \
    "${sets[@]}" "${place[@]}" --eval-on fleet --eval-windows "$EVAL_WINDOWS" --fleet-wait never --run-dir "$work/up" --overwrite --no-progress \
    --no-export > "$logs/up.log" 2>&1
  echo "up rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$logs/up.log"
  tail -n 30 "$logs/up.log"
fi
"$PY" - "$work" "$out" <<'PY'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
runs = {"A_adamw_eval_trainer": work / "adamw-trainer", "B_adamw_eval_fleet": work / "up" / "adamw",
        "C_zocurv_global_never_eval_fleet": work / "up" / "zocurv-global"}
every = {}
for name, d in runs.items():
    p = d / "summary.json"
    if not p.exists():
        continue
    s = json.loads(p.read_text())
    keep = {k: s.get(k) for k in ("steps", "final_val_loss", "evaluations", "rounds_skipped", "time_ledger")}
    (out / f"ledger_{name}.json").write_text(json.dumps(keep, indent=2))
    every[name] = keep
(out / "ledgers.json").write_text(json.dumps(every, indent=2))
a = every.get("A_adamw_eval_trainer", {}).get("time_ledger")
for name, s in every.items():
    led = s["time_ledger"]
    ph = led["phases_s"]
    ratio = f" = {led['wall_s'] / a['wall_s']:.3f}x A" if a else ""
    print(f"{name}: wall {led['wall_s']:.1f} s{ratio}; " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    if a and name != "A_adamw_eval_trainer":
        share = a["phases_s"]["eval"] / a["wall_s"]
        print(f"   goal: <= {1 - share:.3f}x A (A's evaluation share {share:.3f}); step time vs A "
              f"{ph['step'] / max(1e-9, a['phases_s']['step']):.3f}x")
PY
cp "$work"/up/summary.json "$out/up_summary.json" 2>/dev/null
cp "$work"/up/logs/*.log "$logs/" 2>/dev/null
for d in "$work/adamw-trainer" "$work/up/adamw" "$work/up/zocurv-global"; do
  [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$logs/$(basename "$(dirname "$d")")_$(basename "$d")_metrics.jsonl"
done
tar czf "$out/logs.tgz" -C "$work" logs
echo "total $(( $(date +%s) - T0 )) s"; ls -la "$out"
