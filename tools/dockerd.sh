#!/usr/bin/env bash
# Make sure a Docker daemon answers on this host, starting one if none does (idempotent: a running one is reused).
# Used by tools/test_services.sh (the README's test command), tests/deploy/test_compose.py and the README's Deployment section.
#
# The daemon it starts keeps every container on the host's network: no default bridge (docker's would take a
# 172.17.x subnet), no iptables rules. Images are built with `--network host` and docker/compose.cpu.yml runs every
# service with `network_mode: host`, on ports of 127.0.0.1 the caller picks.
# Env: SPARECYCLES_DOCKERD_ROOT (data root, default /var/lib/docker), SPARECYCLES_DOCKERD_LOG.
# Debian's docker-compose (the README's Deployment commands) is installed too when missing.
set -euo pipefail
docker_cli() { command -v /usr/bin/docker || command -v docker; }
apt_install() {  # apt_install PACKAGE...: Debian's packages, as root (a message and exit 1 otherwise)
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "dockerd.sh: $* not installed, and this is not root with apt-get: install it (Debian: apt-get install $*)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
if ! command -v docker-compose >/dev/null; then
  apt_install docker-compose
  echo "dockerd: installed Debian's docker-compose"
fi
if "$(docker_cli)" info >/dev/null 2>&1; then
  echo "dockerd: running"
  exit 0
fi
if ! command -v dockerd >/dev/null; then  # Debian's docker.io (dockerd 20.10, containerd, runc)
  apt_install docker.io
fi
root=${SPARECYCLES_DOCKERD_ROOT:-/var/lib/docker}
log=${SPARECYCLES_DOCKERD_LOG:-/var/log/sparecycles-dockerd.log}
mkdir -p "$root" "$(dirname "$log")"
# setsid: the daemon outlives this script and the shell that ran it (CI's, a test's).
setsid dockerd --bridge=none --iptables=false --ip6tables=false --data-root "$root" >>"$log" 2>&1 < /dev/null &
for _ in $(seq 1 120); do
  if "$(docker_cli)" info >/dev/null 2>&1; then
    echo "dockerd: started (pid $!, data root $root, log $log)"
    exit 0
  fi
  sleep 0.5
done
echo "dockerd did not answer within 60 s; its log ($log) ends:" >&2
tail -n 30 "$log" >&2
exit 1
