# lib.sh: shared settings and helpers for the gpuguard benchmarks (sourced, not run).
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$BENCH_DIR/.." && pwd)
BUILD_DIR="$BENCH_DIR/build"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO_DIR/target}
GPUGUARD=${GPUGUARD:-$CARGO_TARGET_DIR/release/gpuguard}
EARLYOOM=${EARLYOOM:-$(command -v earlyoom || echo /usr/bin/earlyoom)}
HOG="$BUILD_DIR/gg_bench_hog"       # its comm is "gg_bench_hog": the only thing any agent may pick
SAMPLER="$BUILD_DIR/sampler"
STORM="$BUILD_DIR/gg_bench_storm"    # fork storm (bench/storm.c)
# Background permit load (benches/permits.rs with PERMIT_LOAD_SOCKET): built by build_permit_load.
PERMIT_LOAD="$BUILD_DIR/permit_load"
# A no-op permit server (bench/permit_echo.c): the floor of a socket round trip on this machine.
PERMIT_ECHO="$BUILD_DIR/permit_echo"
LOCK=/tmp/gpuguard-memory-pressure.lock  # shared with the project's memory-pressure tests
GIB=$((1 << 30))
MIB=$((1 << 20))

mem_available_bytes() { awk '/^MemAvailable:/ {printf "%.0f\n", $2 * 1024}' /proc/meminfo; }
mem_total_bytes() { awk '/^MemTotal:/ {printf "%.0f\n", $2 * 1024}' /proc/meminfo; }

# An earlyoom --avoid regex (POSIX ERE, matched against the process name) that matches every
# name except those starting with $1: shorter names, or a first differing character.
avoid_all_but() {
    local name=$1 i alts
    alts=".{0,$((${#name} - 1))}\$"
    for ((i = 0; i < ${#name}; i++)); do alts+="|${name:0:i}[^${name:i:1}]"; done
    printf '^(%s)' "$alts"
}

# CPU time of a process (all its threads, dead ones included) in clock ticks: utime + stime.
cpu_ticks() { awk '{sub(/^.*\) /, ""); print $12 + $13}' "/proc/$1/stat"; }
# Peak RSS in KiB.
vm_hwm_kib() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status"; }

# Wait up to $3 seconds for file $1 to contain regex $2.
wait_for_line() {
    local deadline=$((SECONDS + $3))
    until grep -qE "$2" "$1" 2>/dev/null; do
        ((SECONDS < deadline)) || return 1
        sleep 0.02
    done
}

# Wait up to $2 seconds for the socket $1 (a daemon's, once it serves).
wait_for_socket() {
    local deadline=$((SECONDS + $2))
    until [[ -S $1 ]]; do
        ((SECONDS < deadline)) || return 1
        sleep 0.02
    done
}

# Kill the given pids (ours only: callers pass pids they started), then reap them.
kill_pids() {
    local pid
    for pid in "$@"; do [[ -z $pid ]] || kill -KILL "$pid" 2>/dev/null || true; done
    for pid in "$@"; do [[ -z $pid ]] || wait "$pid" 2>/dev/null || true; done
}

# gpuguard_config FILE [GPU_TOML [MIN [WARN]]]: a config that can pick nothing but a model no
# process matches (candidates = "models"), floors 5 %/10 % unless MIN/WARN (bytes) are given; its
# state and socket go under the caller's $work directory.
gpuguard_config() {
    local min=${3:-} warn=${4:-}
    [[ -n $min ]] || min='"5%"'
    [[ -n $warn ]] || warn='"10%"'
    cat >"$1" <<TOML
[daemon]
state_dir = "$work/state-$RANDOM"
candidates = "models"
[ram]
min_available = $min
warn_available = $warn
${2:-}
[launch]
socket = "$work/sock-$RANDOM"
[[model]]
name = "nothing"
match = { comm = "gg_bench_none" }
TOML
}

# The [gpu] section for the fake NVML state written by fake_gpu_state.
FAKE_GPU_TOML="[gpu]
enabled = true
nvml_library = \"$BUILD_DIR/libnvidia-ml.so.1\"
warn_free = \"4GiB\"
min_free = \"2GiB\""

# fake_gpu_state FILE PID...: 8 fake H100s, each with 16 of the given pids (128 needed) holding
# 2.5 GiB, for FAKE_NVML_STATE (tests/fake_nvml).
fake_gpu_state() {
    local file=$1 g p
    shift
    {
        echo "driver_version 550.54.15"
        for ((g = 0; g < 8; g++)); do
            echo "device $g name=\"Fake H100\" total=85899345920 used=42949672960 util=50 memutil=40 temp=50"
            for ((p = 0; p < 16; p++)); do echo "process $g ${@:g * 16 + p + 1:1} 2684354560"; done
        done
    } >"$file"
}

build_tools() {
    mkdir -p "$BUILD_DIR"
    gcc -O2 -Wall -o "$HOG" "$BENCH_DIR/hog.c"
    gcc -O2 -Wall -o "$SAMPLER" "$BENCH_DIR/sampler.c"
    gcc -O2 -Wall -o "$STORM" "$BENCH_DIR/storm.c"
    build_permit_echo
    build_fake_nvml
}

# The fake NVML (tests/fake_nvml) at $BUILD_DIR/libnvidia-ml.so.1, for FAKE_GPU_TOML.
build_fake_nvml() {
    mkdir -p "$BUILD_DIR"
    gcc -shared -fPIC -O2 -pthread -Wl,-soname,libnvidia-ml.so.1 -Wl,-z,nodelete \
        -o "$BUILD_DIR/libnvidia-ml.so.1" "$REPO_DIR/tests/fake_nvml/fake_nvml.c"
}

# Background load for a case: "none", "idle1000" (1000 idle `sleep` processes) or "storm" (a fork
# storm: up to 400 short-lived processes at once, each living ~200 ms, ~2000 new ones a second,
# on top of the 1000 idle ones). start_background NAME fills BACKGROUND_PIDS; stop_background
# kills them (ours only).
BACKGROUND_PIDS=()
start_background() {
    local i
    case $1 in
    none) ;;
    permits) ;; # started against the agent's own socket by reaction-one.sh (gpuguard only)
    idle1000 | storm)
        for ((i = 0; i < 1000; i++)); do sleep 100000 & BACKGROUND_PIDS+=($!); done
        if [[ $1 == storm ]]; then
            "$STORM" --live 400 --life-ms 200 >/dev/null &
            BACKGROUND_PIDS+=($!)
        fi
        ;;
    *) echo "unknown background $1" >&2; return 2 ;;
    esac
    sleep 1
}
stop_background() {
    kill_pids "${BACKGROUND_PIDS[@]}"
    BACKGROUND_PIDS=()
}

