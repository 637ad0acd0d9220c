#!/usr/bin/env bash
# One-shot set-up for a fresh machine: a venv in .venv with torch's CPU build (on disk here) and the project.
# Idempotent: a second run only checks. GPU hosts: set SPARECYCLES_TORCH to the torch spec you want.
set -euo pipefail
cd "$(dirname "$0")/.."
# --test-services: also what the tests need outside the venv (Redis, Debian's prometheus, docker.io and
# docker-compose, a dockerd, the vLLM venv): tools/test_services.sh. The README's test command passes it.
services=0
case "${1-}" in
  "") ;;
  --test-services) services=1 ;;
  *) echo "usage: bash tools/bootstrap.sh [--test-services]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
TORCH_SPEC=${SPARECYCLES_TORCH:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.sparecycles-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $TORCH_SPEC"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # torch first, pinned: a bare "torch" requirement would pull a multi-GB CUDA build on a CPU machine.
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
if [ "$services" = 1 ]; then
  bash tools/test_services.sh
fi
