#!/usr/bin/env bash
# Both .debs (amd64 and arm64, glibc 2.28) into OUTDIR: packaging/build-debs.sh OUTDIR.
# Prints their paths, one per line. See packaging/build-deb.sh for what each needs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: packaging/build-debs.sh OUTDIR}
for arch in amd64 arm64; do
    GPUGUARD_ARCH=$arch packaging/build-deb.sh "$OUT" | tail -n 1
done
