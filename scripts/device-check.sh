#!/usr/bin/env bash
# Everything a session checks on a machine with a real NVIDIA GPU, in one run (device time is
# scarce): the machine; the NVML code path (scripts/real-gpu-check.sh, with the flight recorder
# read back); the cgroup v2 share under the unit's capabilities (scripts/real-cgroup-share.sh);
# and what the daemon costs with the real libnvidia-ml loaded, with and without --lock-memory
# (the issue-15 target: peak RSS <= 8 MiB) beside NVML's own floor (bench/gpu/nvml_floor.c), a
# pynvml poller and `nvidia-smi -l 1` in the same window, each one's largest resident mappings.
#
#   scripts/device-check.sh PATH/TO/gpuguard OUTDIR
#
# Each part runs whatever the one before did; the exit status is the number of parts that failed.
set -uo pipefail
BIN=$(realpath "${1:?usage: device-check.sh PATH/TO/gpuguard OUTDIR}")
OUT=$(realpath -m "${2:?OUTDIR}")
REPO=$(cd "$(dirname "$0")/.." && pwd)
source "$REPO/bench/lib.sh"
mkdir -p "$OUT"
say() { echo "==== $(date -u +%T) $*"; }
failed=0
part() { # NAME COMMAND...
    local name=$1
    shift
    say "$name"
    "$@"
    local rc=$?
    say "$name: exit $rc"
    [ $rc = 0 ] || failed=$((failed + 1))
}

machine() {
    uname -r; ldd --version | head -1; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
    ls -l "$(ldconfig -p | awk '/libnvidia-ml.so.1 /{print $NF; exit}')" 2>&1
    stat -fc 'cgroup fs: %T' /sys/fs/cgroup; cat /sys/fs/cgroup/cgroup.controllers 2>&1
    cat /proc/self/cgroup; command -v setpriv python3
    "$BIN" --version
}

real_nvml_cost() { # the daemon on the real NVML beside what else would watch the GPU, 20 s
    local work floor
    work=$(mktemp -d)
    # Stock floors and a model no process matches; a state directory and socket each.
    gpuguard_config "$work/plain.toml"
    gpuguard_config "$work/locked.toml"
    # NVML's own floor: a C program that makes gpuguard's calls and nothing else (built here
    # unless a build is carried in .device/).
    floor=$REPO/.device/nvml_floor
    [ -x "$floor" ] || { floor=$work/nvml_floor; gcc -O2 -o "$floor" "$REPO/bench/gpu/nvml_floor.c" -ldl -lpthread; }
    "$BIN" daemon --config "$work/plain.toml" 2>"$OUT/cost-plain.log" &
    local plain=$!
    "$BIN" daemon --config "$work/locked.toml" --lock-memory 2>"$OUT/cost-locked.log" &
    local locked=$!
    "$floor" 25 >"$OUT/nvml-floor.txt" 2>&1 &
    local nvml_c=$!
    python3 -c '
import time, pynvml
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
while True:
    pynvml.nvmlDeviceGetMemoryInfo(h); pynvml.nvmlDeviceGetUtilizationRates(h)
    pynvml.nvmlDeviceGetComputeRunningProcesses(h); time.sleep(1)
' &
    local pynvml=$!
    nvidia-smi --query-gpu=memory.used,memory.free,utilization.gpu --format=csv -l 1 >/dev/null &
    local smi=$!
    sleep 3
    local hz
    hz=$(getconf CLK_TCK)
    declare -A t0
    for v in plain locked nvml_c pynvml smi; do t0[$v]=$(cpu_ticks ${!v} 2>/dev/null); done
    sleep 20
    for v in plain locked nvml_c pynvml smi; do
        local pid=${!v}
        # One that did not start (a tool missing) is said so, and the others still measured.
        [ -n "${t0[$v]}" ] && [ -e "/proc/$pid/stat" ] || { echo "-- $v: not running"; continue; }
        echo "-- $v: CPU $(( $(cpu_ticks $pid) - ${t0[$v]} )) ticks of 1/$hz s in 20 s;" \
            "$(grep -E 'VmHWM|VmRSS|VmLck|RssAnon|RssFile|Threads' "/proc/$pid/status" | tr -s ' \t' ' ' | paste -sd' ')"
        awk '/^[0-9a-f]+-[0-9a-f]+ /{name = ($6 == "" ? "[anon]" : $6)} /^Rss:/{rss[name] += $2}
             END {for (n in rss) if (rss[n] >= 256) printf "   %6d KiB  %s\n", rss[n], n}' "/proc/$pid/smaps" |
            sort -rn | head -6
    done
    cp /proc/$plain/smaps "$OUT/gpuguard-smaps.txt"
    grep -h -i 'gpu protection' "$OUT/cost-plain.log" | head -2
    kill_pids $plain $locked $pynvml $smi
    wait $nvml_c # its last line after 25 s
    cat "$OUT/nvml-floor.txt"
    rm -rf "$work"
}

exec > >(tee "$OUT/log") 2>&1
part machine machine
part real-gpu-check "$REPO/scripts/real-gpu-check.sh" "$BIN" "$OUT/gpu"
part cgroup-share "$REPO/scripts/real-cgroup-share.sh" "$BIN" "$OUT/share"
part real-nvml-cost real_nvml_cost
say "parts failed: $failed"
exit "$failed"
