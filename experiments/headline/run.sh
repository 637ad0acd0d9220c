#!/usr/bin/env bash
# The headline benchmarks on a GPU machine (issue 8), one part per device call:
#   pretrain: gpt2-small on classics, AdamW at three lrs on GPU 0, then the probe-throughput and memory
#             scans there; zocurv-line (in-process probes on the same GPU) on GPU 1.
#   finetune: MiniLM-L6 sentiment, MeZO / 1SPSA / 1.5-SPSA / backprop, runs spread over the GPUs.
#   finetune-smollm2: the same for SmolLM2-135M-Instruct as a prompt classifier (all 134.5M parameters).
# Needs experiments/gpu_runs/pack.sh run first (carry .h200 and .whl); finetune-smollm2 needs `experiments/gpu_runs/pack.sh
# smollm2` instead: one call carries .h200s1 and copies it out of the repository (a later call removes
# carried folders it does not name), a later one on the same warm machine carries .h200s2 and .whl and copies
# .h200s1 back first (README, "--model smollm2").
# Writes a tarball and logs under $OUT.
# Usage: bash experiments/headline/run.sh pretrain|finetune|finetune-smollm2 [steps] [budget: forward passes per ZO run]
set -uo pipefail
part=${1:?usage: h200_headline.sh pretrain|finetune|finetune-smollm2 [steps] [budget]}
steps=${2:-1000}
out=${OUT:-/tmp/headline-out}
mkdir -p "$out"
source "$(dirname "$0")/../../experiments/gpu_runs/common.sh"
h200_install .h200/cache || exit 1
deadline=$(( $(date +%s) + ${HEADLINE_SECONDS:-510} ))  # leave time to pack before the call's limit
wait_or_stop() {  # wait for the background jobs; past the deadline stop them (their metrics are on disk)
  while [ -n "$(jobs -rp)" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 2; done
  if [ -n "$(jobs -rp)" ]; then echo "deadline: stopping $(jobs -rp | wc -l) job(s)"; kill -TERM $(jobs -rp) 2>/dev/null; pkill -TERM -f "from sparecycles.cli import app"; sleep 3; fi
}
sc() { python3 -c 'import sys; from sparecycles.cli import app; sys.argv[0] = "sparecycles"; app()' "$@"; }
sweep() {  # sweep DEFAULT_JOBS BENCH_ARGS...: one `python -m experiments.zo` process per METHOD:LR job ($FINETUNE_JOBS
  # overrides), spread round-robin over the GPUs; sets i to the number of jobs started
  local jobs=$1 job m lr; shift
  i=0
  for job in ${FINETUNE_JOBS:-$jobs}; do
    m=${job%%:*} lr=${job##*:}
    python3 -m experiments.zo "$@" --methods "$m" --lrs "$lr" --device cuda:$(( i % ngpu )) > "$res/logs/ft-$m-$lr.log" 2>&1 &
    i=$((i + 1))
  done
}
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
res=/tmp/headline && mkdir -p $res/logs
common=(--preset gpt2-small --corpus classics --steps "$steps" --batch-size 16 --seq-len 512 --warmup-steps $((steps / 10))
        --eval-every $((steps / 20)) --checkpoint-every "$steps" --no-progress)
if [ "$part" = pretrain ]; then
  g1=$(( ngpu > 1 ? 1 : 0 ))
  (
    for lr in 1e-3 5e-4 2e-3; do sc train "${common[@]}" --optimizer adamw --lr $lr --device cuda:0 --run-dir $res/adamw-lr$lr; done
    CUDA_VISIBLE_DEVICES=0 sc bench kernels --preset gpt2-small --json-out $res/kernels.json
    python3 -m experiments.headline memory --device cuda:0 --json-out $res/memory.json
  ) > "$out/gpu0.log" 2>&1 &
  (
    for lr in 1e-3 2e-3; do
      sc train "${common[@]}" --optimizer zocurv-line --lr $lr --probe-batch-size 8 --curvature-interval 10 \
        --device cuda:$g1 --run-dir $res/zocurv-line-lr$lr
    done
  ) > "$out/gpu1.log" 2>&1 &
  wait_or_stop
  python3 -m experiments.headline report $res/adamw-lr* $res/zocurv-line-lr* --out $res/report > "$out/report.log" 2>&1
elif [ "$part" = finetune ]; then
  # MiniLM-L6 sentiment from a linear-probe head: one process per (method, lr), three per GPU (more
  # processes time-slice one GPU too finely). Each run writes its curve after every evaluation, so the
  # deadline leaves every run's progress; compare them at equal forward passes.
  budget=${3:-60000}
  ft=(--part sentiment --budget "$budget" --k 16 --evals 40 --head-init linear-probe --out $res/sentiment)
  sweep "mezo:3e-5 mezo:1e-4 1spsa:1e-5 1spsa:3e-5 1.5spsa:1e-5 1.5spsa:3e-5" "${ft[@]}"
  wait_or_stop
  python3 -m experiments.zo --part sentiment --budget 3 --lrs "" --methods mezo --evals 1 --head-init linear-probe \
    --device cuda:0 --out $res/sentiment > "$res/logs/ft-summary.log" 2>&1
  tail -n 4 $res/logs/*.log > "$out/finetune-tail.log"
elif [ "$part" = finetune-smollm2 ]; then
  # SmolLM2-135M-Instruct, prompt + label words, from its zero-shot start: rejoin the GGUF halves into a cache
  # kept on the machine (.h200sc: the next call on a warm machine skips the rejoin and the conversion), then one
  # process per (method, lr), a backprop AdamW baseline (BACKPROP_STEPS, 0 to skip) beside them. The lrs: on
  # CPU, 15 MeZO steps on one fixed batch of 16 took its loss 0.425 -> 0.411 at 1e-5, -> 0.332 at 1e-4 and
  # diverged at 1e-3; K = 16 averages the slopes' noise down, so 1SPSA / 1.5-SPSA get a larger grid.
  export SPARECYCLES_CACHE=$PWD/.h200sc
  if ! bash experiments/headline/smollm2_cache.sh "$SPARECYCLES_CACHE" > "$out/smollm2-cache.log" 2>&1; then
    tail -n 20 "$out/smollm2-cache.log"; exit 1
  fi
  budget=${3:-10000}
  ft=(--part sentiment --model smollm2 --budget "$budget" --k 16 --evals "${FINETUNE_EVALS:-20}" --out $res/sentiment-smollm2)
  sweep "mezo:3e-5 mezo:1e-4 1spsa:1e-4 1spsa:3e-4 1.5spsa:1e-4 1.5spsa:3e-4" "${ft[@]}"
  if [ "${BACKPROP_STEPS:-300}" -gt 0 ]; then
    python3 -m experiments.zo "${ft[@]}" --methods mezo --lrs "" --backprop-steps "${BACKPROP_STEPS:-300}" --evals 10 \
      --device cuda:$(( i % ngpu )) > "$res/logs/ft-backprop.log" 2>&1 &
  fi
  wait_or_stop
  python3 -m experiments.zo --part sentiment --model smollm2 --budget 3 --lrs "" --methods mezo --evals 1 \
    --device cuda:0 --out $res/sentiment-smollm2 > "$res/logs/ft-summary.log" 2>&1
  tail -n 4 $res/logs/*.log > "$out/finetune-smollm2-tail.log"
else
  echo "unknown part $part: pretrain, finetune or finetune-smollm2" >&2; exit 2
fi
find $res -name 'checkpoint*' -delete
tar -czf "$out/headline-$part.tgz" -C $res .
ls -la "$out"
