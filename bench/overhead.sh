#!/usr/bin/env bash
# overhead.sh: what each agent costs while nothing happens (and while memory sits near a floor).
#
#   bench/overhead.sh [RESULTS_DIR]      (env: SECONDS_PER_CASE=60, BASELINE=path/to/gpuguard)
#
# BASELINE: another gpuguard binary (say, main before a change) run beside this one in every
# case, in the same window, so the two are compared under the same noise.
#
# Cases, each over SECONDS_PER_CASE after a 3 s warm-up, agents side by side in the same window:
#   idle          gpuguard and earlyoom, no memory pressure
#   1000 procs    the same with 1000 idle `sleep` processes on the host (started and killed here)
#   near floor    the same, 1000 procs, and MemAvailable held between the warn and act floors: a
#                 hog holds 1 GiB, floors: act = start - 1.5 GiB, warn = start - 0.5 GiB (earlyoom
#                 -M at the act floor). Holds the memory-pressure flock.
#   8 GPUs        gpuguard alone, fake NVML (tests/fake_nvml) with 8 GPUs x 16 processes (pids of
#                 128 of the sleeps), and the 1000 sleeps still there
#   lock-memory   the 8 GPU case with `--lock-memory` (mlockall), as the systemd unit runs it
# Per agent: CPU = utime+stime from /proc/PID/stat (clock ticks) over the window, as % of one core;
# peak RSS = VmHWM at the end. Both agents use their stock intervals; floors 5 % (earlyoom -m 5,
# gpuguard min_available 5 %, warn 10 %, its defaults) except near the floor; earlyoom runs
# --dryrun and gpuguard with candidates = "models" (a model no process matches, and the hog), so
# neither can touch anything but the hog. Output: RESULTS_DIR/overhead.md (also on stdout).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
out=${1:-$BENCH_DIR/results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
window=${SECONDS_PER_CASE:-60}
[[ -x $GPUGUARD ]] || { echo "build gpuguard first: cargo build --release" >&2; exit 1; }
[[ -f $BUILD_DIR/libnvidia-ml.so.1 && -x $HOG ]] || build_tools
hz=$(getconf CLK_TCK)

work=$(mktemp -d /tmp/gg-bench-overhead.XXXXXX)
sleeps=() agents=() hog=
cleanup() { kill_pids "${agents[@]}" "$hog" "${sleeps[@]}"; rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# measure LABEL: samples every agent in ${agents[@]} (names in ${names[@]}) over the window.
measure() {
    local label=$1 i t0=() t1=()
    sleep 3
    for i in "${!agents[@]}"; do t0[i]=$(cpu_ticks "${agents[i]}"); done
    sleep "$window"
    for i in "${!agents[@]}"; do
        t1[i]=$(cpu_ticks "${agents[i]}")
        local ticks=$((t1[i] - t0[i])) hwm
        hwm=$(vm_hwm_kib "${agents[i]}")
        printf '| %s | %s | %d | %d | %.3f %% | %.1f MiB |\n' "$label" "${names[i]}" "$window" "$ticks" \
            "$(echo "$ticks * 100 / $hz / $window" | bc -l)" "$(echo "$hwm / 1024" | bc -l)" | tee -a "$out/overhead.md"
    done
    kill_pids "${agents[@]}"
    agents=()
}

# start_gpuguard NAME CONFIG [ARGS...]: this gpuguard, and the baseline beside it (own config copy).
start_gpuguard() {
    local name=$1 config=$2
    shift 2
    "$GPUGUARD" daemon --config "$config" "$@" 2>"$work/$name.log" &
    agents+=($!)
    names+=(gpuguard)
    if [[ -n ${BASELINE:-} ]]; then
        sed "s|state-|base-state-|; s|sock-|base-sock-|" "$config" >"$config.base"
        "$BASELINE" daemon --config "$config.base" "$@" 2>"$work/$name-baseline.log" &
        agents+=($!)
        names+=(gpuguard-baseline)
    fi
}

start_pair() { # [$1 min bytes, $2 warn bytes]: floors near the memory in use; default 5 %/10 %
    gpuguard_config "$work/gg.toml" $'[gpu]\nenabled = false' "${1:-}" "${2:-}"
    agents=() names=()
    start_gpuguard gg "$work/gg.toml"
    if [[ -n ${1:-} ]]; then
        "$EARLYOOM" -M "$(($1 / 1024))" -s 100 -r 0 --dryrun >"$work/eo.log" 2>&1 &
    else
        "$EARLYOOM" -m 5 -s 100 -r 0 --dryrun >"$work/eo.log" 2>&1 &
    fi
    agents+=($!)
    names+=(earlyoom)
}

{
    echo "| case | agent | window s | CPU ticks (1/$hz s) | CPU, % of one core | peak RSS (VmHWM) |"
    echo "|---|---|---|---|---|---|"
} | tee "$out/overhead.md"

start_pair
measure "idle"

echo "starting 1000 sleep processes" >&2
for ((i = 0; i < 1000; i++)); do sleep 100000 & sleeps+=($!); done
start_pair
measure "1000 procs"

# Near the floor: the hog and both agents under the memory-pressure flock.
exec 9>"$LOCK"
flock 9
start=$(mem_available_bytes)
min=$((start - 3 * GIB / 2)) warn=$((start - GIB / 2))
"$HOG" --cap "$GIB" --hold $((window + 30)) &
hog=$!
sleep 2
start_pair "$min" "$warn"
measure "near floor (between warn and act), 1000 procs"
grep -q "floor_warn" "$work/gg.log" || echo "WARNING: the near-floor case never reached warn" >&2
grep -q "floor_act" "$work/gg.log" && echo "WARNING: the near-floor case crossed the act floor" >&2
kill_pids "$hog"
hog=
flock -u 9
exec 9>&-

fake_gpu_state "$work/nvml.state" "${sleeps[@]:0:128}"
gpuguard_config "$work/gg-gpu.toml" "$FAKE_GPU_TOML"
agents=() names=()
FAKE_NVML_STATE="$work/nvml.state" start_gpuguard gg-gpu "$work/gg-gpu.toml"
measure "8 fake GPUs x 16 procs, 1000 procs"
if ! grep -q "GPU protection on: 8 GPU" "$work/gg-gpu.log"; then
    echo "WARNING: gpuguard did not report 8 GPUs:" >&2; cat "$work/gg-gpu.log" >&2
fi

gpuguard_config "$work/gg-lock.toml" "$FAKE_GPU_TOML"
agents=() names=()
FAKE_NVML_STATE="$work/nvml.state" start_gpuguard gg-lock "$work/gg-lock.toml" --lock-memory
measure "--lock-memory, 8 fake GPUs x 16 procs, 1000 procs"
grep -q "memory locked" "$work/gg-lock.log" || { echo "WARNING: memory not locked:" >&2; cat "$work/gg-lock.log" >&2; }
cp "$work"/*.log "$out/" 2>/dev/null || true
# How much of the hot-code order (build.rs, bench/hot-code.sh) this binary was linked with: a stale
# list shows as a low share here and as a higher peak RSS above.
python3 "$BENCH_DIR/analyze.py" hot-code-check --binary "$GPUGUARD" --order "$REPO_DIR/packaging/hot-code.order" |
    tee -a "$out/overhead.md"
