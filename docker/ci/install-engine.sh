#!/usr/bin/env bash
# Install and start a Docker engine on a Debian bookworm machine without systemd
# (our CI runner: root, no image registry reachable, Debian apt reachable).
# Idempotent: if an engine already answers, it does nothing.
#   env DOCKERD_LOG  where dockerd logs (default /var/log/dockerd.log)
set -euo pipefail

log=${DOCKERD_LOG:-/var/log/dockerd.log}

if docker info >/dev/null 2>&1; then
    echo "install-engine: a Docker engine already answers; nothing to do"
    exit 0
fi

packages=()
command -v dockerd >/dev/null || packages+=(docker.io)
command -v debootstrap >/dev/null || packages+=(debootstrap)
# Compose: bookworm has no compose plugin, only docker-compose v1 (1.29, reads compose.yml and profiles).
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || packages+=(docker-compose)
if ((${#packages[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${packages[@]}"
fi

if ! pgrep -x dockerd >/dev/null; then
    echo "install-engine: starting dockerd (log: $log)"
    # No systemd here: run the daemon by hand, detached from this shell.
    nohup dockerd >"$log" 2>&1 &
fi

for _ in $(seq 60); do
    if docker info >/dev/null 2>&1; then
        docker version --format 'install-engine: engine {{.Server.Version}} (client {{.Client.Version}}) is up'
        exit 0
    fi
    sleep 1
done
echo "install-engine: dockerd did not answer within 60 s; last lines of $log:" >&2
tail -n 30 "$log" >&2
exit 1
