#!/usr/bin/env bash
# Issue 28 on one GPU (about 2 minutes): the same `sparecycles train` command run plainly and under torchrun with
# N=1 (`python -m torch.distributed.run --standalone --nproc-per-node 1 -m sparecycles.cli train ...`: process
# group on NCCL, rank 0 pinned to cuda:0, DCP checkpoints) logs the same losses. AdamW and 1.5-SPSA, gpt2-small
# 8 x 256 on classics, 20 steps. A second plain AdamW run gives the noise floor (CUDA's embedding backward adds
# with atomics, so two plain runs may differ in the last bits); 1.5-SPSA is forward-only and must match exactly.
# With more than one GPU it also times N=2 vs N=1 (tokens/s; goal >= 1.9x), else says it did not.
# Needs experiments/gpu_runs/pack.sh run first (carry .h200 and .whl). Writes torchrun_summary.json and logs under $OUT.
# Usage (repository root on the device): bash experiments/gpu_runs/torchrun.sh [steps]
set -uo pipefail
cd "$(dirname "$0")/../.."
steps=${1:-20}
out=${OUT:-/tmp/torchrun-out}
mkdir -p "$out"
source experiments/gpu_runs/common.sh
h200_install .h200/cache || exit 1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$out/gpus.txt"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
t0=$(date +%s)
common=(--preset gpt2-small --corpus classics --steps "$steps" --batch-size 8 --seq-len 256 --warmup-steps 2
        --eval-every "$steps" --checkpoint-every "$steps" --no-progress --no-export --device cuda --overwrite)
plain=(python3 -m sparecycles.cli train)
launch=(python3 -m torch.distributed.run --standalone --nproc-per-node)
r=/tmp/torchrun-runs
for opt in adamw 1.5spsa; do
  extra=(); [ "$opt" = 1.5spsa ] && extra=(--probes 4 --lr 1e-5)
  echo "=== $opt plain at +$(( $(date +%s) - t0 )) s"
  timeout 60 "${plain[@]}" "${common[@]}" "${extra[@]}" --optimizer $opt --run-dir $r/$opt-plain > "$out/$opt-plain.log" 2>&1
  tail -n 1 "$out/$opt-plain.log"
  echo "=== $opt torchrun N=1 at +$(( $(date +%s) - t0 )) s"
  timeout 60 "${launch[@]}" 1 -m sparecycles.cli train "${common[@]}" "${extra[@]}" --optimizer $opt --run-dir $r/$opt-n1 \
    > "$out/$opt-n1.log" 2>&1
  tail -n 1 "$out/$opt-n1.log"
done
echo "=== adamw plain again (noise floor) at +$(( $(date +%s) - t0 )) s"
timeout 60 "${plain[@]}" "${common[@]}" --optimizer adamw --run-dir $r/adamw-plain2 > "$out/adamw-plain2.log" 2>&1
if [ "$ngpu" -gt 1 ]; then
  echo "=== adamw torchrun N=2 at +$(( $(date +%s) - t0 )) s"
  timeout 90 "${launch[@]}" 2 -m sparecycles.cli train "${common[@]}" --optimizer adamw --run-dir $r/adamw-n2 > "$out/adamw-n2.log" 2>&1
fi
python3 - "$r" "$out" "$ngpu" <<'PY'
import json, sys
from pathlib import Path
r, out, ngpu = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
def losses(d):
    p = r / d / "metrics.jsonl"
    if not p.is_file():
        return None
    recs = [json.loads(x) for x in p.read_text().splitlines()]
    return [(x["step"], k, x[k]) for x in recs for k in ("loss", "val_loss") if k in x]
def diff(a, b):
    la, lb = losses(a), losses(b)
    if not la or not lb or [x[:2] for x in la] != [x[:2] for x in lb]:
        return None
    return max(abs(x[2] - y[2]) for x, y in zip(la, lb))
def tps(d):
    p = r / d / "summary.json"
    if not p.is_file():
        return None
    s = json.loads(p.read_text())
    return s["tokens"] / s["wall_s_this_invocation"]
summary = {
    "adamw_n1_vs_plain_max_abs": diff("adamw-plain", "adamw-n1"),
    "adamw_plain_vs_plain_max_abs": diff("adamw-plain", "adamw-plain2"),
    "spsa_n1_vs_plain_max_abs": diff("1.5spsa-plain", "1.5spsa-n1"),
    "spsa_n1_equals_plain": losses("1.5spsa-plain") is not None and losses("1.5spsa-plain") == losses("1.5spsa-n1"),
    "tokens_per_s": {"plain": tps("adamw-plain"), "n1": tps("adamw-n1"), "n2": tps("adamw-n2") if ngpu > 1 else None},
    "n2_not_run": None if ngpu > 1 else f"{ngpu} GPU on this machine",
}
t = summary["tokens_per_s"]
summary["n2_over_n1"] = t["n2"] / t["n1"] if t["n2"] and t["n1"] else None
(out / "torchrun_summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY
echo "=== done at +$(( $(date +%s) - t0 )) s"
