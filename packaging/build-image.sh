#!/usr/bin/env bash
# Builds the gpuguard OCI image (packaging/Containerfile) with podman, without a registry: a
# minimal Debian base made here with `debootstrap --variant=minbase` and `podman import`, then the
# packaged glibc-2.28 binary and its default config on it. amd64.
#
#   packaging/build-image.sh [OUTDIR]
#
# The image is left in the local podman storage as localhost/gpuguard:VERSION; with OUTDIR it is
# also written to OUTDIR/gpuguard-image-VERSION-amd64.tar (`podman save`, docker-archive: `podman
# load -i`, `docker load -i`, `ctr -n k8s.io images import`). Prints the image name on its last
# line.
#
# GPUGUARD_RELEASE_DIR: a release directory (target/x86_64-unknown-linux-gnu/release: the
#   stripped gpuguard and assets/config.toml) that packaging/build-release.sh made already;
#   without it, build-release.sh builds one (cargo zigbuild: see docs/packaging.md).
# GPUGUARD_SUITE (default bookworm): the Debian release of the base.
# GPUGUARD_DEBIAN_MIRROR: the Debian mirror (default: the one apt uses on this machine).
# GPUGUARD_IMAGE_CACHE (default /var/tmp/gpuguard-image-cache): the debootstrapped base, kept so
#   that a second run skips debootstrap. Nothing relies on it surviving.
# Needs root, podman and debootstrap (apt-get install podman runc debootstrap).
set -euo pipefail
cd "$(dirname "$0")/.."
fail() {
    echo "build-image: $*" >&2
    exit 1
}
[ "$(id -u)" = 0 ] || fail "run as root (debootstrap, podman's storage)"
for tool in podman debootstrap; do
    command -v "$tool" >/dev/null || fail "$tool not found: apt-get install podman runc debootstrap"
done
OUT=${1:-}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/packaging/containers.conf}
VERSION=$(sed -nE 's/^version = "([^"]+)"$/\1/p' Cargo.toml | head -n 1)
IMAGE=localhost/gpuguard:$VERSION

# 1. The binary, as the packages ship it.
RELEASE=${GPUGUARD_RELEASE_DIR:-}
if [ -z "$RELEASE" ]; then
    RELEASE=$(packaging/build-release.sh | tail -n 1)
fi
[ -x "$RELEASE/gpuguard" ] && [ -f "$RELEASE/assets/config.toml" ] ||
    fail "$RELEASE has no gpuguard and assets/config.toml (packaging/build-release.sh makes them)"

# 2. The base: Debian minbase and the CA certificates (HTTPS webhooks trust the system's store).
SUITE=${GPUGUARD_SUITE:-bookworm}
if [ -z "${GPUGUARD_DEBIAN_MIRROR:-}" ]; then
    GPUGUARD_DEBIAN_MIRROR=$(
        cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
            2>/dev/null |
            sed -nE 's#^(deb[[:space:]]+(\[[^]]*\][[:space:]]+)?|URIs:[[:space:]]*)([a-z]+://[^[:space:]]+/debian)/?([[:space:]].*)?$#\3#p' |
            head -n 1
    ) || true
fi
MIRROR=${GPUGUARD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
INCLUDE=ca-certificates
KEY=$(printf '%s\n' "$SUITE" minbase "$INCLUDE" "$MIRROR" image | sha256sum | cut -c1-12)
CACHE=${GPUGUARD_IMAGE_CACHE:-/var/tmp/gpuguard-image-cache}
BASE_TAR=$CACHE/$SUITE-$KEY.tar
BASE_IMAGE=localhost/gpuguard-base:$SUITE-$KEY
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ ! -f "$BASE_TAR" ]; then
    echo "build-image: debootstrap $SUITE from $MIRROR" >&2
    mkdir -p "$CACHE"
    debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$WORK/rootfs" "$MIRROR" \
        >"$WORK/debootstrap.log" 2>&1 || {
        tail -n 30 "$WORK/debootstrap.log" >&2
        fail "debootstrap failed"
    }
    # What only apt and people read: the package lists and caches, docs, man pages, locales.
    rm -rf "$WORK"/rootfs/var/lib/apt/lists/* "$WORK"/rootfs/var/cache/apt/* \
        "$WORK"/rootfs/usr/share/doc/* "$WORK"/rootfs/usr/share/man/* \
        "$WORK"/rootfs/usr/share/info/* "$WORK"/rootfs/usr/share/locale/* \
        "$WORK"/rootfs/var/log/*
    tar --numeric-owner -C "$WORK/rootfs" -cf "$BASE_TAR.tmp" .
    mv "$BASE_TAR.tmp" "$BASE_TAR"
    rm -rf "$WORK/rootfs"
fi
if ! podman image exists "$BASE_IMAGE"; then
    podman import --quiet "$BASE_TAR" "$BASE_IMAGE" >/dev/null
fi

# 3. The image.
mkdir -p "$WORK/context"
cp "$RELEASE/gpuguard" "$RELEASE/assets/config.toml" "$WORK/context/"
podman build --quiet --pull=never -f packaging/Containerfile --build-arg BASE="$BASE_IMAGE" \
    --build-arg VERSION="$VERSION" -t "$IMAGE" "$WORK/context" >/dev/null
if [ -n "$OUT" ]; then
    mkdir -p "$OUT"
    rm -f "$OUT/gpuguard-image-$VERSION-amd64.tar"
    podman save --quiet --format docker-archive -o "$OUT/gpuguard-image-$VERSION-amd64.tar" "$IMAGE"
    echo "build-image: $OUT/gpuguard-image-$VERSION-amd64.tar" >&2
fi
echo "$IMAGE"
