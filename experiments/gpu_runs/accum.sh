#!/usr/bin/env bash
# Issue 28 on one GPU (about 2 minutes): ZO-Curv gradient accumulation on CUDA. zocurv-global (probes in process),
# gpt2-small 8 x 256 on classics-large, 20 steps: the plain run, the same with --micro-batch-size 2 (4 passes per
# step, one process), and under torchrun N=1 with --micro-batch-size 2 (NCCL process group, DCP checkpoints) log
# the same losses up to fp32 summation order; a second plain run gives the noise floor (CUDA's embedding backward
# adds with atomics). Also: --nproc-per-node 2 on this one-GPU machine is refused before anything starts.
# Prepare here: bash experiments/anytime/run.sh pack (carry .data and .whl). Usage on the device: bash experiments/gpu_runs/accum.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/accum-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPARECYCLES_CACHE=$PWD/.data/cache
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
common=(--preset gpt2-small --corpus classics-large --steps 20 --batch-size 8 --seq-len 256 --warmup-steps 2
        --optimizer zocurv-global --curvature-interval 5 --eval-every 20 --checkpoint-every 20 --no-progress
        --no-export --device cuda --overwrite)
r=/tmp/accum-runs
run() { local name=$1; shift; echo "=== $name"; timeout 120 "$@" > "$out/$name.log" 2>&1; echo "rc $?"; tail -n 2 "$out/$name.log"; }
run plain python3 -m sparecycles.cli train "${common[@]}" --run-dir $r/plain
run plain2 python3 -m sparecycles.cli train "${common[@]}" --run-dir $r/plain2
run micro2 python3 -m sparecycles.cli train "${common[@]}" --micro-batch-size 2 --run-dir $r/micro2
run n1-micro2 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m sparecycles.cli train "${common[@]}" \
  --micro-batch-size 2 --run-dir $r/n1-micro2
run n2-refused python3 -m sparecycles.cli train "${common[@]}" --nproc-per-node 2 --run-dir $r/n2
python3 - "$r" "$out" <<'PY'
import json, sys
from pathlib import Path
r, out = Path(sys.argv[1]), Path(sys.argv[2])
def losses(d):
    p = r / d / "metrics.jsonl"
    return [(x["step"], k, x[k]) for x in map(json.loads, p.read_text().splitlines()) for k in ("loss", "val_loss")
            if k in x] if p.is_file() else None
base = losses("plain")
res = {}
for d in ("plain2", "micro2", "n1-micro2"):
    other = losses(d)
    ok = base is not None and other is not None and [x[:2] for x in base] == [x[:2] for x in other]
    res[d] = max(abs(a[2] - b[2]) for a, b in zip(base, other)) if ok else None
res["n2_refused"] = "exceeds" in (out / "n2-refused.log").read_text()
(out / "accum_summary.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res))
PY
