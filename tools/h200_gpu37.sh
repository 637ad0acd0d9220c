#!/usr/bin/env bash
# Issue 37 on one GPU machine, one device call: `bench fleet` with seeded rounds (fp32 weights, TF32 matmuls; with
# fp32 and with bf16 attention) and with eval rounds (bf16 compiled fast path), `bench precision` (the kind x
# precision signal-to-noise table) and `pytest -m gpu`. Each stage has its own time limit and writes under $OUT.
# Needs .dev/whl2 and .dev/h200lm (tools/h200_fleet.sh pack), carried with this checkout.
# Usage (the checkout's root on the device): bash tools/h200_gpu37.sh [stages]   (default: all, in this order)
set -uo pipefail
out=${OUT:-/tmp/gpu37-out}; mkdir -p "$out" /tmp/logs
whl=${WHL:-.dev/whl2}; data=${DATA:-.dev/h200lm}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$whl"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPARECYCLES_CACHE=$PWD/$data/cache SPARECYCLES_DEV_MODE=1
sc() { python3 -c 'import sys; from sparecycles.cli import app; sys.argv[0] = "sparecycles"; app()' "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)'
t0=$(date +%s)
stage() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
bash tools/valkey_up.sh 6390
redis=redis://127.0.0.1:6390/0
fleet() {  # name, timeout, options...
  local name=$1 limit=$2; shift 2
  stage "fleet $name"
  timeout "$limit" bash -c "$(declare -f sc); sc bench fleet --device cuda:0 --workers 1 --preset gpt2-small --threads 4 \
    --ready-preset '' --redis-url $redis --json-out $out/fleet_$name.json $*" > /tmp/logs/fleet_$name.log 2>&1
  echo "rc=$?"; tail -n 3 /tmp/logs/fleet_$name.log
}
for s in ${*:-tf32 eval tf32attn precision pytest}; do
  case $s in
    tf32) fleet tf32 "${FLEET_S:-110}" --seeds 128 --seeds-per-task 8 --batch-size 16 --seq-len 512 ;;
    tf32attn) fleet tf32attn "${FLEET_S:-110}" --seeds 128 --seeds-per-task 8 --batch-size 16 --seq-len 512 --tf32-attention bf16 ;;
    tf32cg) fleet tf32cg "${FLEET_S:-110}" --seeds 128 --seeds-per-task 8 --batch-size 16 --seq-len 512 --tf32-attention bf16 --worker-cuda-graphs ;;
    eval) fleet eval "${FLEET_S:-110}" --kind eval --seeds 128 --seeds-per-task 8 --batch-size 16 --seq-len 1024 ;;
    evalcg) fleet evalcg "${FLEET_S:-110}" --kind eval --seeds 128 --seeds-per-task 8 --batch-size 16 --seq-len 1024 --worker-cuda-graphs ;;
    precision)
      stage precision
      timeout "${PRECISION_S:-200}" bash -c "$(declare -f sc); sc bench precision --json-out $out/precision.json" \
        > /tmp/logs/precision.log 2>&1; echo "rc=$?"; tail -n 16 /tmp/logs/precision.log ;;
    pytest)
      stage pytest
      timeout "${PYTEST_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests > /tmp/logs/pytest_gpu.log 2>&1
      echo "rc=$?"; tail -n 12 /tmp/logs/pytest_gpu.log ;;
  esac
done
stage done
tar -czf "$out/logs.tar.gz" -C /tmp logs
