#!/usr/bin/env bash
# Builds the CPU engine image for tests without any registry (see docker/README.md):
#   1. local/bookworm-py311:1 from Debian packages with mmdebstrap, imported into Docker;
#   2. qualify-engine:cpu-<hash> from docker/Dockerfile.cpu, with the CPU torch wheel from the host's disk.
# Skips whatever `docker image inspect` already finds. Prints the engine image tag as the last line.
set -euo pipefail

DOCKER=${DOCKER:-/usr/bin/docker}   # Debian's client: the one on PATH may lack buildx (BuildKit fails)
BASE=${QUALIFY_BASE_IMAGE:-local/bookworm-py311:1}
MIRROR=${QUALIFY_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACERT=${QUALIFY_CACERT:-/etc/ssl/certs/ca-certificates.crt}
TORCH_SPEC='torch==2.13.0+cpu'
ROOT=$(cd "$(dirname "$0")/.." && pwd)

# What the engine image contains (and so what its tag hashes): the engine, its protocol, the kernels.
ENGINE_PATHS=(pyproject.toml README.md qualify/__init__.py qualify/settings.py qualify/protocol.py qualify/shm.py qualify/engine kernels)

log() { echo "build-cpu-image: $*" >&2; }

"$DOCKER" info >/dev/null 2>&1 || { log "the Docker daemon is not reachable; start dockerd (see docker/README.md)"; exit 1; }

# ---- 1. base image
if "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
  log "base image $BASE present"
else
  command -v mmdebstrap >/dev/null || { log "mmdebstrap is missing; run: apt-get install -y mmdebstrap"; exit 1; }
  log "building base image $BASE with mmdebstrap (about 30 s)"
  mmdebstrap --quiet --variant=apt --include=python3,python3-venv,ca-certificates bookworm - \
    "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
    | "$DOCKER" import - "$BASE" >/dev/null
fi

# ---- 2. build context: the engine's files (no caches), then its content hash names the image
CTX=$(mktemp -d /tmp/qualify-image-ctx.XXXXXX)
trap 'rm -rf "$CTX"' EXIT
mkdir -p "$CTX/src" "$CTX/wheels"
cd "$ROOT"
for p in "${ENGINE_PATHS[@]}"; do
  [ -e "$p" ] || { log "missing $p in $ROOT"; exit 1; }
  # --parents keeps the relative path; skip bytecode and editor leftovers
  find "$p" \( -name __pycache__ -o -name '*.pyc' -o -name '*.egg-info' \) -prune -o -type f -print0 \
    | xargs -0 cp --parents -t "$CTX/src"
done
cp docker/Dockerfile.cpu "$CTX/Dockerfile"
HASH=$( (cd "$CTX" && find src Dockerfile -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) \
  | sha256sum | cut -c1-12)
TAG=${QUALIFY_ENGINE_IMAGE:-qualify-engine:cpu-$HASH}

if "$DOCKER" image inspect "$TAG" >/dev/null 2>&1; then
  log "engine image $TAG present"
  echo "$TAG"
  exit 0
fi

# The CPU wheel lies on the host's disk (PyPI's Linux torch is the CUDA build): let the host's pip find it.
if ! ls "$ROOT"/.venv/bin/python >/dev/null 2>&1; then PY=python3; else PY="$ROOT/.venv/bin/python"; fi
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$CTX/wheels" "$TORCH_SPEC" >&2

log "building engine image $TAG"
DOCKER_BUILDKIT=1 "$DOCKER" build --quiet \
  --secret "id=cacert,src=$CACERT" \
  --build-arg "BASE=$BASE" --build-arg "TORCH_SPEC=$TORCH_SPEC" \
  --label "org.qualify.engine-hash=$HASH" \
  -t "$TAG" "$CTX" >&2
echo "$TAG"
