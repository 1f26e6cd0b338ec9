#!/usr/bin/env bash
# Build a local Python 3.11 base image for machines that reach no image registry
# (our CI: Debian apt and PyPI only). Two images, each skipped when it exists:
#   ddp-course/debian:bookworm      debootstrap minbase, imported with `docker import`
#   ddp-course/python:3.11-local    + Debian's python3 (3.11) and a venv on PATH, like python:3.11-slim
# The machine's CA bundle goes in: HTTPS from inside builds may pass a proxy whose CA only the host trusts.
#   env MIRROR   your Debian mirror (default: the first `deb` source for bookworm in this machine's own apt
#                sources, one-line or deb822, as apt-get reads them; none is named in this repository)
#   env CA_FILE  CA bundle to copy in (default /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
debian_image=ddp-course/debian:bookworm
python_image=ddp-course/python:3.11-local
ca_file=${CA_FILE:-/etc/ssl/certs/ca-certificates.crt}

if docker image inspect "$python_image" >/dev/null 2>&1; then
    echo "base-image: $python_image exists; nothing to do"
    exit 0
fi

if ! docker image inspect "$debian_image" >/dev/null 2>&1; then
    mirror=${MIRROR:-$("$here/apt-mirror.sh" bookworm)} || exit 1
    rootfs=$(mktemp -d /tmp/ddp-course-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    echo "base-image: debootstrap bookworm from $mirror into $rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
        || { tail -n 30 "$rootfs.log" >&2; exit 1; }
    rm -f "$rootfs.log"
    install -D -m 0644 "$ca_file" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    # Also a local CA, so that installing Debian's ca-certificates later keeps the host's CAs in the bundle.
    install -D -m 0644 "$ca_file" "$rootfs/usr/local/share/ca-certificates/ci-host-bundle.crt"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import - "$debian_image"
fi

echo "base-image: building $python_image"
build_args=(--build-arg "DEBIAN_IMAGE=$debian_image")
for var in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
    [[ -n "${!var:-}" ]] && build_args+=(--build-arg "$var")
done
docker build "${build_args[@]}" -t "$python_image" -f "$here/python-local.Dockerfile" "$here"
