#!/usr/bin/env bash
# llama.cpp's `llama-server`, a real serving engine that can be built where no package registry is reachable (the
# GPU machine): its sources ship inside the llama-cpp-python sdist on PyPI. docs/serving.md explains its use.
#
#   bash tools/llamacpp.sh fetch [SRC_DIR]      download the sdist once (pip) and extract only what building
#                                               llama-server needs into SRC_DIR (default $CACHE/llamacpp-src), with
#                                               SRC_DIR.tar.xz beside it; prints both sizes. Idempotent.
#   bash tools/llamacpp.sh build [--cuda] [SRC_DIR [BUILD_DIR]]
#                                               cmake + make of the llama-server target only (default BUILD_DIR
#                                               $CACHE/llamacpp-build, or ...-build-cuda with --cuda); prints the
#                                               binary's path on the last line. A second run only checks (make is
#                                               incremental). CPU: GGML_CUDA=OFF; --cuda: sm_90 only.
#   bash tools/llamacpp.sh bin [--cuda] [BUILD_DIR]
#                                               print the binary's path (exit 2 when it is not built)
#
# CACHE is ${SPARECYCLES_CACHE:-~/.cache/sparecycles}, outside the clone, so a reused machine (CI) builds once.
# JOBS (default: nproc) and NICE (default 0) set make's parallelism and niceness; on a shared machine use NICE=10.
# What is kept of the sdist's vendor/llama.cpp (77 MB; most of it test vocabularies, docs and other backends):
# the top CMake files, cmake/, include/, src/, common/, vendor/, ggml/ without the backends other than the CPU and
# CUDA ones, tools/server (no tests), tools/mtmd (the server links it; no sample media), tools/ui's CMake files
# (the web UI is neither built nor downloaded: LLAMA_BUILD_UI=OFF, LLAMA_USE_PREBUILT_UI=OFF), and
# scripts/ui-assets.cmake. tools/CMakeLists.txt is replaced by one that adds only server, ui and mtmd.
set -euo pipefail
CACHE="${SPARECYCLES_CACHE:-$HOME/.cache/sparecycles}"
VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
SDIST_DIR="$CACHE/llamacpp-sdist"
KEEP="CMakeLists.txt LICENSE cmake include src common vendor ggml licenses tools/server tools/mtmd tools/ui
scripts/ui-assets.cmake"
DROP="ggml/src/ggml-cann ggml/src/ggml-et ggml/src/ggml-hexagon ggml/src/ggml-hip ggml/src/ggml-metal
ggml/src/ggml-musa ggml/src/ggml-opencl ggml/src/ggml-openvino ggml/src/ggml-rpc ggml/src/ggml-sycl
ggml/src/ggml-virtgpu ggml/src/ggml-vulkan ggml/src/ggml-webgpu ggml/src/ggml-zdnn ggml/src/ggml-zendnn
ggml/src/ggml-blas tools/server/tests tools/server/bench tools/mtmd/tests tools/ui/src tools/ui/static
tools/ui/tests tools/ui/package-lock.json"

sdist() {  # the sdist's path, downloaded once
  mkdir -p "$SDIST_DIR"
  local f
  f="$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
  if [ -z "$f" ]; then
    "${PYTHON:-python3}" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" \
      -d "$SDIST_DIR" >&2
    f="$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz"
  fi
  [ -f "$f" ] || { echo "llamacpp.sh: no sdist at $f after pip download" >&2; exit 1; }
  echo "$f"
}

fetch() {
  local dest="${1:-$CACHE/llamacpp-src}" tgz tmp top p
  if [ -f "$dest/.sparecycles-fetched" ] && [ "$(cat "$dest/.sparecycles-fetched")" = "$VERSION" ]; then
    sizes "$dest"; return 0
  fi
  tgz="$(sdist)"
  tmp="$(mktemp -d "${dest%/}.tmp.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  top="llama_cpp_python-$VERSION/vendor/llama.cpp"
  local members=()
  for p in $KEEP; do members+=("$top/$p"); done
  tar -xzf "$tgz" -C "$tmp" "${members[@]}"
  for p in $DROP; do rm -rf "${tmp:?}/$top/$p"; done
  find "$tmp/$top/tools/mtmd" -maxdepth 1 \( -name '*.mp3' -o -name '*.mp4' -o -name '*.jpg' -o -name '*.png' \) \
    -delete
  cat > "$tmp/$top/tools/CMakeLists.txt" <<'EOF'
# Written by sparecycles' tools/llamacpp.sh: only what llama-server needs.
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(ui)
add_subdirectory(mtmd)
add_subdirectory(server)
EOF
  echo "$VERSION" > "$tmp/$top/.sparecycles-fetched"
  rm -rf "$dest"
  mv "$tmp/$top" "$dest"
  rm -rf "$tmp"; trap - EXIT
  tar -C "$(dirname "$dest")" -cJf "$dest.tar.xz" "$(basename "$dest")"
  sizes "$dest"
}

sizes() {
  echo "llama.cpp sources: $1 ($(du -sb "$1" | cut -f1) bytes)"
  [ -f "$1.tar.xz" ] && echo "tarball: $1.tar.xz ($(stat -c %s "$1.tar.xz") bytes)"
  return 0
}

build() {
  local cuda=0
  if [ "${1:-}" = "--cuda" ]; then cuda=1; shift; fi
  local src="${1:-$CACHE/llamacpp-src}" out="${2:-}"
  [ -n "$out" ] || { out="$CACHE/llamacpp-build"; [ $cuda = 1 ] && out="$out-cuda"; }
  [ -f "$src/CMakeLists.txt" ] || { echo "llamacpp.sh build: no llama.cpp sources at $src (run fetch)" >&2; exit 2; }
  local flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON -DGGML_CCACHE=OFF)
  if [ $cuda = 1 ]; then flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
  else flags+=(-DGGML_CUDA=OFF); fi
  mkdir -p "$out"
  exec 9>"$out/.lock"
  flock 9
  # Output in $out/build.log (thousands of lines); its tail on stderr when a step fails.
  if [ ! -f "$out/CMakeCache.txt" ]; then
    cmake -S "$src" -B "$out" "${flags[@]}" > "$out/build.log" 2>&1 || { rm -f "$out/CMakeCache.txt"; fail "$out"; }
  fi
  nice -n "${NICE:-0}" cmake --build "$out" --target llama-server -j "${JOBS:-$(nproc)}" >> "$out/build.log" 2>&1 \
    || fail "$out"
  binary "$out"
}

fail() {
  tail -n 40 "$1/build.log" >&2
  echo "llamacpp.sh build: failed (the whole output: $1/build.log)" >&2
  exit 1
}

binary() {
  local b="$1/bin/llama-server"
  [ -x "$b" ] || { echo "llamacpp.sh: no llama-server at $b (run bash tools/llamacpp.sh build)" >&2; exit 2; }
  echo "$b"
}

case "${1:-}" in
  fetch) shift; fetch "$@" ;;
  build) shift; build "$@" ;;
  bin) shift; c=""; if [ "${1:-}" = "--cuda" ]; then c="-cuda"; shift; fi
       binary "${1:-$CACHE/llamacpp-build$c}" ;;
  *) echo "usage: bash tools/llamacpp.sh fetch [SRC_DIR] | build [--cuda] [SRC_DIR [BUILD_DIR]] |" \
       "bin [--cuda] [BUILD_DIR]" >&2; exit 2 ;;
esac
