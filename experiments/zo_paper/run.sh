#!/usr/bin/env bash
# Issue 18 on one H200: 1.5-SPSA in its published regime vs 1SPSA, MeZO and backprop (experiments.zo_paper.paper), in
# three device calls on one warm machine (each <= 600 s; SmolLM2's 98 MB GGUF travels in two halves, the layout
# of `experiments/gpu_runs/pack.sh smollm2`: .h200s1/ and .h200s2/ in the repository root, wheels in .whl/):
#   part1  carries .h200s1 + .whl: keeps .h200s1 in /root/keep (a later call removes carried folders it does not
#          name); times one SmolLM2-shaped forward of training batch 0 (512 prompts) padded to its longest row
#          and length-bucketed, in true fp32 / TF32 / bf16, and prints A1's projected seconds per iteration; then
#          the bf16 in-place memory scan (55B, 60B, 66B, 70B, 73B until one runs out of memory)
#          -> $OUT/forward_timing.json, $OUT/inplace_memory.json.  ~70-100 s.
#   part2  carries .h200s2 + .whl: rejoins and converts the GGUF into /tmp/zo-cache (once per machine; keeps
#          .h200s2 in /root/keep too), then `python -m experiments.zo --regime paper` on ARMS (default A1) until the call's
#          deadline; the summary goes to $OUT/zo-paper and /root/keep/zo-paper (the next call includes it).
#   part3  carries .whl only: reuses /tmp/zo-cache (rebuilt from /root/keep's halves if missing), includes
#          /root/keep/zo-paper/paper_summary.json with --resume (an arm that stopped on time there continues
#          where it stopped: its step ledger is replayed), runs ARMS (default A1,A3,A5-3e-05,A6-5e-05 with
#          SHARES A1=70,A3=24,A5-3e-05=3,A6-5e-05=3), measures the drift on A1's ledger, and leaves the merged
#          summary in $OUT/zo-paper and /root/keep/zo-paper (a part4 with other ARMS merges it the same way).
# Usage: [ARMS=..] [SHARES=..] [FP32_MATMUL=highest|high|high,A1=highest,..] [CALL_S=575] [EXTRA="--iters-cap 2"] \
#          bash experiments/zo_paper/run.sh part1|part2|part3
# Every call ends by CALL_S seconds after it started (default 575 of the 600 s limit): the bench gets
# `--end-by` (its arms' budget shrinks to what is left after loading), and `timeout` kills it 15 s after that
# as a last resort (the summary is written after every arm, so only a killed arm would be lost).
#
# Sizing, measured 2026-12-01 (session 6, experiments/zo_paper/results/fp32/RESULTS.md): true fp32 A1 = 12.1 s
# per iteration (81 bucketed forwards of ~0.15 s + an evaluation every 3 iterations), so 75 iterations = 15 min;
# A3 (80 forwards) 11.9 s; A2 (bf16 in place) 7.5 s; MeZO 0.051 s per step. part1's projection (12.6 s) held;
# the pre-run estimate here (8-9 s, assuming ~50-60 TFLOP/s fp32) was 1.4x too low. Length bucketing pays only
# in true fp32 (batch-0 forward 0.212 -> 0.154 s, 1.38x for 1.78x fewer tokens); TF32 0.083 -> 0.085 s (none);
# bf16 0.055 -> 0.130 s (slower, unexplained; A2 ran 7.5 s/iteration bucketed vs 4.9 s unbucketed in session 5).
# Session 6's split (25.5 min of device time): part1 39 s; part2 A1 42 iterations (560 s); part3
# ARMS=A3,A5-3e-05,A6-5e-05 SHARES=A3=85,A5-3e-05=7,A6-5e-05=8 (A3 39 iterations, MeZO, AdamW, drift; 570 s);
# part3 again with ARMS=A2 SHARES=A2=100 CALL_S=370 (A2 46 iterations). Still missing, per call (~20 s of
# loading each on a warm machine): A1 resumed 42 -> 75 (~400 s), A3 39 -> 75 (~430 s), A2 from scratch to 75
# (~565 s + loading, at the limit of one call: in-place arms cannot resume), A3w (~890 s, two calls),
# A4-16/A4-128 (~400 s est.), MeZO/AdamW 1e-5 (~40 s each). part3's default shares (A1=70,...) give a resumed
# A1 ~390 s, about the ~33 iterations it lacks.
set -uo pipefail
t_start=$(date +%s)
part=${1:?usage: h200_zo_paper.sh part1|part2|part3}
case "$part" in part1|part2|part3) ;; *) echo "usage: h200_zo_paper.sh part1|part2|part3" >&2; exit 2 ;; esac
call_s=${CALL_S:-575}
end_by=$((t_start + call_s))
out=${OUT:-/tmp/zo-paper-out}
keep=${KEEP:-/root/keep}
cache=${ZO_CACHE:-/tmp/zo-cache}
mkdir -p "$out" "$keep"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
left() { echo $((end_by - $(date +%s))); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$part" = part1 ]; then
  rm -rf "$keep/.h200s1" && cp -r .h200s1 "$keep/" || exit 1
  timeout -k 5 "$(( $(left) - 5 ))" python3 - "$out" <<'PY' 2>&1 | tee "$out/part1.log"
import json, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from experiments.zo_paper.paper import inplace_memory_scan
from trainer.prompt_classifier import PromptClassifier
# SmolLM2-135M's shape (random weights); training batch 0 of the paper regime: one chunk 512 x 66, or its
# length buckets (experiments.zo_paper.length_buckets on the real lengths, computed on CPU)
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
layouts = {"one_chunk": [(512, 66)], "bucketed": [(155, 24), (177, 34), (115, 43), (65, 66)]}
def batch(rows, t):
    lens = torch.randint(max(1, t - 9), t + 1, (rows,), device="cuda"); lens[0] = t
    mask = (torch.arange(t, device="cuda")[None] < lens[:, None]).long()
    return torch.randint(0, 49152, (rows, t), device="cuda") * mask, mask
timing = {}
for name, dt, prec in (("fp32_highest", torch.float32, "highest"), ("fp32_tf32", torch.float32, "high"),
                       ("bf16", torch.bfloat16, "highest")):
    torch.set_float32_matmul_precision(prec)
    with torch.device("cuda"):
        m = PromptClassifier(LlamaForCausalLM(cfg), [0, 1]).to(dt).eval()
    for lay, shapes in layouts.items():
        bs = [batch(r, t) for r, t in shapes]
        with torch.no_grad():
            for _ in range(2):
                [m(input_ids=i, attention_mask=k) for i, k in bs]
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(5):
                [m(input_ids=i, attention_mask=k) for i, k in bs]
            torch.cuda.synchronize()
        timing[f"{name}_{lay}_s"] = (time.perf_counter() - t0) / 5
    del m
torch.set_float32_matmul_precision("highest")
timing["A1_s_per_iteration_fp32_bucketed"] = 81 * timing["fp32_highest_bucketed_s"] + 0.15
timing["A1_75_iterations_min"] = 75 * timing["A1_s_per_iteration_fp32_bucketed"] / 60
print(json.dumps({"forward_timing": timing}), flush=True)
json.dump(timing, open(f"{sys.argv[1]}/forward_timing.json", "w"), indent=2)
res = inplace_memory_scan("cuda")
json.dump(res, open(f"{sys.argv[1]}/inplace_memory.json", "w"), indent=2)
PY
  echo "part1 wall $(( $(date +%s) - t_start )) s"
  exit 0
fi
# part2 / part3: the SmolLM2 cache, once per machine
if [ ! -f "$cache/models/smollm2-135m/source.json" ] || [ ! -f "$cache/tasks/sentiment/manifest.json" ]; then
  [ -d .h200s1 ] || cp -r "$keep/.h200s1" . || { echo "no .h200s1: run part1 first on this warm machine" >&2; exit 1; }
  [ -d .h200s2 ] || cp -r "$keep/.h200s2" . || { echo "no .h200s2: carry it (part2)" >&2; exit 1; }
  bash experiments/headline/smollm2_cache.sh "$cache" || exit 1
fi
[ -d .h200s2 ] && { rm -rf "$keep/.h200s2"; cp -r .h200s2 "$keep/"; }
export SPARECYCLES_CACHE=$cache
if [ "$part" = part2 ]; then
  arms=${ARMS:-A1}; inc=(); shares=${SHARES:-}
else
  arms=${ARMS:-A1,A3,A5-3e-05,A6-5e-05}; shares=${SHARES:-A1=70,A3=24,A5-3e-05=3,A6-5e-05=3}
  [ -f "$keep/zo-paper/paper_summary.json" ] || { echo "no $keep/zo-paper/paper_summary.json: run part2 first" >&2; exit 1; }
  cp "$keep/zo-paper/paper_summary.json" "$keep/paper_summary.included.json"
  inc=(--include "$keep/paper_summary.included.json" --resume)
fi
drift=(--drift); [ "$part" = part2 ] && drift=(--no-drift)  # part3 measures it on the finished A1 ledger
echo "$part: arms $arms, shares ${shares:-default}, $(left) s left of $call_s"
timeout -k 5 "$(( $(left) + 15 ))" python3 -m experiments.zo \
  --part sentiment --model smollm2 --regime paper --device "${DEVICE:-cuda}" --arms "$arms" --shares "$shares" \
  --time-budget 100000 --end-by "$end_by" --fp32-matmul "${FP32_MATMUL:-highest}" "${drift[@]}" ${inc[@]+"${inc[@]}"} \
  ${EXTRA:-} --out "$out/zo-paper" 2>&1 | grep --line-buffered -v "it/s]" | tee "$out/$part.log"
mkdir -p "$keep/zo-paper" && cp "$out/zo-paper/paper_summary.json" "$keep/zo-paper/" 2>/dev/null
echo "$part wall $(( $(date +%s) - t_start )) s"
