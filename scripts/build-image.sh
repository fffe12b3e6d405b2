#!/usr/bin/env bash
# Build the rollout-dispatcher image with buildah, from a base image already
# in local storage (no pull: this works offline, and a build never silently
# picks up a newer base).
#
#   scripts/build-image.sh                       # rollout-dispatcher:<version>
#   BASE_IMAGE=python:3.11-slim IMAGE=registry.example/rd:1 scripts/build-image.sh
#
# Environment:
#   BASE_IMAGE  base image for both stages (default python:3.11-slim);
#               fetch it first, e.g. `buildah pull python:3.11-slim`
#   IMAGE       tag of the result (default rollout-dispatcher:<version>)
#
# buildah's own variables pass through: where it cannot create containers
# (nested in another sandbox, or a hybrid cgroup v1/v2 host, where the OCI
# runtime fails with "cgroups in hybrid mode not supported") run RUN steps
# with BUILDAH_ISOLATION=chroot; without overlay support, STORAGE_DRIVER=vfs.
#
# Without buildah or without the base image at hand it says so and exits 0,
# so CI machines without a container runtime pass.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

base="${BASE_IMAGE:-python:3.11-slim}"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)"
image="${IMAGE:-rollout-dispatcher:${version:-dev}}"

if ! command -v buildah >/dev/null 2>&1; then
    echo "build-image: buildah is not installed; not building ${image}"
    exit 0
fi

if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    echo "build-image: base image ${base} is not in local storage; not building ${image}"
    echo "build-image: fetch it (buildah pull ${base}) or set BASE_IMAGE to a local one"
    exit 0
fi

# --format docker keeps HEALTHCHECK (OCI images have no such field).
buildah bud \
    --pull=never \
    --format docker \
    --layers \
    --build-arg "BASE_IMAGE=${base}" \
    --tag "$image" \
    --file Dockerfile \
    .

echo "build-image: built ${image} from ${base}"
