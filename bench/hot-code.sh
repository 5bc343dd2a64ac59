#!/usr/bin/env bash
# hot-code.sh: regenerates packaging/hot-code.order, the functions the daemon runs, which the
# release build's linker places first and together (build.rs). Without it the code an idle guard
# runs is scattered over the whole 6 MiB of text, and every page it touches brings up to 15
# neighbours with it (the kernel's fault-around): 4.5 MiB of code stayed resident, and locked
# with --lock-memory. Together, it is a few contiguous MiB.
#
#   bench/hot-code.sh [--check]          (root; uses the release build, $GPUGUARD)
#
# How: a copy of the binary, evicted from the page cache, runs the overhead benchmark's heaviest
# case (1000 processes, 8 fake GPUs, --lock-memory) and answers a status request and a permit
# while readahead is off on the copy's block device: each fault then reads only its own page and
# fault-around finds no neighbours in the cache, so the resident pages of the copy's text
# (/proc/PID/pagemap) are the pages it ran. Every function that overlaps one of them is listed,
# in address order. The device's readahead is restored on exit.
# --check: only says how many of the listed functions the current release binary has (function
# names carry hashes that change with the compiler and dependency versions; names the linker does
# not find are skipped, so a stale list costs memory, never correctness).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
ORDER="$REPO_DIR/packaging/hot-code.order"
[[ -x $GPUGUARD ]] || { echo "build gpuguard first: cargo build --release" >&2; exit 1; }
if [[ ${1:-} == --check ]]; then
    python3 "$BENCH_DIR/analyze.py" hot-code-check --binary "$GPUGUARD" --order "$ORDER"
    exit
fi
[[ $(id -u) == 0 ]] || { echo "hot-code.sh: needs root (readahead of a block device)" >&2; exit 1; }
[[ -f $BUILD_DIR/libnvidia-ml.so.1 ]] || build_tools

work=$(mktemp -d /var/tmp/gg-hot-code.XXXXXX)
daemon= ra_file= ra_old=
cleanup() {
    kill_pids "$daemon"
    stop_background
    [[ -z $ra_file ]] || echo "$ra_old" >"$ra_file"
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The block device under $work (a partition's readahead is its disk's).
dev=$(findmnt -no SOURCE --target "$work")
[[ -b $dev ]] || { echo "hot-code.sh: $work is not on a block device ($dev)" >&2; exit 1; }
disk=$(lsblk -no PKNAME "$dev" | head -n 1)
ra_file="/sys/class/block/${disk:-$(basename "$dev")}/queue/read_ahead_kb"
ra_old=$(cat "$ra_file")

copy="$work/gpuguard"
cp "$GPUGUARD" "$copy"
sync "$copy"
python3 -c 'import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)' "$copy"
echo 0 >"$ra_file"

start_background idle1000
fake_gpu_state "$work/nvml.state" "${BACKGROUND_PIDS[@]:0:128}"
gpuguard_config "$work/gg.toml" "$FAKE_GPU_TOML"
socket=$(awk -F'"' '/^socket/ {print $2}' "$work/gg.toml")
FAKE_NVML_STATE="$work/nvml.state" "$copy" daemon --config "$work/gg.toml" --lock-memory 2>"$work/daemon.log" &
daemon=$!
wait_for_line "$work/daemon.log" "started" 10 || { cat "$work/daemon.log" >&2; exit 1; }
sleep 5
# The clients run the original binary: their pages must not warm the copy's cache.
"$GPUGUARD" status --socket "$socket" >/dev/null
"$GPUGUARD" permit --ram 1MiB --socket "$socket" -- true
# Past a minute, so the work done once a minute (the flight recorder's input and sync, the scan's
# rotation) is listed too: left out, each such page brings its neighbours in, in the benchmark's
# windows and on every host.
sleep "${HOT_CODE_SECONDS:-75}"
python3 "$BENCH_DIR/analyze.py" hot-code --pid "$daemon" --binary "$copy" >"$ORDER.new"
mv "$ORDER.new" "$ORDER"
echo "wrote $ORDER: $(wc -l <"$ORDER") functions" >&2
