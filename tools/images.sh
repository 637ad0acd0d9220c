#!/usr/bin/env bash
# The images docker/compose.cpu.yml runs, built on this host from Debian packages and pip, with no registry at all:
#   sparecycles-debian:bookworm       debootstrap --variant=minbase bookworm, imported with `docker import`
#   sparecycles-python:bookworm       + Debian's python3 in a venv on PATH (docker/debian/python.Dockerfile)
#   sparecycles:cpu                   docker/Dockerfile on that base; torch's CPU wheel from pip's find-links
#   sparecycles-redis:bookworm        Debian's redis-server (docker/debian/redis.Dockerfile)
#   sparecycles-prometheus:bookworm   Debian's prometheus (docker/debian/prometheus.Dockerfile)
# Grafana has no Debian package: compose.cpu.yml runs none; tests/deploy/test_ops_fleet.py checks the dashboard's queries
# against a live Prometheus instead.
#
# Idempotent: each image carries a label with the sha256 of its inputs (recipe, base image, build arguments, the
# project's files for sparecycles:cpu); an image whose inputs are unchanged is kept, so a second run takes seconds.
# Builds run with BuildKit and `--network host` (tools/dockerd.sh's daemon has no bridge). Env:
#   SPARECYCLES_DEBIAN_MIRROR  debootstrap's mirror (http://deb.debian.org/debian)
#   SPARECYCLES_CA_BUNDLE      the CA bundle pip trusts in the builds, a BuildKit secret (default: the host's
#                              /etc/ssl/certs/ca-certificates.crt, which holds a TLS-intercepting proxy's CA)
#   SPARECYCLES_WHEELS         a folder of wheels pip may use, served on 127.0.0.1 for the build (default: pip's
#                              find-links when it is a local folder); torch comes from it when it holds TORCH_SPEC
#   SPARECYCLES_TORCH          torch's requirement (torch==2.13.0)
#   SPARECYCLES_IMAGE_DATA     `sparecycles data fetch` arguments baked into sparecycles:cpu's cache ("--corpus
#                              classics-small": compose.cpu.yml's trainer then needs no registry); empty: none
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/dockerd.sh >/dev/null
LABEL=org.sparecycles.inputs
SUITE=bookworm
MIRROR=${SPARECYCLES_DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_SPEC=${SPARECYCLES_TORCH:-torch==2.13.0}
DATA_FETCH=${SPARECYCLES_IMAGE_DATA---corpus classics-small}
export DOCKER_BUILDKIT=1
# A CLI that builds with BuildKit: one with the buildx plugin, or Debian's 20.10 CLI (BuildKit built in).
if docker buildx version >/dev/null 2>&1 || [ ! -x /usr/bin/docker ]; then DOCKER=docker; else DOCKER=/usr/bin/docker; fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/sparecycles-images.XXXXXX")
server=""
cleanup() { [ -z "$server" ] || kill "$server" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

sha() { sha256sum | cut -c1-16; }
inputs_of() { $DOCKER image inspect -f "{{ index .Config.Labels \"$LABEL\" }}" "$1" 2>/dev/null || true; }
id_of() { $DOCKER image inspect -f '{{.Id}}' "$1"; }

# build TAG DOCKERFILE CONTEXT INPUTS [docker build arguments...]: skipped when TAG's label says INPUTS already.
build() {
  local tag=$1 file=$2 context=$3 inputs=$4 start=$SECONDS
  shift 4
  if [ "$(inputs_of "$tag")" = "$inputs" ]; then echo "$tag: up to date"; return; fi
  if ! $DOCKER build --network host --progress plain -f "$file" --label "$LABEL=$inputs" -t "$tag" "$@" "$context" \
      >"$tmp/build.log" 2>&1; then
    echo "building $tag failed; the build's log ends:" >&2
    tail -n 40 "$tmp/build.log" >&2
    exit 1
  fi
  echo "$tag: built in $((SECONDS - start)) s"
}

# 1. The Debian base: debootstrap's minbase, apt-get able, services never started by a package's scripts.
base=sparecycles-debian:$SUITE
inputs=$(printf 'debootstrap --variant=minbase %s %s; policy-rc.d 101' "$SUITE" "$MIRROR" | sha)
if [ "$(inputs_of "$base")" != "$inputs" ]; then
  start=$SECONDS
  command -v debootstrap >/dev/null || { apt-get update -qq >/dev/null; apt-get install -y -qq debootstrap >/dev/null; }
  debootstrap --variant=minbase "$SUITE" "$tmp/rootfs" "$MIRROR" >"$tmp/debootstrap.log" 2>&1 \
    || { tail -n 30 "$tmp/debootstrap.log" >&2; exit 1; }
  printf '#!/bin/sh\nexit 101\n' >"$tmp/rootfs/usr/sbin/policy-rc.d"  # as Debian's own images: no daemon starts
  chmod +x "$tmp/rootfs/usr/sbin/policy-rc.d"
  rm -rf "$tmp"/rootfs/var/lib/apt/lists/* "$tmp"/rootfs/var/cache/apt/*.bin "$tmp"/rootfs/var/cache/apt/archives/*.deb
  tar --numeric-owner -C "$tmp/rootfs" -c . | $DOCKER import --change "LABEL $LABEL=$inputs" --change 'CMD ["bash"]' \
    - "$base" >/dev/null
  rm -rf "$tmp/rootfs"
  echo "$base: made in $((SECONDS - start)) s"
else
  echo "$base: up to date"
fi

# 2. Debian's Python, Redis and Prometheus on it.
for name in python redis prometheus; do
  file=docker/debian/$name.Dockerfile
  build "sparecycles-$name:$SUITE" "$file" docker/debian "$( (cat "$file"; id_of "$base") | sha)" \
    --build-arg "BASE_IMAGE=$base"
done

# 3. The project's CPU image. Inputs: its recipe, its base, torch's spec and every file the build context lets in.
python_base=sparecycles-python:$SUITE
allowed=$(sed -n 's/^!//p' .dockerignore)
# shellcheck disable=SC2086  # the allowed paths are words
inputs=$( (cat docker/Dockerfile .dockerignore; id_of "$python_base"; echo "$TORCH_SPEC $DATA_FETCH"
           find $allowed -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z \
             | xargs -0 sha256sum) | sha)
if [ "$(inputs_of sparecycles:cpu)" = "$inputs" ]; then
  echo "sparecycles:cpu: up to date"
else
  args=(--build-arg "BASE_IMAGE=$python_base" --build-arg "TORCH_SPEC=$TORCH_SPEC" --build-arg "DATA_FETCH=$DATA_FETCH")
  ca=${SPARECYCLES_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
  [ ! -f "$ca" ] || args+=(--secret "id=ca_bundle,src=$ca")
  wheels=${SPARECYCLES_WHEELS:-${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}}
  if [ -d "$wheels" ]; then
    # The build reaches the folder over loopback (its RUN steps share the host's network).
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >/dev/null 2>&1 &
    server=$!
    for _ in $(seq 1 50); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/', timeout=1)" \
      2>/dev/null && break; sleep 0.1; done
    args+=(--build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/")
    # torch's CPU build from the folder when it is there (its dependencies still come from the index).
    version=${TORCH_SPEC#torch==}
    if compgen -G "$wheels/torch-${version}+cpu-*.whl" >/dev/null; then
      args+=(--build-arg "TORCH_SPEC=torch==${version}+cpu" --build-arg "TORCH_PIP_ARGS=")
    fi
  fi
  build sparecycles:cpu docker/Dockerfile . "$inputs" "${args[@]}"
fi
$DOCKER image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^sparecycles' | sort
