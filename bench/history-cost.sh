#!/usr/bin/env bash
# history-cost.sh: what the flight recorder writes on a quiet host, this build beside another.
#
#   bench/history-cost.sh OLD_GPUGUARD [RESULTS_DIR]     (env: SECONDS_PER_CASE=600)
#
# Two cases, all four daemons at once over the same window (one clock, one noise):
#   no GPU        GPU protection off, floors 5 %/10 % (the host stays quiet)
#   8 fake GPUs   the fake NVML (tests/fake_nvml), 8 GPUs x 16 processes (128 `sleep`s started
#                 here), the GPU floors of bench/lib.sh far below what is free
# Each daemon runs with its own state directory and socket and `candidates = "models"` with a
# model nothing matches (it can act on nothing). At the end each gets SIGTERM and logs what its
# recorder did ("history: N records, X written, Y syncs since the start"): per hour here, with
# the history directory's size on disk. Output: RESULTS_DIR/history-cost.md (also on stdout).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
old=${1:?usage: history-cost.sh OLD_GPUGUARD [RESULTS_DIR]}
out=${2:-$BENCH_DIR/results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
window=${SECONDS_PER_CASE:-600}
[[ -x $GPUGUARD ]] || { echo "build gpuguard first: cargo build --release" >&2; exit 1; }
[[ -f $BUILD_DIR/libnvidia-ml.so.1 ]] || build_fake_nvml

work=$(mktemp -d /tmp/gg-bench-history.XXXXXX)
sleeps=() agents=()
cleanup() { kill_pids "${agents[@]}" "${sleeps[@]}"; rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

for ((i = 0; i < 128; i++)); do sleep 100000 & sleeps+=($!); done
fake_gpu_state "$work/nvml.state" "${sleeps[@]}"
names=()
for bin in new old; do
    [[ $bin == new ]] && exe=$GPUGUARD || exe=$old
    gpuguard_config "$work/$bin-nogpu.toml" $'[gpu]\nenabled = false'
    "$exe" daemon --config "$work/$bin-nogpu.toml" 2>"$work/$bin-nogpu.log" &
    agents+=($!) names+=("$bin-nogpu")
    gpuguard_config "$work/$bin-gpu.toml" "$FAKE_GPU_TOML"
    FAKE_NVML_STATE="$work/nvml.state" "$exe" daemon --config "$work/$bin-gpu.toml" 2>"$work/$bin-gpu.log" &
    agents+=($!) names+=("$bin-gpu")
done
sleep "$window"
for pid in "${agents[@]}"; do kill -TERM "$pid"; done
for pid in "${agents[@]}"; do wait "$pid" || true; done
agents=()
{
    echo "| daemon | case | records | written | syncs | per hour: written, syncs | on disk |"
    echo "|---|---|---|---|---|---|---|"
    for name in "${names[@]}"; do
        line=$(grep -o 'history: [0-9]* records, [^,]* written, [0-9]* syncs' "$work/$name.log" | tail -1)
        read -r records written unit syncs < <(sed -E 's/history: ([0-9]+) records, ([0-9.]+) ([KMG]?i?B) written, ([0-9]+) syncs/\1 \2 \3 \4/' <<<"$line")
        state=$(grep -o 'state_dir = "[^"]*"' "$work/${name}.toml" | cut -d'"' -f2)
        disk=$(du -sk "$state/history" | cut -f1)
        per_hour=$(python3 -c "import sys; v,u,s,w=float('$written'),'$unit',int('$syncs'),$window; m={'B':1,'KiB':1024,'MiB':1<<20,'GiB':1<<30}[u]; print(f'{v*m*3600/w/1024:.0f} KiB, {s*3600/w:.0f}')")
        echo "| ${name%%-*} | ${name#*-} | $records | $written $unit | $syncs | $per_hour | $disk KiB |"
    done
} | tee "$out/history-cost.md"
cp "$work"/*.log "$out/" 2>/dev/null || true
