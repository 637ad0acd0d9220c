#!/usr/bin/env bash
# The anytime-model benchmark (issue 31) on ONE H200, in one device call of at most ~540 s:
# gpt2-small 16x1024 on classics-large (packed, ~24 MB), AdamW with warmup-stable-decay (constant lr, linear
# decay over the last 20%); at each evaluation the raw and served validation losses, the winning candidate and
# the anytime speedup; beside them AdamW runs annealed at 1/4, 1/2 and 3/4 of the run (branched from the main
# run's stable phase, each with its own WSD decay). Candidates are scored in the trainer process on the same GPU
# (experiments/anytime/bench.py says why). Writes $OUT/anytime.json, $OUT/anytime.png, $OUT/table.md and the log.
#
# Here (a machine with the registries), once:   bash experiments/anytime/run.sh pack
#   -> .data/ (classics-large: xz token arrays + manifest) and .whl/ (pydantic & co. for the GPU image's python)
# On the GPU (device call, carry [".data", ".whl"]):   bash experiments/anytime/run.sh [steps] [plain|pull]
#   steps default 1500 (24.6M tokens, under one epoch of the 31.3M training tokens); ~12 steps/s in bf16
#   autocast + TF32 -> ~165 s of main-run steps + ~40 s of references + evaluations; stopped at a deadline.
# Then here: python -m experiments.anytime.report OUT/anytime.json --out results/anytime \
#   [--pull-json OUT2/anytime_pull.json]   (a second call: bash experiments/anytime/run.sh 1500 pull)
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = pack ]; then
  set -e
  .venv/bin/sparecycles data pack --corpus classics-large --out .data
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 tenacity==9.2.1 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 tensorboardX==2.6.5  # trainer.events (regime's runs)
  du -sb .data .whl
  echo "carry .data + .whl + tracked files: $(( ($(du -sb .data .whl | awk '{s += $1} END {print s}') \
    + $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)) / 1048576 )) MiB of 64"
  exit 0
fi
steps=${1:-1500}
arm=${2:-plain}   # "pull": the --pull ablation instead (no references; compare its final raw loss with the plain run's)
out=${OUT:-/tmp/anytime-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPARECYCLES_CACHE=$PWD/.data/cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
extra=(); name=anytime
[ "$arm" = pull ] && extra=(--pull --ref-fracs "") && name=anytime_pull
timeout "${ANYTIME_TIMEOUT_S:-530}" python3 -m experiments.anytime.bench --out "$out" --steps "$steps" --device cuda \
  --deadline-s "${ANYTIME_DEADLINE_S:-470}" --name "$name" "${extra[@]}" 2>&1 | tee "$out/$name.log"
rm -f "$out/served.safetensors"  # 500 MB of weights: not worth carrying back
[ "$arm" = plain ] && [ -f "$out/anytime.json" ] && \
  python3 -m experiments.anytime.report "$out/anytime.json" --out "$out" > /dev/null
tail -30 "$out/table.md" 2>/dev/null
