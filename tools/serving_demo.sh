#!/usr/bin/env bash
# `up` beside a real vLLM (issue 46): the engine on SmolLM2-135M, an open-loop request load against it, and
# `sparecycles up` whose probe workers yield to the engine (SPARECYCLES_SERVING_METRICS, read by `sparecycles worker
# --serving-metrics`). Arguments go to `up`. Everything started here stops when `up` ends or on Ctrl-C.
#   bash tools/serving_demo.sh [--steps 60 ...]        env: SERVING_RATE (requests/s, 0.1), SERVING_REQUESTS (40)
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
bash tools/vllm.sh install
PORT=$(.venv/bin/python -c "from api.server import free_port; print(free_port())")
MODEL=$(bash tools/vllm.sh model)
LOGS=${SERVING_LOGS:-runs/serving-demo}
mkdir -p "$LOGS"
setsid bash tools/vllm.sh start "$MODEL" "$PORT" > "$LOGS/vllm.log" 2>&1 &
ENGINE=$!
LOAD=""
cleanup() {
  [ -n "$LOAD" ] && kill "$LOAD" 2>/dev/null || true
  kill -TERM -- "-$ENGINE" 2>/dev/null || true
}
trap cleanup EXIT INT TERM
echo "vLLM on 127.0.0.1:$PORT (log $LOGS/vllm.log); waiting for /health ..." >&2
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$ENGINE" 2>/dev/null || { tail -20 "$LOGS/vllm.log" >&2; exit 1; }
  sleep 0.5
done
.venv/bin/sparecycles bench serving-load "http://127.0.0.1:$PORT" --rate "${SERVING_RATE:-0.1}" \
  --requests "${SERVING_REQUESTS:-40}" --json-out "$LOGS/load.json" > "$LOGS/load.log" 2>&1 &
LOAD=$!
SPARECYCLES_SERVING_METRICS="http://127.0.0.1:$PORT/metrics" .venv/bin/sparecycles up "$@"
echo "request load: $(tail -1 "$LOGS/load.log" 2>/dev/null || echo still running)" >&2
