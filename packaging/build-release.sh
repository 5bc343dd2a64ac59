#!/usr/bin/env bash
# The release binary and its assets for the packages (build-deb.sh, build-rpm.sh): for amd64 or
# arm64, linked against glibc 2.28, stripped; the man pages, completions and packaged config
# beside it. Prints the release directory (target/TRIPLE/release) on its last line.
#
#   packaging/build-release.sh            (GPUGUARD_ARCH=amd64|arm64, GPUGUARD_GLIBC=2.28|native)
#
# 1. The release binary for the Debian architecture GPUGUARD_ARCH (amd64 by default: x86_64;
#    arm64: aarch64), built with `cargo zigbuild` against glibc 2.28 (GPUGUARD_GLIBC; "native":
#    plain `cargo build` against this host's glibc, amd64 only). 2.28 is Debian 10/11, Ubuntu
#    20.04 and Rocky/RHEL 8; NVML is still dlopen'ed from the driver (libnvidia-ml.so.1), so the
#    binary is not static. 2. The man pages, completions and the packaged config, written from
#    the CLI definition and config.example.toml by examples/generate-assets.rs, built for and
#    run on this host (they are the same for every architecture; clap_mangen and clap_complete
#    are its dev-dependencies, never in the shipped binary). 3. The binary is stripped with its
#    architecture's strip (binutils-aarch64-linux-gnu for arm64).
# Needs cargo-zigbuild with zig (PyPI:
# cargo-zigbuild, ziglang; .ci/run installs them in target/zig-venv and puts it on PATH), and
# the Rust target (rustup target add aarch64-unknown-linux-gnu for arm64).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
ARCH=${GPUGUARD_ARCH:-amd64}
GLIBC=${GPUGUARD_GLIBC:-2.28}
case $ARCH in
amd64) TRIPLE=x86_64-unknown-linux-gnu STRIP=strip ;;
arm64) TRIPLE=aarch64-unknown-linux-gnu STRIP=aarch64-linux-gnu-strip ;;
*)
    echo "build-release: GPUGUARD_ARCH must be amd64 or arm64, not '$ARCH'" >&2
    exit 2
    ;;
esac
RELEASE=$TARGET/$TRIPLE/release

# Reproducible dates in the man pages and the archive. (Not given to cargo build: some crates
# rebuild whenever it changes.)
DATE=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}

if [ "$GLIBC" = native ]; then
    [ "$ARCH" = amd64 ] || {
        echo "build-release: GPUGUARD_GLIBC=native builds amd64 only" >&2
        exit 2
    }
    cargo build --release --locked --target "$TRIPLE" >&2
else
    command -v cargo-zigbuild >/dev/null || {
        echo "build-release: cargo-zigbuild not found: pip install cargo-zigbuild ziglang (in a venv on PATH)" >&2
        exit 1
    }
    cargo zigbuild --release --locked --target "$TRIPLE.$GLIBC" >&2
fi

# The newest glibc symbol the binary needs: nothing above GLIBC.
if [ "$GLIBC" != native ]; then
    NEWEST=$(objdump -T "$RELEASE/gpuguard" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n 1)
    [ "$(printf '%s\n' "GLIBC_$GLIBC" "$NEWEST" | sort -V | tail -n 1)" = "GLIBC_$GLIBC" ] || {
        echo "build-release: $RELEASE/gpuguard needs $NEWEST, newer than glibc $GLIBC" >&2
        exit 1
    }
    echo "build-release: $RELEASE/gpuguard needs glibc $NEWEST at most" >&2
fi

# The assets, by the generator built for this host (dev profile: no release build of the library
# for the host as well).
cargo build --locked --example generate-assets >&2
rm -rf "$RELEASE/assets"
SOURCE_DATE_EPOCH=$DATE "$TARGET/debug/examples/generate-assets" "$RELEASE/assets" >&2
# cargo-deb compresses man pages only when they are not under target/release; Debian wants them
# gzipped (-n: no name or timestamp inside, for reproducible packages).
gzip -9n "$RELEASE"/assets/man/*.1
# Stripped with the strip of the binary's architecture (cargo-deb would run this host's), as
# Debian's dh_strip does.
"$STRIP" --strip-unneeded --remove-section=.comment --remove-section=.note "$RELEASE/gpuguard"
echo "$RELEASE"
