#!/usr/bin/env bash
# Issue 15 on one H200 (session 6): publish -> every worker ready and the trainer's cost per published version,
# gpt2-small fp32 from a trainer on cuda:0 to a GPU probe worker on cuda:0 (one GPU: they share it), with the
# shards written into and read from the coordinator's blob directory (as under `up`/compose) and over loopback
# HTTP (as to workers on other hosts). Pack first, here: bash tools/h200_fleet.sh pack (carry .dev/whl2).
# Usage on the GPU machine: bash tools/h200_s6.sh        (results under $OUT: fleet_shared.json, fleet_http.json)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/s6-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPARECYCLES_RUNS=/tmp/runs SPARECYCLES_BENCH_KEEP=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpus.txt"
nproc | tee -a "$out/gpus.txt"
port=6390
bash tools/valkey_up.sh $port
for bp in ${BLOB_PATHS:-shared http}; do
  t0=$(date +%s)
  timeout "${BENCH_S:-170}" python3 -m sparecycles.cli bench fleet --device cuda:0 --trainer-device cuda:0 --workers 1 \
    --preset gpt2-small --seeds 16 --seeds-per-task 8 --batch-size 16 --seq-len 512 --threads 4 \
    --ready-preset gpt2-small --interval 20 --blob-path "$bp" --redis-url redis://127.0.0.1:$port/0 \
    --json-out "$out/fleet_$bp.json" > "$out/fleet_$bp.log" 2>&1
  echo "bench $bp rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$out/fleet_$bp.log"
  grep -h "ready in" /tmp/sparecycles-bench-*/bench-*.log 2>/dev/null | tail -8 > "$out/worker_ready_$bp.log"
  rm -rf /tmp/sparecycles-bench-*
done
python3 - "$out" <<'PY'
import json, sys, pathlib
for p in sorted(pathlib.Path(sys.argv[1]).glob("fleet_*.json")):
    d = json.loads(p.read_text())
    print(p.name, "probes/s", d.get("probes_per_s"), "errors", d.get("errors"))
    for k in ("publish_ready_sync", "publish_ready_background"):
        for r in d.get(k, []):
            print(" ", k, {x: round(y, 3) if isinstance(y, float) else y for x, y in r.items()})
    print("  trainer", {k: v for k, v in d.get("trainer", {}).items() if not isinstance(v, list)})
PY
