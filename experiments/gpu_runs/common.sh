# Sourced by tools/h200_*.sh on the device machine (repository root as the working folder).
# h200_install [CACHE]: install the carried wheels (.whl, from experiments/gpu_runs/pack.sh) into /tmp/site and point python at
# them and this checkout; with CACHE (a carried cache folder, e.g. .h200/cache), SPARECYCLES_CACHE is set there and its
# classics corpus unpacked. Returns 1 when the install fails.
h200_install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  if [ -n "${1:-}" ]; then
    export SPARECYCLES_CACHE=$PWD/$1
    if [ -f "$1/corpora/classics/train.bin.xz" ]; then xz -d "$1/corpora/classics/train.bin.xz"; fi
  fi
  return 0
}
