#!/usr/bin/env bash
# Builds the gpuguard .deb with cargo-deb.
#
#   packaging/build-deb.sh OUTDIR [DEB_VERSION]
#
# 1. cargo build --release; 2. the release binary writes the man pages, shell completions and the
# packaged config from its own CLI definition and config.example.toml (`gpuguard
# generate-assets`); 3. cargo deb --no-build packages them with the unit from systemd/ (see
# [package.metadata.deb] in Cargo.toml). DEB_VERSION overrides the package version (the tests
# build a second, newer package to test upgrades). Prints the path of the .deb on its last line.
# Needs cargo-deb (cargo install --locked cargo-deb).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: packaging/build-deb.sh OUTDIR [DEB_VERSION]}
VERSION=${2:-}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}

command -v cargo-deb >/dev/null || {
    echo "build-deb: cargo-deb not found: cargo install --locked cargo-deb" >&2
    exit 1
}
# Reproducible dates in the man pages and the archive. (Not given to cargo build: some crates
# rebuild whenever it changes.)
DATE=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}

cargo build --release --locked >&2
rm -rf "$TARGET/release/assets"
SOURCE_DATE_EPOCH=$DATE "$TARGET/release/gpuguard" generate-assets "$TARGET/release/assets" >&2
# cargo-deb compresses man pages only when they are not under target/release; Debian wants them
# gzipped (-n: no name or timestamp inside, for reproducible packages).
gzip -9n "$TARGET"/release/assets/man/*.1
mkdir -p "$OUT"
SOURCE_DATE_EPOCH=$DATE cargo deb --no-build --locked --output "$OUT" \
    ${VERSION:+--deb-version "$VERSION"} | tail -n 1
