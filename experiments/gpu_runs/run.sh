#!/usr/bin/env bash
# The product's own benches and GPU tests on one GPU machine, one device call: the stages named on the command line,
# in that order, each under its own time limit, writing its JSON and log under $OUT as it goes. It replaces the
# one-script-per-call drivers of earlier calls (their stage lists below), which differed only in the stages.
#
# Usage (repository root on the device): bash experiments/gpu_runs/run.sh STAGE...
#   pytest          `pytest -m gpu` (PYTEST_S, default 150)
#   probe-small     `bench probe --preset gpt2-small` (100 parity seeds, cross-process check; SMALL_S 150)
#   probe-large     `bench probe --preset gpt2-large --parity-seeds LARGE_SEEDS(10) --no-cross-process` (LARGE_S 100)
#   probe-pair      `bench probe --preset gpt2-small,gpt2-large --parity-seeds 20 --no-cross-process` (PROBE_S 140)
#   probe-cg        `bench probe --preset gpt2-small --cuda-graphs --parity-seeds 20 --no-cross-process` (CG_S 100)
#   profile         a profile of the compiled gpt2-small forward (probe_kernels.bench_probe.profile_fast; PROFILE_S 40)
#   fleet-compare   `bench fleet` 64 seeds with sync and background publish -> ready, trainer cost and 8 seeds
#                   compared with in-process evaluation (FLEET_S 240)
#   fleet-shared, fleet-http   publish -> ready with the shards by the blob directory / loopback HTTP (BENCH_S 170)
#   fleet-tf32, fleet-tf32attn, fleet-tf32cg, fleet-eval, fleet-evalcg   `bench fleet` 128 seeds: seeded rounds
#                   (TF32; bf16 attention; + CUDA graphs) or eval rounds (bf16 compiled; + CUDA graphs) (FLEET_S 110)
#   precision       `bench precision` (PRECISION_S 200)
# Env: WHL (the carried wheels: .whl from experiments/gpu_runs/pack.sh, default; .dev/whl2 from experiments/gpu_runs/fleet_up.sh
# pack), DATA (a carried data folder whose cache/ becomes SPARECYCLES_CACHE, e.g. .dev/h200lm), OUT (/tmp/gpu-runs),
# DRY=1 (print the commands only).
# The earlier calls, as stages (docs/RESULTS.md cites them):
#   issue 16's probe call:  bash experiments/gpu_runs/run.sh pytest probe-small probe-large profile
#   session 5's call:       WHL=.dev/whl2 bash experiments/gpu_runs/run.sh probe-pair fleet-compare pytest
#   session 6's call:       WHL=.dev/whl2 bash experiments/gpu_runs/run.sh fleet-shared fleet-http
#   issue 37's call:        WHL=.dev/whl2 DATA=.dev/h200lm bash experiments/gpu_runs/run.sh fleet-tf32 fleet-eval \
#                             fleet-tf32attn precision pytest
set -uo pipefail
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || { sed -n '6,19p' "$0" >&2; exit 2; }
out=${OUT:-/tmp/gpu-runs}; mkdir -p "$out"
whl=${WHL:-.whl}; port=6390; redis=redis://127.0.0.1:$port/0
run() { if [ -n "${DRY:-}" ]; then echo "$*"; else "$@"; fi; }
sc=(python3 -m sparecycles.cli)  # `sparecycles`, from this checkout (PYTHONPATH)
if [ -z "${DRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$whl"/*.whl \
    > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPARECYCLES_RUNS=/tmp/runs
  if [ -n "${DATA:-}" ]; then export SPARECYCLES_CACHE=$PWD/$DATA/cache SPARECYCLES_DEV_MODE=1; fi
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)'
    nproc; } | tee "$out/stages.txt"
fi
t0=$(date +%s)
stage() { echo "=== $1 at +$(( $(date +%s) - t0 )) s" | tee -a "$out/stages.txt"; }
limited() {  # NAME SECONDS COMMAND...: run it under a time limit, its output in $OUT/NAME.log, then its tail
  local name=$1 limit=$2; shift 2
  stage "$name"
  run timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$out/stages.txt"; grep -v '^\[transformers\]' "$out/$name.log" | tail -n 12
}
valkey() { [ -n "${DRY:-}" ] || [ -n "${VALKEY_UP:-}" ] || { bash tools/valkey_up.sh $port; VALKEY_UP=1; }; }
fleet() {  # NAME SECONDS OPTIONS...: `bench fleet` on cuda:0 against the local Valkey
  local name=$1 limit=$2; shift 2
  valkey
  SPARECYCLES_BENCH_KEEP=1 limited "$name" "$limit" "${sc[@]}" bench fleet --device cuda:0 --workers 1 --preset gpt2-small \
    --threads 4 --redis-url "$redis" --json-out "$out/$name.json" "$@"
  for f in /tmp/sparecycles-bench-*/bench-0.log /tmp/sparecycles-bench-*/coordinator.log; do
    [ -f "$f" ] && tail -c 6000 "$f" > "$out/${name}_$(basename "$f")"
  done
  rm -rf /tmp/sparecycles-bench-*
}
seeded=(--seeds 128 --seeds-per-task 8 --batch-size 16 --seq-len 512 --ready-preset '')
for s in "$@"; do
  case $s in
    pytest) limited pytest "${PYTEST_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs --durations=0 tests ;;
    probe-small) limited probe_small "${SMALL_S:-150}" "${sc[@]}" bench probe --preset gpt2-small --json-out "$out/probe_small.json" ;;
    probe-large) limited probe_large "${LARGE_S:-100}" "${sc[@]}" bench probe --preset gpt2-large --parity-seeds "${LARGE_SEEDS:-10}" \
      --no-cross-process --json-out "$out/probe_large.json" ;;
    probe-pair) limited probe "${PROBE_S:-140}" "${sc[@]}" bench probe --preset gpt2-small,gpt2-large --parity-seeds 20 \
      --no-cross-process --json-out "$out/probe.json" ;;
    probe-cg) limited probe_small_cg "${CG_S:-100}" "${sc[@]}" bench probe --preset gpt2-small --cuda-graphs --parity-seeds 20 \
      --no-cross-process --json-out "$out/probe_small_cg.json" ;;
    profile) limited profile_small "${PROFILE_S:-40}" python3 -c \
      'from probe_kernels.bench_probe import profile_fast; print(profile_fast())' ;;
    fleet-compare) fleet fleet "${FLEET_S:-240}" --trainer-device cuda:0 --seeds 64 --seeds-per-task 8 --batch-size 16 \
      --seq-len 512 --ready-preset gpt2-small --compare-seeds 8 --interval 20 ;;
    fleet-shared|fleet-http) fleet "fleet_${s#fleet-}" "${BENCH_S:-170}" --trainer-device cuda:0 --seeds 16 \
      --seeds-per-task 8 --batch-size 16 --seq-len 512 --ready-preset gpt2-small --interval 20 --blob-path "${s#fleet-}" ;;
    fleet-tf32) fleet fleet_tf32 "${FLEET_S:-110}" "${seeded[@]}" ;;
    fleet-tf32attn) fleet fleet_tf32attn "${FLEET_S:-110}" "${seeded[@]}" --tf32-attention bf16 ;;
    fleet-tf32cg) fleet fleet_tf32cg "${FLEET_S:-110}" "${seeded[@]}" --tf32-attention bf16 --worker-cuda-graphs ;;
    fleet-eval) fleet fleet_eval "${FLEET_S:-110}" "${seeded[@]/512/1024}" --kind eval ;;
    fleet-evalcg) fleet fleet_evalcg "${FLEET_S:-110}" "${seeded[@]/512/1024}" --kind eval --worker-cuda-graphs ;;
    precision) limited precision "${PRECISION_S:-200}" "${sc[@]}" bench precision --json-out "$out/precision.json" ;;
    *) echo "unknown stage $s (stages: bash $0)" >&2; exit 2 ;;
  esac
done
stage done
ls -la "$out"
