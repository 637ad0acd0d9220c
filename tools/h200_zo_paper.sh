#!/usr/bin/env bash
# Issue 18 on one H200: 1.5-SPSA in its published regime vs 1SPSA, MeZO and backprop (benchmarks.zo_paper), in
# two device calls on one warm machine, because SmolLM2's GGUF (98 MB) travels in two halves (the layout of
# `tools/h200_pack.sh smollm2`: .h200s1/ and .h200s2/ in the repository root, wheels in .whl/):
#   part1  carries .h200s1 and .whl: keeps .h200s1 in /root/keep (a later call removes carried folders it does
#          not name), times a SmolLM2-shaped forward at batch 512, and runs the bf16 in-place memory scan
#          (largest GPT taking a 1.5-SPSA step with 2 bytes per parameter) -> $OUT/inplace_memory.json
#   part2  carries .h200s2 and .whl (same machine, within its 30 s warm window): rejoins the GGUF, then
#          `bench zo --model smollm2 --regime paper --time-budget TOTAL` (arms A1..A6) -> $OUT/zo-paper/
# Usage: [FP32_MATMUL=highest|high] bash tools/h200_zo_paper.sh part1|part2 [TOTAL seconds for the arms, default 240]
# (the 2026-11-30 run used FP32_MATMUL=high, TF32, then the only choice: see benchmarks/results/h200/zo-paper)
# Sizing: part2 took 287 s at TOTAL 240 with TF32 (GGUF conversion, tokenizing, kernel compiles, one iteration of
# overshoot per arm); part1 26 s. Both stay inside the 450 s the issue allows. At TOTAL 240, A1 gets 58 s: 9
# iterations with TF32 (6.8 s each), fewer with true fp32; the published 38-72 iterations need ~8 min for A1 alone.
set -uo pipefail
part=${1:?usage: h200_zo_paper.sh part1|part2 [TOTAL]}
total=${2:-240}
out=${OUT:-/tmp/zo-paper-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
sc() { python3 -c 'import sys; from sparecycles.cli import app; sys.argv[0] = "sparecycles"; app()' "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$part" = part1 ]; then
  mkdir -p /root/keep && rm -rf /root/keep/.h200s1 && cp -r .h200s1 /root/keep/ || exit 1
  python3 - "$out" <<'PY' 2>&1 | tee "$out/part1.log"
import json, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from benchmarks.zo_paper import inplace_memory_scan
torch.set_float32_matmul_precision("high")
# SmolLM2-135M's shape (random weights): forward time of one batch of 512 prompts of 75 tokens
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
timing = {}
for dt in (torch.float32, torch.bfloat16):
    m = LlamaForCausalLM(cfg).to("cuda", dt).eval()
    x = torch.randint(0, 49152, (512, 75), device="cuda")
    with torch.no_grad():
        for _ in range(3):
            m.model(input_ids=x, use_cache=False)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(10):
            m.model(input_ids=x, use_cache=False)
        torch.cuda.synchronize()
    timing[str(dt)] = (time.perf_counter() - t0) / 10
    del m
print(json.dumps({"forward_s_batch512_len75": timing}), flush=True)
res = inplace_memory_scan("cuda")
res["forward_s_batch512_len75"] = timing
json.dump(res, open(f"{sys.argv[1]}/inplace_memory.json", "w"), indent=2)
PY
  exit 0
fi
[ -d .h200s1 ] || cp -r /root/keep/.h200s1 . || { echo "no .h200s1: run part1 first on this warm machine" >&2; exit 1; }
bash tools/h200_smollm2_cache.sh /tmp/zo-cache || exit 1
export SPARECYCLES_CACHE=/tmp/zo-cache
sc bench zo --part sentiment --model smollm2 --regime paper --device cuda --time-budget "$total" \
  --fp32-matmul "${FP32_MATMUL:-highest}" \
  --out "$out/zo-paper" 2>&1 | tee "$out/part2.log"
