#!/usr/bin/env bash
# wake-storm.sh: the daemon's CPU while one client loops acquire/cancel as fast as it can (each
# acquire waits for GPU memory, and a waiting acquire wakes the loop). Runs each binary given
# (default: the release build) for SECONDS (default 5) on a fake 16 GiB card with 4 GiB free and
# prints per binary: acquire/cancel rounds, the loop's ticks, and the daemon's CPU (user+system)
# per second of wall time.
#
#   bench/wake-storm.sh [BINARY...]        (SECONDS=5; needs root: the host-wide pool is root's)
#
# Needs python3 and gcc (the fake NVML library is built as bench/allocators.sh builds it).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_DIR"
build_fake_nvml
[ $# -gt 0 ] || { cargo build --release --quiet; set -- "$GPUGUARD"; }
seconds=${SECONDS_RUN:-5}
work=$(mktemp -d)
daemon=
trap 'kill_pids $daemon; rm -rf "$work"' EXIT
echo "| binary | acquire/cancel rounds | ticks | daemon CPU per second |"
echo "|---|---|---|---|"
for bin in "$@"; do
    printf 'device 0 uuid=GPU-bench total=%d used=%d\n' $((16 * GIB)) $((12 * GIB)) >"$work/nvml"
    seed_daemon_config "$work" "nvml_library = \"$BUILD_DIR/libnvidia-ml.so.1\""
    rm -f "$work/sock"
    GPUGUARD_LOG=gpuguard=debug FAKE_NVML_STATE="$work/nvml" "$bin" daemon --config "$work/config.toml" >"$work/log" 2>&1 &
    daemon=$!
    until [ -S "$work/sock" ]; do sleep 0.05; done
    sleep 1
    before_ticks=$(grep -c ' tick ' "$work/log" || true)
    before_cpu=$(awk '{print $14 + $15}' /proc/$daemon/stat)
    rounds=$(python3 - "$work/sock" "$seconds" <<'PY'
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rwb")
end, n = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    n += 1
    for m in ({"version": 1, "type": "acquire", "id": n, "gpu_bytes": 8 << 30, "gpu": 0, "timeout_ms": 10000},
              {"version": 1, "type": "cancel", "id": n}):
        f.write(json.dumps(m).encode() + b"\n")
    f.flush()
    while json.loads(f.readline()).get("id") != n:
        pass
print(n)
PY
)
    after_cpu=$(awk '{print $14 + $15}' /proc/$daemon/stat)
    after_ticks=$(grep -c ' tick ' "$work/log" || true)
    kill_pids $daemon
    daemon=
    hz=$(getconf CLK_TCK)
    cpu=$(python3 -c "print(f'{($after_cpu - $before_cpu) / $hz / $seconds * 100:.0f} %')")
    echo "| $bin | $rounds | $((after_ticks - before_ticks)) | $cpu |"
done
