#!/usr/bin/env bash
# The headline benchmarks on a GPU machine (issue 8), one part per device call:
#   pretrain: gpt2-small on classics, AdamW at three lrs on GPU 0, then the probe-throughput and memory
#             scans there; zocurv-line (in-process probes on the same GPU) on GPU 1.
#   finetune: MiniLM-L6 sentiment, MeZO / 1SPSA / 1.5-SPSA / backprop, runs spread over the GPUs.
# Needs tools/h200_pack.sh run first (carry .h200 and .whl). Writes a tarball and logs under $OUT.
# Usage: bash tools/h200_headline.sh pretrain|finetune [steps]
set -uo pipefail
part=${1:?usage: h200_headline.sh pretrain|finetune [steps]}
steps=${2:-1000}
out=${OUT:-/tmp/headline-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPARECYCLES_CACHE=$PWD/.h200/cache
[ -f .h200/cache/corpora/classics/train.bin.xz ] && xz -d .h200/cache/corpora/classics/train.bin.xz
sc() { python3 -c 'import sys; from sparecycles.cli import app; sys.argv[0] = "sparecycles"; app()' "$@"; }
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
res=/tmp/headline && mkdir -p $res
common=(--preset gpt2-small --corpus classics --steps "$steps" --batch-size 16 --seq-len 512 --warmup-steps $((steps / 10))
        --eval-every $((steps / 20)) --checkpoint-every "$steps" --no-progress)
if [ "$part" = pretrain ]; then
  g1=$(( ngpu > 1 ? 1 : 0 ))
  (
    for lr in 1e-3 5e-4 2e-3; do sc train "${common[@]}" --optimizer adamw --lr $lr --device cuda:0 --run-dir $res/adamw-lr$lr; done
    CUDA_VISIBLE_DEVICES=0 sc bench kernels --preset gpt2-small --json-out $res/kernels.json
    sc bench headline memory --device cuda:0 --json-out $res/memory.json
  ) > "$out/gpu0.log" 2>&1 &
  (
    for lr in 1e-3 2e-3; do
      sc train "${common[@]}" --optimizer zocurv-line --lr $lr --probe-batch-size 8 --curvature-interval 10 \
        --device cuda:$g1 --run-dir $res/zocurv-line-lr$lr
    done
  ) > "$out/gpu1.log" 2>&1 &
  wait
  sc bench headline report $res/adamw-lr* $res/zocurv-line-lr* --out $res/report > "$out/report.log" 2>&1
elif [ "$part" = finetune ]; then
  sc bench zo --part sentiment --device cuda:0 --out $res/sentiment > "$out/gpu0.log" 2>&1
fi
find $res -name 'checkpoint*' -delete
tar -czf "$out/headline-$part.tgz" -C $res .
ls -la "$out"
