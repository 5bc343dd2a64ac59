#!/usr/bin/env bash
# socket-load.sh: the daemon's CPU while local clients load its socket, for each binary given
# (default: the release build), one after the other, SECONDS_RUN (default 5) per case, on a fake
# 16 GiB card with 4 GiB free. Cases:
#   acquire/cancel   one root client loops acquire (8 GiB: it waits, and a waiting acquire wakes
#                    the loop) and cancel as fast as the answers come back
#   held             an unprivileged user (nobody) holds 1100 connections, each asking for a
#                    launch that never fits, and reconnects every 0.5 s those refused or closed
# Prints per binary and case: requests or connections, the loop's ticks, and the daemon's CPU
# (user+system) per second of wall time.
#
#   bench/socket-load.sh [BINARY...]        (needs root, python3, gcc, setpriv)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_DIR"
build_fake_nvml
[ $# -gt 0 ] || { cargo build --release --quiet; set -- "$GPUGUARD"; }
seconds=${SECONDS_RUN:-5}
work=$(mktemp -d)
chmod 755 "$work"
daemon= client=
trap 'kill_pids $daemon $client; rm -rf "$work"' EXIT
hz=$(getconf CLK_TCK)

cat >"$work/loop.py" <<'PY'
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
print(n, flush=True)
PY
cat >"$work/hold.py" <<'PY'
import socket, sys, time
line = b'{"version":1,"type":"launch","model":"blind","gpu_memory_bytes":1,"queue_timeout_ms":18446744073709551615,"command":["x"]}\n'
def connect():
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sys.argv[1])
        s.sendall(line)
        s.setblocking(False)
        return s
    except OSError:
        return None
def silent(s):
    try:
        s.recv(1, socket.MSG_PEEK)  # an answer, or b"" once closed
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
conns, made = [connect() for _ in range(1100)], 1100
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    time.sleep(0.5)
    for i, s in enumerate(conns):
        if s is None or not silent(s):
            if s:
                s.close()
            conns[i], made = connect(), made + 1
print(made, flush=True)
PY

cpu() { awk '{print $14 + $15}' /proc/$1/stat; }
ticks() { grep -c ' tick ' "$work/log" || true; }

echo "| binary | case | requests (acquire/cancel) or connections made | loop ticks | daemon CPU per second |"
echo "|---|---|---|---|---|"
for bin in "$@"; do
    for case in acquire/cancel held; do
        printf 'device 0 uuid=GPU-bench total=%d used=%d\n' $((16 * GIB)) $((12 * GIB)) >"$work/nvml"
        seed_daemon_config "$work" "nvml_library = \"$BUILD_DIR/libnvidia-ml.so.1\""
        rm -f "$work/sock"
        GPUGUARD_LOG=gpuguard=debug FAKE_NVML_STATE="$work/nvml" "$bin" daemon --config "$work/config.toml" >"$work/log" 2>&1 &
        daemon=$!
        until [ -S "$work/sock" ]; do sleep 0.05; done
        sleep 1
        t0=$(ticks) c0=$(cpu $daemon)
        if [ $case = held ]; then
            n=$(setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 "$work/hold.py" "$work/sock" "$seconds")
        else
            n=$(python3 "$work/loop.py" "$work/sock" "$seconds")
        fi
        c1=$(cpu $daemon) t1=$(ticks)
        kill_pids $daemon
        daemon=
        echo "| $bin | $case | $n | $((t1 - t0)) | $(python3 -c "print(f'{($c1 - $c0) / $hz / $seconds * 100:.0f} %')") |"
    done
done
