#!/usr/bin/env bash
# Issue 29, reduced plan, ONE device call on one H200 (<= 540 s): experiments.regime.plan's plan "h200" — gpt2-small,
# 32x512 tokens per step on classics-large, T_ref 200 (3.3M tokens of its 31.3M), AdamW lr 6e-4 / 1.2e-3 cosine and
# 1.2e-3 linear-to-zero, the static table (normalised) at 6e-4 and 1.2e-3, the trust region from the table and
# from 1 at 1.2e-3, and the trust region from the table at T = 150: 8 runs, 4 at a time on the GPU. Memory (measured
# 2026-12-02): a gpt2-small run of 32x512 in fp32 peaks at ~27.5 GB, so 4 at once fit in the H200's ~139 GB; 6 at
# once ran out of memory (4 of 8 runs died). Follow-up calls resume from the earlier calls' run folders, carried in:
# RUNS=$PWD/.regime-runs PLAN=h200b|h200c|h200d (experiments.regime.plan's PLANS; results in experiments/regime/results/).
# Prepare here (once, repository root): bash experiments/anytime/run.sh pack   -> .data/ (classics-large packed by
# `sparecycles data pack`, with its selection split, where the trust region's held-out probe batches come from)
# and .whl/ (the same carry as the anytime benchmark's).
# Run: device `run` with carry [".data", ".whl"], timeout_s 560, command `bash experiments/regime/run.sh`.
# Back in $OUT (7 files): run.log, report.log, gpus.txt, regime_summary.json, regime.png, regime_tables.md and
# runs.tgz (every run folder: metrics.jsonl, spec.json, summary.json, logs). Here, afterwards:
#   mkdir -p experiments/regime/results && cp FILES_AT/regime_* experiments/regime/results/
#   python -m experiments.regime.score tables experiments/regime/results/regime_summary.json \
#       experiments/regime/results/regime_tables.md
# (or untar runs.tgz into DIR and `python -m experiments.regime report DIR`, which also draws the PNG).
# Env: PLAN (default h200), RUNS (/tmp/regime-runs), JOBS (4), CALL_S (530: the call ends by then), PY (python3), DEVICES (cuda), EXTRA (more `run` options, e.g.
# "--batch-size 16 --seq-len 512" if 8 runs of 32x512 prove too slow: the summary says which finished).
# Sizing (estimate, not measured): issue 17's 7 concurrent gpt2-small runs of 400 x 16x512 took 272 s on this
# GPU (~80k tokens/s over all runs); 8 runs of 200 x 32x512 are 26M tokens plus ~15% probe forwards and two
# evaluations of 16x32 validation windows each: ~300-400 s at 80-100k tokens/s. The deadline stops what has not finished
# (reported as partial, not scored), so lower EXTRA's sizes rather than raise CALL_S.
set -uo pipefail
t_start=$(date +%s)
call_s=${CALL_S:-530}
out=${OUT:-/tmp/regime-out}
runs=${RUNS:-/tmp/regime-runs}
mkdir -p "$out"
py=${PY:-python3}
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
[ -d .data/cache ] && export SPARECYCLES_CACHE=$PWD/.data/cache  # load_corpus unpacks the .bin.xz files itself
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no GPU") | tee "$out/gpus.txt"
left=$((t_start + call_s - $(date +%s) - 45))  # 45 s kept for the report and the tarball
# shellcheck disable=SC2086
timeout -k 10 $((left + 25)) $py -m experiments.regime run --plan "${PLAN:-h200}" --out "$runs" \
  --jobs "${JOBS:-4}" --devices "${DEVICES:-cuda}" --deadline-s "$left" ${EXTRA:-} 2>&1 | tee "$out/run.log"
timeout 30 $py -m experiments.regime report "$runs" > "$out/report.log" 2>&1 || echo "report failed: see report.log"
for f in regime_summary.json regime.png regime_tables.md; do [ -f "$runs/$f" ] && cp "$runs/$f" "$out/"; done
tar czf "$out/runs.tgz" -C "$runs" --exclude='*.safetensors' --exclude=export .
echo "done in $(( $(date +%s) - t_start )) s"
