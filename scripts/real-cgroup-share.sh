#!/usr/bin/env bash
# Issue 24's cgroup share on a real cgroup v2 kernel: forked workers of another account (uid
# 65534) share 512 MiB copy-on-write; a daemon with only the packaged unit's capabilities
# (CAP_KILL, CAP_NET_ADMIN) cannot read their smaps_rollup, so it counts them by their share of
# their memory cgroup's anonymous memory. Prints, per case, what the daemon counted for the model
# beside the PSS and RSS this script reads as full root, and fails when the daemon's figure is not
# within 25 % of the PSS sum.
#
#   scripts/real-cgroup-share.sh PATH/TO/gpuguard [OUTDIR]
#
# Cases: the workers in a cgroup of their own (as a service or a container has), daemon under the
# unit's capabilities; the same daemon as full root (it reads PSS itself). Needs root, cgroup v2
# with the memory controller, python3 and setpriv. Touches only the processes it starts; creates
# and removes one cgroup under /sys/fs/cgroup. Exits 2 where the host has no cgroup v2 memory.
set -uo pipefail
BIN=$(realpath "${1:?usage: real-cgroup-share.sh PATH/TO/gpuguard [OUTDIR]}")
source "$(dirname "$0")/../bench/lib.sh"
OUT=${2:-$(mktemp -d)}
mkdir -p "$OUT"
ROOT=/sys/fs/cgroup
grep -qw memory "$ROOT/cgroup.controllers" 2>/dev/null || {
    echo "SKIP: $ROOT is not cgroup v2 with the memory controller"
    exit 2
}
WORK=$(mktemp -d)
TOKEN="gpuguard-share-$$"
CG="$ROOT/gpuguard-share-$$"
LEADER= DAEMON=
cleanup() {
    for p in $DAEMON; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    if [ -n "$LEADER" ]; then kill -KILL -- "-$LEADER" 2>/dev/null; wait "$LEADER" 2>/dev/null; fi
    [ -d "$CG" ] && rmdir "$CG" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
say() { echo "== $*"; }

grep -qw memory "$ROOT/cgroup.subtree_control" || echo +memory >"$ROOT/cgroup.subtree_control" || exit 1
mkdir "$CG" || exit 1

# The workers: 512 MiB touched, then three forks that share it; the leader in a process group
# of its own (killed with it), moved into the cgroup before it runs, then uid 65534.
FORKED_PY='
import os, sys, time
data = b"\x01" * (512 << 20)
for _ in range(3):
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
print("forked", flush=True)
time.sleep(600)
'
# (The system's python3: a virtual environment's may not be readable by that account.)
PY=$(command -v /usr/bin/python3 python3 | head -1)
setsid sh -c 'cd / && echo $$ > "$1/cgroup.procs" && exec setpriv --reuid=65534 --regid=65534 --clear-groups "$4" -c "$2" "$3"' \
    sh "$CG" "$FORKED_PY" "$TOKEN" "$PY" >"$WORK/forked.out" 2>&1 &
LEADER=$!
wait_for_line "$WORK/forked.out" forked 10 || { cat "$WORK/forked.out"; exit 1; }
PIDS=$(cat "$CG/cgroup.procs" | tr '\n' ' ')
say "workers (uid 65534) in $CG: $PIDS"
grep -E '^(anon|file|shmem) ' "$CG/memory.stat"

kb() { awk -v k="$2:" '$1 == k {print $2}' "$1"; }
PSS=0 RSS=0
for p in $PIDS; do
    PSS=$((PSS + $(kb /proc/$p/smaps_rollup Pss) * 1024))
    RSS=$((RSS + $(kb /proc/$p/status VmRSS) * 1024))
done
say "as full root: PSS sum $((PSS / MIB)) MiB, RSS sum $((RSS / MIB)) MiB"

cat >"$WORK/config.toml" <<TOML
[daemon]
state_dir = "$WORK/state"
candidates = "models"
mode = "observe"
interval = "200ms"
scan_interval = "200ms"
[ram]
min_available = "0%"
warn_available = "0%"
[launch]
socket = "$WORK/sock"
[[model]]
name = "forked"
match = { cmdline = "$TOKEN" }
users = ["65534"]
ram = "1GiB"
action = "alert"
TOML

fail=0
run_case() { # NAME WRAPPER...: the daemon under WRAPPER; its figure for the model against PSS
    local name=$1
    shift
    rm -rf "$WORK/state" "$WORK/sock"
    "$@" "$BIN" daemon --config "$WORK/config.toml" 2>"$OUT/daemon-$name.log" &
    DAEMON=$!
    wait_for_socket "$WORK/sock" 10
    grep CapEff "/proc/$DAEMON/status" || true
    # The RSS sum is over the 1 GiB budget: the daemon wants a proportional figure; a few rounds.
    local ram=0
    for _ in $(seq 50); do
        sleep 0.2
        ram=$("$BIN" status --json --socket "$WORK/sock" |
            python3 -c 'import json,sys; r=json.load(sys.stdin); print(next(m["ram_bytes"] for m in r["models"] if m["name"]=="forked"))')
        [ "$ram" -gt 0 ] && [ $((ram * 4)) -lt $((RSS * 3)) ] && break
    done
    "$BIN" status --model forked --socket "$WORK/sock" >"$OUT/status-$name.txt" 2>&1 || true
    kill "$DAEMON"
    wait "$DAEMON" || true
    DAEMON=
    local verdict=PASS
    if [ $((ram * 4)) -lt $((PSS * 3)) ] || [ $((ram * 4)) -gt $((PSS * 5)) ]; then
        verdict=FAIL
        fail=1
    fi
    cat "$OUT/status-$name.txt"
    say "$name: the daemon counted $((ram / MIB)) MiB for the workers (PSS $((PSS / MIB)), RSS $((RSS / MIB))): $verdict"
    echo "   log lines naming smaps_rollup: $(grep -c smaps_rollup "$OUT/daemon-$name.log")"
}
run_case unit-caps setpriv --bounding-set=-all,+kill,+net_admin --inh-caps=-all --
run_case full-root env
exit $fail