# The no-op permit server (bench/permit_echo.c), at $PERMIT_ECHO.
build_permit_echo() {
    mkdir -p "$BUILD_DIR"
    gcc -O2 -Wall -o "$PERMIT_ECHO" "$BENCH_DIR/permit_echo.c"
}

# The permit load generator (benches/permits.rs), copied to $PERMIT_LOAD.
build_permit_load() {
    local exe
    exe=$(cd "$REPO_DIR" && cargo bench --bench permits --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "permits":
        print(m["executable"])')
    [[ -x $exe ]] || { echo "could not build benches/permits.rs" >&2; return 1; }
    mkdir -p "$BUILD_DIR" && cp "$exe" "$PERMIT_LOAD"
}

# seed_daemon_config DIR GPU_TOML [MODEL_TOML]: the permit scenarios' daemon config in
# DIR/config.toml (state and socket in DIR): observe mode, no RAM floors, a 512 MiB GPU warn
# floor plus GPU_TOML under [gpu], model "seed" (tests/permits/seed_server.py) plus MODEL_TOML.
seed_daemon_config() {
    cat >"$1/config.toml" <<TOML
[daemon]
state_dir = "$1/state"
candidates = "models"
mode = "observe"
interval = "200ms"
scan_interval = "200ms"
[ram]
min_available = "0%"
warn_available = "0%"
[gpu]
warn_free = "512MiB"
$2
[launch]
socket = "$1/sock"
[[model]]
name = "seed"
match = { cmdline = "tests/permits/seed_server\\\\.py" }
${3:-}
TOML
}
