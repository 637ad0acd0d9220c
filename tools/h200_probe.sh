#!/usr/bin/env bash
# Issue 16 on one GPU machine, one device call: `pytest -m gpu`, `sparecycles bench probe` for gpt2-small (100 parity
# seeds, a second process for the determinism check), gpt2-large, then a profile of the compiled
# gpt2-small forward (and, if CG_S is set, gpt2-small with CUDA graphs). Each stage has its own time
# limit and writes its JSON/log under $OUT as it goes. Needs .whl (tools/h200_pack.sh).
# Usage (repository root on the device): bash tools/h200_probe.sh
set -uo pipefail
out=${OUT:-/tmp/probe-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
sc() { python3 -c 'import sys; from sparecycles.cli import app; sys.argv[0] = "sparecycles"; app()' "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
t0=$(date +%s)
stage() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stage pytest
timeout "${PYTEST_S:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests > "$out/pytest_gpu.log" 2>&1
tail -n 25 "$out/pytest_gpu.log"
stage small
timeout "${SMALL_S:-150}" bash -c "$(declare -f sc); sc bench probe --preset gpt2-small --json-out $out/probe_small.json" > "$out/small.log" 2>&1
tail -n 8 "$out/small.log"
stage large
timeout "${LARGE_S:-100}" bash -c "$(declare -f sc); sc bench probe --preset gpt2-large --parity-seeds ${LARGE_SEEDS:-10} --no-cross-process --json-out $out/probe_large.json" > "$out/large.log" 2>&1
tail -n 8 "$out/large.log"
stage profile
timeout "${PROFILE_S:-40}" python3 -c 'from probe_kernels.bench_probe import profile_fast; print(profile_fast())' > "$out/profile_small.log" 2>&1
grep -v '^\[transformers\]' "$out/profile_small.log" | tail -n 22
if [ -n "${CG_S:-}" ]; then
  stage small-cudagraphs
  timeout "$CG_S" bash -c "$(declare -f sc); sc bench probe --preset gpt2-small --cuda-graphs --parity-seeds 20 --no-cross-process --json-out $out/probe_small_cg.json" > "$out/small_cg.log" 2>&1
  tail -n 8 "$out/small_cg.log"
fi
stage done
