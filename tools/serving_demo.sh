#!/usr/bin/env bash
# `up` beside a real vLLM (issue 46; the equivalent of an `up --serving vllm`): the engine on SmolLM2-135M, an
# open-loop request load against it, and `sparecycles up` whose probe workers yield to the engine
# (SPARECYCLES_SERVING_METRICS, read by every `sparecycles worker` as --serving-metrics: vLLM's /load, which counts a
# request when it arrives). Arguments go to `up`. Everything started here stops when `up` ends or on Ctrl-C.
#   bash tools/serving_demo.sh [--steps 60 ...]
#   env: SERVING_RATE (requests/s, 0.1), SERVING_REQUESTS (40), SERVING_HOLD (s, 2), SERVING_LOGS (runs/serving-demo),
#        SPARECYCLES_PYTHON (the project's python; default .venv/bin/python, made by tools/bootstrap.sh if missing)
# On a machine of few cores, pin them apart as `bench serving` does: the engine's core is shared with the workers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SPARECYCLES_PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, whichever python runs it
[ -x "$PY" ] || { bash tools/bootstrap.sh; PY=.venv/bin/python; }
bash tools/vllm.sh install
PORT=$("$PY" -c "from api.server import free_port; print(free_port())")
MODEL=$(PYTHON="$PY" bash tools/vllm.sh model)
LOGS=${SERVING_LOGS:-runs/serving-demo}
mkdir -p "$LOGS"
setsid bash tools/vllm.sh start "$MODEL" "$PORT" --enable-server-load-tracking > "$LOGS/vllm.log" 2>&1 &
ENGINE=$!
LOAD=""
cleanup() {
  if [ -n "$LOAD" ]; then kill "$LOAD" 2>/dev/null || true; fi
  kill -TERM -- "-$ENGINE" 2>/dev/null || true
}
trap cleanup EXIT INT TERM
echo "vLLM on 127.0.0.1:$PORT (log $LOGS/vllm.log); waiting for /health ..." >&2
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$ENGINE" 2>/dev/null || { tail -20 "$LOGS/vllm.log" >&2; exit 1; }
  sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "vLLM did not answer /health in 300 s" >&2; exit 1; }
"$PY" -m sparecycles.cli bench serving-load "http://127.0.0.1:$PORT" --rate "${SERVING_RATE:-0.1}" \
  --requests "${SERVING_REQUESTS:-40}" --json-out "$LOGS/load.json" > "$LOGS/load.log" 2>&1 &
LOAD=$!
SPARECYCLES_SERVING_METRICS="http://127.0.0.1:$PORT/load" SPARECYCLES_SERVING_HOLD="${SERVING_HOLD:-2}" \
  "$PY" -m sparecycles.cli up "$@"
echo "request load: $(tail -1 "$LOGS/load.log" 2>/dev/null || echo still running)" >&2
