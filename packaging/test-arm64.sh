#!/usr/bin/env bash
# The arm64 package test, on an amd64 host: builds the arm64 .deb (packaging/build-deb.sh,
# cross-built with cargo zigbuild against glibc 2.28), lints it, and runs it under emulation
# (qemu-aarch64-static with Debian's arm64 glibc): `--version`, `check-config` on the packaged
# config, `plan` on a public architecture, and a short `daemon` in observe mode that must sample
# this host's memory and stop cleanly on SIGTERM; the aarch64 .rpm of the same binary, linted.
# Then the unit tests that read no live system
# (the policy, the /proc and NVML parsers, plan, the history's records and replay), built for
# aarch64 and run under the same emulation.
#
#   packaging/test-arm64.sh [WORKDIR]
#
# Run by .ci/run, as root, on Debian 12. Needs what build-deb.sh needs for arm64 (cargo-deb,
# cargo-zigbuild, the aarch64-unknown-linux-gnu Rust target, qemu-user-static,
# libc6-arm64-cross) and lintian.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
TARGET=${CARGO_TARGET_DIR:-$REPO/target}
fail() {
    echo "FAIL: $*" >&2
    exit 1
}
say() { echo "== $*"; }
for tool in cargo-deb cargo-zigbuild qemu-aarch64-static lintian dpkg-deb; do
    command -v "$tool" >/dev/null || fail "$tool not found (.ci/run installs it)"
done
[ -e /usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1 ] || fail "no arm64 glibc (apt-get install libc6-arm64-cross)"
WORK=${1:-$(mktemp -d /var/tmp/gpuguard-arm64-test.XXXXXX)}
mkdir -p "$WORK"
arm() { qemu-aarch64-static -L /usr/aarch64-linux-gnu "$@"; }

say "build the arm64 .deb"
DEB=$(GPUGUARD_ARCH=arm64 packaging/build-deb.sh "$WORK/deb" | tail -n 1)
[ -f "$DEB" ] || fail "no .deb: $DEB"
[ "$(dpkg-deb --field "$DEB" Architecture)" = arm64 ] || fail "Architecture: $(dpkg-deb --field "$DEB" Architecture)"
echo "   $DEB"

say "lintian"
lintian --allow-root --fail-on error,warning --display-info --pedantic "$DEB" >"$WORK/lintian.log" 2>&1 ||
    {
        cat "$WORK/lintian.log"
        fail "lintian reported errors or warnings"
    }
sed 's/^/   /' "$WORK/lintian.log"

say "the aarch64 .rpm from the same binary (packaging/build-rpm.sh)"
if command -v cargo-generate-rpm >/dev/null && command -v rpmlint >/dev/null; then
    RPM=$(GPUGUARD_ARCH=arm64 packaging/build-rpm.sh "$WORK/rpm" | tail -n 1)
    [ "$(rpm -qp --qf '%{ARCH}' "$RPM")" = aarch64 ] || fail "rpm arch: $(rpm -qp --qf '%{ARCH}' "$RPM")"
    rpmlint -c packaging/rpmlint.toml "$RPM" >"$WORK/rpmlint.log" 2>&1 || true
    grep -qE '^ *[0-9]+ packages and [0-9]+ specfiles checked; 0 errors' "$WORK/rpmlint.log" ||
        fail "rpmlint on the aarch64 .rpm: $(cat "$WORK/rpmlint.log")"
    echo "   $RPM: aarch64, rpmlint clean"
else
    echo "   skipped: cargo-generate-rpm or rpmlint not installed (.ci/run installs both)"
fi

say "the packaged binary under emulation"
mkdir -p "$WORK/root"
dpkg-deb --extract "$DEB" "$WORK/root"
BIN=$WORK/root/usr/bin/gpuguard
file -b "$BIN" | grep -q 'ARM aarch64' || fail "not an aarch64 binary: $(file -b "$BIN")"
arm "$BIN" --version | grep -qx "gpuguard $(dpkg-deb --field "$DEB" Version)" || fail "--version: $(arm "$BIN" --version)"
arm "$BIN" check-config --portable "$WORK/root/etc/gpuguard/config.toml" || fail "check-config on the packaged config"
PLAN=$(arm "$BIN" plan tests/fixtures/plan/llama-3-8b.json --gpu L4 --json) ||
    fail "plan under emulation"
grep -q '"kv_bytes_per_token": 131072' <<<"$PLAN" || fail "plan --json: $PLAN"
cat >"$WORK/observe.toml" <<EOF
[daemon]
mode = "observe"
state_dir = "$WORK/state"
candidates = "models"
[gpu]
enabled = false
[launch]
socket = "$WORK/gpuguard.sock"
[[model]]
name = "nothing"
match = { comm = "gg_arm64_none" }
EOF
# qemu itself in the background (not the `arm` function: its subshell would get the SIGTERM).
qemu-aarch64-static -L /usr/aarch64-linux-gnu "$BIN" daemon --config "$WORK/observe.toml" \
    2>"$WORK/daemon.log" &
DAEMON=$!
trap 'kill -TERM "$DAEMON" 2>/dev/null || true' EXIT
for _ in $(seq 150); do
    grep -q "started: mode observe" "$WORK/daemon.log" && break
    sleep 0.2
done
grep -q "started: mode observe" "$WORK/daemon.log" || {
    cat "$WORK/daemon.log"
    fail "the arm64 daemon did not start"
}
STATUS=$(arm "$BIN" status --json --socket "$WORK/gpuguard.sock") || fail "status from the arm64 daemon"
grep -qE '"available_bytes": ?[1-9]' <<<"$STATUS" || fail "status shows no host memory: $STATUS"
kill -TERM "$DAEMON"
wait "$DAEMON" || fail "the arm64 daemon exited with $? on SIGTERM: $(cat "$WORK/daemon.log")"
trap - EXIT
echo "   --version, check-config, plan, daemon (observe), status: ok"

say "unit tests for aarch64 under emulation"
cargo zigbuild --locked --workspace --lib --tests --target aarch64-unknown-linux-gnu.2.28 \
    --message-format=json 2>"$WORK/test-build.log" >"$WORK/test-build.json" ||
    {
        tail -n 30 "$WORK/test-build.log"
        fail "building the aarch64 unit tests"
    }
# Each crate's unit tests: the core's (config, snapshot, policy, units), the ledger's, the
# planner's, all of them; the agent's parsers (history, /proc, Prometheus text, GCE notices).
python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["lib"] and m["profile"]["test"] and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' "$WORK/test-build.json" >"$WORK/libtests"
for crate in gpuguard_core gpuguard_ledger gpuguard_plan gpuguard; do
    LIBTEST=$(awk -v c="$crate" '$1 == c { print $2 }' "$WORK/libtests" | head -n 1)
    [ -n "$LIBTEST" ] || fail "no aarch64 unit test binary of $crate in $WORK/test-build.json"
    filters=()
    [ "$crate" = gpuguard ] && filters=(history::segment history::input history::replay
        sample::procfs:: sample::prometheus:: sample::gce::tests::upcoming)
    arm "$LIBTEST" --test-threads 2 "${filters[@]}" >"$WORK/unit-$crate.log" 2>&1 || true
    grep -qE '^test result: ok\. [1-9][0-9]* passed' "$WORK/unit-$crate.log" || {
        tail -n 30 "$WORK/unit-$crate.log"
        fail "aarch64 unit tests of $crate"
    }
    echo "   $crate: $(grep -E '^test result:' "$WORK/unit-$crate.log")"
done
rm -rf "$WORK"
