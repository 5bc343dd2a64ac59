#!/usr/bin/env bash
# Builds the gpuguard .deb with cargo-deb, for amd64 or arm64, linked against glibc 2.28.
#
#   packaging/build-deb.sh OUTDIR [DEB_VERSION]
#   GPUGUARD_ARCH=arm64 packaging/build-deb.sh OUTDIR        (the arm64 .deb, cross-built here)
#   packaging/build-debs.sh OUTDIR                            (both, one command)
#
# The binary and its assets from packaging/build-release.sh (what it needs is said there); then
# `cargo deb --no-build --target` packages them with the unit from systemd/
# ([package.metadata.deb] in Cargo.toml). DEB_VERSION overrides the package version (the tests
# build a second, newer package to test upgrades). Prints the path of the .deb on its last line.
# Needs cargo-deb (cargo install --locked cargo-deb).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: packaging/build-deb.sh OUTDIR [DEB_VERSION]}
VERSION=${2:-}
command -v cargo-deb >/dev/null || {
    echo "build-deb: cargo-deb not found: cargo install --locked cargo-deb" >&2
    exit 1
}
DATE=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
RELEASE=$(packaging/build-release.sh | tail -n 1)
TRIPLE=$(basename "$(dirname "$RELEASE")")
mkdir -p "$OUT"
# --target: cargo-deb takes target/release/... of the assets from target/TRIPLE/release/ and
# sets the package's Architecture. Stripped already (build-release.sh).
SOURCE_DATE_EPOCH=$DATE cargo deb --no-build --no-strip --locked --target "$TRIPLE" \
    --output "$OUT" ${VERSION:+--deb-version "$VERSION"} | tail -n 1
