#!/usr/bin/env bash
# The whole Docker CI path on a bare Debian bookworm runner (root, no image registry): engine, local
# Python base, both images, smoke tests. Each step is skipped where its result already exists.
#   --no-smoke  stop after the build (when a later `pytest` run includes tests/test_docker.py anyway)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
steps=(install-engine base-image build smoke)
[[ "${1:-}" == "--no-smoke" ]] && steps=(install-engine base-image build)
for step in "${steps[@]}"; do
    start=$SECONDS
    "$here/$step.sh"
    echo "all: $step took $((SECONDS - start)) s"
done
