#!/usr/bin/env bash
# throttle.sh: how much `action = "throttle"` slows a growing process that shares its cgroup
# (the SIGSTOP/SIGCONT duty cycle, 20 ms run in every 100 ms), for each binary given (default:
# the release build). For each rate in RATES_MIB (default "200 800" MiB/s), ROUNDS (default 3)
# rounds, each: the hog (bench/hog.c, comm gg_bench_hog, up to 2 GiB) alone, its RSS growth over
# 1 s after 0.3 s; then the same hog with gpuguard guarding a model that matches only it
# (`ram = "32MiB"`, throttle, grace 0), its growth over 1.5 s from the throttle. Prints both
# rates and throttled/free. The hog paces itself by the clock (it catches up after each stop,
# as a server catches up on requests that arrived while it was stopped), so the slower it is
# asked to grow, the more of its lost time it makes up. This was the host test
# `throttle_measurably_slows_a_growing_hog` (a rate compared over wall-clock windows belongs
# here, not in a test).
#
#   bench/throttle.sh [BINARY...]        (root: the hog is signalled by the daemon)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_DIR"
mkdir -p "$BUILD_DIR"
gcc -O2 -Wall -o "$HOG" "$BENCH_DIR/hog.c"
[ $# -gt 0 ] || { cargo build --release --quiet; set -- "$GPUGUARD"; }
rounds=${ROUNDS:-3}
rates=${RATES_MIB:-200 800}
(($(mem_available_bytes) > 6 * GIB)) || { echo "needs 6 GiB available" >&2; exit 1; }
work=$(mktemp -d)
daemon= hog=
trap 'kill_pids $daemon $hog; rm -rf "$work"' EXIT

rss_bytes() { awk '/^VmRSS:/ {print $2 * 1024}' "/proc/$1/status"; }
# growth PID AFTER OVER: RSS growth of PID in MiB/s over OVER seconds after waiting AFTER.
growth() {
    sleep "$2"
    local start end
    start=$(rss_bytes "$1")
    sleep "$3"
    end=$(rss_bytes "$1")
    echo "scale=1; ($end - $start) / $MIB / $3" | bc
}

echo "| binary | hog's rate | round | free MiB/s | throttled MiB/s | throttled / free |"
echo "|---|---|---|---|---|---|"
for bin in "$@"; do
  for rate_mib in $rates; do
    rate=$((rate_mib * MIB))
    for ((r = 1; r <= rounds; r++)); do
        "$HOG" --rate "$rate" --cap $((2 * GIB)) --hold 60 &
        hog=$!
        free=$(growth "$hog" 0.3 1)
        kill_pids "$hog"
        hog=
        cat >"$work/config.toml" <<TOML
[daemon]
state_dir = "$work/state-$r"
candidates = "models"
interval = "500ms"
scan_interval = "200ms"
[ram]
min_available = "0%"
warn_available = "0%"
[launch]
socket = "$work/sock-$r"
[[model]]
name = "hog"
match = { comm = "gg_bench_hog" }
ram = "32MiB"
action = "throttle"
grace = "0s"
TOML
        "$bin" daemon --config "$work/config.toml" 2>"$work/log" &
        daemon=$!
        wait_for_line "$work/log" 'gpuguard .* started' 10
        "$HOG" --rate "$rate" --cap $((2 * GIB)) --hold 60 &
        hog=$!
        wait_for_line "$work/log" 'verb="throttle"' 10 ||
            { echo "no throttle seen:" >&2; cat "$work/log" >&2; exit 1; }
        throttled=$(growth "$hog" 0 1.5)
        kill_pids "$hog" "$daemon"
        hog= daemon=
        echo "| $bin | $rate_mib MiB/s | $r | $free | $throttled | $(echo "scale=2; $throttled / $free" | bc) |"
    done
  done
done
