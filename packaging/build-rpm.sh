#!/usr/bin/env bash
# Builds the gpuguard .rpm (Rocky Linux / RHEL 8 and 9) with cargo-generate-rpm, from the same
# glibc 2.28 binary, assets and unit as the .deb (packaging/build-release.sh), for x86_64 or
# aarch64 (GPUGUARD_ARCH=amd64|arm64).
#
#   packaging/build-rpm.sh OUTDIR
#
# The config is %config(noreplace); the service is enabled by preset on install and restarted on
# upgrade (packaging/rpm-scripts, as RHEL's systemd macros do). Prints the path of the .rpm on
# its last line. Needs cargo-generate-rpm (cargo install --locked cargo-generate-rpm).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: packaging/build-rpm.sh OUTDIR}
command -v cargo-generate-rpm >/dev/null || {
    echo "build-rpm: cargo-generate-rpm not found: cargo install --locked cargo-generate-rpm" >&2
    exit 1
}
DATE=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
RELEASE=$(packaging/build-release.sh | tail -n 1)
TRIPLE=$(basename "$(dirname "$RELEASE")")
mkdir -p "$OUT"
# --target: the assets' target/release/ is read from target/TRIPLE/release/, and the package's
# architecture follows it. xz: RHEL 8's rpm reads it (zstd payloads came later there). The
# requirements are stated in Cargo.toml (glibc 2.28), not worked out with this host's ldd.
SOURCE_DATE_EPOCH=$DATE cargo generate-rpm --target "$TRIPLE" --output "$OUT" \
    --payload-compress xz --auto-req disabled \
    --source-date "$DATE" >&2
ls -t "$OUT"/gpuguard-*.rpm | head -n 1
