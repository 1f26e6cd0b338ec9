#!/usr/bin/env bash
# Build the lab, grader and hub images offline-style, FROM the local base (base-image.sh) and with the
# torch CPU wheel from this machine's disk handed in through the build context.
#   env BASE_IMAGE     default ddp-course/python:3.11-local
#   env TORCH_VERSION  default 2.13.0 (the wheel pip's find-links holds here)
#   env TAG_PREFIX     default ddp-course (images: $TAG_PREFIX:lab, $TAG_PREFIX:grader, $TAG_PREFIX:hub)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
context=$repo/docker/ci/context
base_image=${BASE_IMAGE:-ddp-course/python:3.11-local}
torch_version=${TORCH_VERSION:-2.13.0}
prefix=${TAG_PREFIX:-ddp-course}

mkdir -p "$context"
if ! compgen -G "$context/torch-${torch_version}*.whl" >/dev/null; then
    # --no-index: take the wheel from pip's find-links (on disk), never PyPI's multi-GB CUDA build.
    pip download --no-index --no-deps --only-binary=:all: -d "$context" "torch==${torch_version}"
fi
ls -l "$context"

build_args=(
    --build-arg "BASE_IMAGE=$base_image"
    --build-arg "TORCH_VERSION=$torch_version"
    --build-arg "TORCH_INDEX_URL=none"  # no index: torch only from the wheel in the context
    --build-arg "LOCAL_WHEELS=docker/ci/context"
)
for var in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
    [[ -n "${!var:-}" ]] && build_args+=(--build-arg "$var")
done

# Seconds since the start on every line, so the log shows where a slow build spends its time.
stamp() { local t0=$SECONDS line; while IFS= read -r line; do printf '[%4d s] %s\n' $((SECONDS - t0)) "$line"; done; }

for target in lab grader hub; do
    start=$SECONDS
    docker build "${build_args[@]}" -f "$repo/docker/Dockerfile" --target "$target" -t "$prefix:$target" "$repo" 2>&1 | stamp
    echo "build: $prefix:$target built in $((SECONDS - start)) s"
done
docker image ls "$prefix" --format 'table {{.Repository}}:{{.Tag}}\t{{.Size}}'
