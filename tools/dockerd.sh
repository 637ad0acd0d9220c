#!/usr/bin/env bash
# Make sure a Docker daemon answers on this host, starting one if none does (idempotent: a running one is reused).
# Used by .ci/run, tests/test_compose.py and the README's Deployment section.
#
# The daemon it starts keeps every container on the host's network: no default bridge (docker's would take a
# 172.17.x subnet), no iptables rules. Images are built with `--network host` and docker/compose.cpu.yml runs every
# service with `network_mode: host`, on ports of 127.0.0.1 the caller picks.
# Env: SPARECYCLES_DOCKERD_ROOT (data root, default /var/lib/docker), SPARECYCLES_DOCKERD_LOG.
set -euo pipefail
docker_cli() { command -v /usr/bin/docker || command -v docker; }
if "$(docker_cli)" info >/dev/null 2>&1; then
  echo "dockerd: running"
  exit 0
fi
if ! command -v dockerd >/dev/null; then  # Debian's docker.io (dockerd 20.10, containerd, runc)
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends docker.io >/dev/null
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
