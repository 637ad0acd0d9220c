#!/usr/bin/env bash
# Issue 16 on one GPU machine, one device call: `sparecycles bench probe` for gpt2-small (100 parity seeds, a
# second process for the determinism check), `pytest -m gpu`, gpt2-large (10 seeds), then gpt2-small again
# with CUDA graphs. Each stage has its own time limit and writes its JSON/log under $OUT as it goes.
# Needs .whl (tools/h200_pack.sh). Usage (repository root on the device): bash tools/h200_probe.sh
set -uo pipefail
out=${OUT:-/tmp/probe-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
sc() { python3 -c 'import sys; from sparecycles.cli import app; sys.argv[0] = "sparecycles"; app()' "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
t0=$(date +%s)
stage() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stage small
timeout "${SMALL_S:-200}" bash -c "$(declare -f sc); sc bench probe --preset gpt2-small --json-out $out/probe_small.json" > "$out/small.log" 2>&1
tail -n 20 "$out/small.log"
stage pytest
timeout "${PYTEST_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests > "$out/pytest_gpu.log" 2>&1
tail -n 25 "$out/pytest_gpu.log"
stage large
timeout "${LARGE_S:-150}" bash -c "$(declare -f sc); sc bench probe --preset gpt2-large --parity-seeds 10 --no-cross-process --json-out $out/probe_large.json" > "$out/large.log" 2>&1
tail -n 12 "$out/large.log"
stage small-cudagraphs
timeout "${CG_S:-80}" bash -c "$(declare -f sc); sc bench probe --preset gpt2-small --cuda-graphs --parity-seeds 20 --no-cross-process --json-out $out/probe_small_cg.json" > "$out/small_cg.log" 2>&1
tail -n 12 "$out/small_cg.log"
stage done
