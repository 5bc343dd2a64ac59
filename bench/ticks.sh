#!/usr/bin/env bash
# ticks.sh: gpuguard's own cost per tick (sample + decide + act + log), from its debug line
#   DEBUG tick took_us=N scan=true|false gpu_sample_us=N next_ms=N
# with 1000 idle `sleep` processes on the host (started and killed here), in three cases:
#   idle       far from every floor (interval 100ms, scan_interval 1s, so that 30 s give ~300
#              ticks and ~30 full scans; the per-tick work is the same as with the 1s/5s defaults)
#   near floor MemAvailable held between warn and min by a hog (min = start - 1.5 GiB, warn =
#              start - 0.5 GiB, hog holds 1 GiB): fast ticks and a full scan every 100 ms. Holds
#              the memory-pressure flock.
#   8 GPUs     idle, plus fake NVML with 8 GPUs x 16 processes (tests/fake_nvml)
#   fork storm idle, with a fork storm on top of the 1000 sleeps: up to 400 short-lived processes
#              at once, each living ~200 ms (bench/storm.c)
# The scan runs on a thread of its own: a tick only merges the table it sent (`scan=true` below
# means a new table was merged in that tick); the scan rounds' own durations are listed too.
#
#   bench/ticks.sh [RESULTS_DIR]      (env: TICK_SECONDS=30)
# Output: RESULTS_DIR/ticks.md (percentiles and histograms, also on stdout).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
out=${1:-$BENCH_DIR/results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
secs=${TICK_SECONDS:-30}
[[ -x $GPUGUARD ]] || { echo "build gpuguard first: cargo build --release" >&2; exit 1; }
[[ -x $HOG && -x $STORM && -f $BUILD_DIR/libnvidia-ml.so.1 ]] || build_tools

work=$(mktemp -d /tmp/gg-bench-ticks.XXXXXX)
sleeps=() gg= hog= storm=
cleanup() { kill_pids "$gg" "$hog" "$storm" "${sleeps[@]}"; rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

config() { # $1 file, $2 min, $3 warn, $4 [gpu] section
    cat >"$1" <<TOML
[daemon]
interval = "100ms"
scan_interval = "1s"
state_dir = "$work/state-$RANDOM"
candidates = "models"
[ram]
min_available = $2
warn_available = $3
$4
[launch]
socket = "$work/sock-$RANDOM"
[[model]]
name = "bench-hog"
match = { comm = "gg_bench_hog", cmdline = '^\S*/gg_bench_hog( |$)' }
TOML
}
run_gg() { # $1 config, $2 log, [env...]
    env GPUGUARD_LOG=debug "${@:3}" "$GPUGUARD" daemon --config "$1" 2>"$2" &
    gg=$!
    sleep "$secs"
    kill_pids "$gg"
    gg=
}

echo "starting 1000 sleep processes" >&2
for ((i = 0; i < 1000; i++)); do sleep 100000 & sleeps+=($!); done
: >"$out/ticks.md"

config "$work/idle.toml" '"5%"' '"10%"' $'[gpu]\nenabled = false'
run_gg "$work/idle.toml" "$work/idle.log"
python3 "$BENCH_DIR/analyze.py" ticks --label "idle, 1000 procs" "$work/idle.log" | tee -a "$out/ticks.md"

near_floor() {
    local start min warn
    start=$(mem_available_bytes)
    min=$((start - 3 * GIB / 2)) warn=$((start - GIB / 2))
    "$HOG" --cap "$GIB" --hold $((secs + 5)) &
    hog=$!
    sleep 1
    config "$work/near.toml" "$min" "$warn" $'[gpu]\nenabled = false'
    run_gg "$work/near.toml" "$work/near.log"
    kill_pids "$hog"
    hog=
}
# The flock covers the whole near-floor case (the hog's life).
exec 9>"$LOCK"
flock 9
near_floor
flock -u 9
exec 9>&-
python3 "$BENCH_DIR/analyze.py" ticks --label "near floor, 1000 procs" "$work/near.log" | tee -a "$out/ticks.md"
grep -c "floor_warn" "$work/near.log" >/dev/null || echo "WARNING: near-floor run never reached warn" >&2

fake_gpu_state "$work/nvml.state" "${sleeps[@]:0:128}"
config "$work/gpu.toml" '"5%"' '"10%"' "$FAKE_GPU_TOML"
run_gg "$work/gpu.toml" "$work/gpu.log" FAKE_NVML_STATE="$work/nvml.state"
python3 "$BENCH_DIR/analyze.py" ticks --label "8 fake GPUs x 16 procs, 1000 procs" "$work/gpu.log" | tee -a "$out/ticks.md"
grep -o "gpu_sample_us=[0-9]*" "$work/gpu.log" | sort -t= -k2 -n | awk -F= '{v[NR]=$2} END {if (NR) printf "gpu_sample_us: n=%d p50=%d p99=%d max=%d\n\n", NR, v[int(NR*0.5)+1], v[int(NR*0.99)+1], v[NR]}' | tee -a "$out/ticks.md"
echo "starting a fork storm" >&2
"$STORM" --live 400 --life-ms 200 >"$work/storm.count" &
storm=$!
sleep 1
run_gg "$work/idle.toml" "$work/storm.log"
kill -TERM "$storm"
wait "$storm" || true
storm=
python3 "$BENCH_DIR/analyze.py" ticks --label "fork storm, 1000 procs" "$work/storm.log" | tee -a "$out/ticks.md"
echo "fork storm: $(cat "$work/storm.count") processes started in about $((secs + 1)) s" | tee -a "$out/ticks.md"
cp "$work"/*.log "$out/" 2>/dev/null || true
