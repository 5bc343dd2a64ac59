#!/usr/bin/env bash
# The NVML code path against a real NVIDIA driver: gpuguard's sampler sees a PyTorch process's
# GPU memory, attributes it to its pid, stops it for a GPU budget and resumes it after a reload,
# then kills it at a GPU floor set 2 GiB below the free memory seen at start; afterwards, with
# both daemons gone, `gpuguard history --at` shows it stopped as it was, with its GPU memory.
#
#   scripts/real-gpu-check.sh PATH/TO/gpuguard [OUTDIR]
#
# Needs root, python3 with torch, and a GPU with at least 8 GiB free. Touches only the process it
# starts itself.
set -euo pipefail
BIN=${1:?usage: real-gpu-check.sh PATH/TO/gpuguard [OUTDIR]}
OUT=${2:-$(mktemp -d)}
mkdir -p "$OUT"
WORK=$(mktemp -d)
TOKEN="gpuguard-real-gpu-$$"
say() { echo "== $*"; }
state() { awk '{print $3}' "/proc/$1/stat" 2>/dev/null || echo gone; }

nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,memory.free,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"
FREE_MIB=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i 0 | tr -d ' ')

# A torch process that holds 4 GiB on GPU 0 and idles.
python3 -c "
import sys, time, torch
x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda:0'); x.fill_(1); torch.cuda.synchronize()
print('allocated', flush=True)
time.sleep(600)
" "$TOKEN" > "$WORK/torch.out" 2>&1 &
TORCH=$!
trap 'kill -CONT $TORCH 2>/dev/null || true; kill -KILL $TORCH 2>/dev/null || true; if [ -n "${DAEMON:-}" ]; then kill $DAEMON 2>/dev/null || true; fi' EXIT
for _ in $(seq 100); do grep -q allocated "$WORK/torch.out" && break; sleep 0.2; done
grep -q allocated "$WORK/torch.out" || { cat "$WORK/torch.out"; exit 1; }
nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$OUT/compute-apps.csv"

config() { # $1 = gpu_memory budget, $2 = [gpu] floors
cat > "$WORK/config.toml" <<TOML
[daemon]
state_dir = "$WORK/state"
candidates = "models"
interval = "200ms"
scan_interval = "200ms"
[launch]
socket = "$WORK/gpuguard.sock"
[ram]
min_available = "0%"
warn_available = "0%"
[gpu]
$2
[[model]]
name = "torch"
match = { cmdline = "$TOKEN" }
gpu_memory = "$1"
action = "stop"
grace = "1s"
TOML
}

say "budget 2GiB, action stop: the 4 GiB torch process must be stopped"
config 2GiB ""
GPUGUARD_LOG=debug "$BIN" daemon --config "$WORK/config.toml" 2> "$OUT/daemon-budget.log" &
DAEMON=$!
for _ in $(seq 50); do [ "$(state $TORCH)" = T ] && break; sleep 0.2; done
echo "torch pid $TORCH state: $(state $TORCH)"; [ "$(state $TORCH)" = T ]
"$BIN" status --socket "$WORK/gpuguard.sock" | tee "$OUT/status.txt"
"$BIN" status --json --socket "$WORK/gpuguard.sock" > "$OUT/status.json"
sleep 1.1; STOPPED_AT=$(date -u +%FT%TZ)
say "budget raised to 8GiB + SIGHUP: it must be resumed"
config 8GiB ""
kill -HUP $DAEMON
for _ in $(seq 50); do [ "$(state $TORCH)" != T ] && break; sleep 0.2; done
echo "torch pid $TORCH state: $(state $TORCH)"; [ "$(state $TORCH)" != T ]
kill -TERM $DAEMON; wait $DAEMON || true

FLOOR_MIB=$((FREE_MIB - 2048))
say "GPU 0 min_free = ${FLOOR_MIB}MiB (free at start ${FREE_MIB}MiB minus 2 GiB): the torch process must be killed"
config 64GiB "min_free = \"${FLOOR_MIB}MiB\""
GPUGUARD_LOG=debug "$BIN" daemon --config "$WORK/config.toml" 2> "$OUT/daemon-floor.log" &
DAEMON=$!
for _ in $(seq 50); do kill -0 $TORCH 2>/dev/null || break; sleep 0.2; done
rc=0; wait $TORCH 2>/dev/null || rc=$?
echo "torch exit status: $rc (143 = SIGTERM, 137 = SIGKILL)"; [ $rc = 143 ] || [ $rc = 137 ]
sleep 1
kill -TERM $DAEMON; wait $DAEMON || true
grep -v DEBUG "$OUT/daemon-budget.log" "$OUT/daemon-floor.log" | cut -c1-400

say "history: the status at $STOPPED_AT (torch stopped), read back with both daemons gone"
"$BIN" history --dir "$WORK/state/history" --at "$STOPPED_AT" | tee "$OUT/history-at.txt"
"$BIN" history --dir "$WORK/state/history" --at "$STOPPED_AT" --json > "$OUT/history-at.json"
python3 - "$OUT/history-at.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
m = next(m for m in r["models"] if m["name"] == "torch")
print(f"torch at that moment: state {m['state']}, GPU {m['gpu_bytes'] / 2**30:.2f} GiB")
assert m["state"] == "stopped" and m["gpu_bytes"] >= 4 << 30, m
PY
"$BIN" history --dir "$WORK/state/history" --model torch --since "10m ago" | tee "$OUT/history-torch.txt"
"$BIN" history --dir "$WORK/state/history" --since "10m ago" --csv > "$OUT/history.csv"
echo "history CSV rows: $(wc -l < "$OUT/history.csv")"

say "GPU memory back after the kill: $(nvidia-smi --query-gpu=memory.free --format=csv,noheader -i 0) free"
say "sample cost per tick (µs): whole tick, and the NVML sample on its worker thread"
grep -h 'DEBUG tick' "$OUT"/daemon-*.log | sed -E 's/.*took_us=([0-9]+) scan=([a-z]+) .*gpu_sample_us=([0-9]+).*/\1 \2 \3/' > "$OUT/ticks.txt"
python3 - "$OUT/ticks.txt" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
for scan in ("false", "true"):
    t = [int(r[0]) for r in rows if r[1] == scan]
    if t: print(f"tick (process scan={scan}): n={len(t)} median={st.median(t)} µs p90={sorted(t)[int(len(t)*.9)]} µs")
for lists in ("memory only", "with process lists"):
    g = [int(r[2]) for r in rows if int(r[2]) > 0 and ((r[1] == "true") == (lists != "memory only"))]
    if g: print(f"NVML sample ({lists}, requested on the previous tick): n={len(g)} median={st.median(g)} µs max={max(g)} µs")
PY
say "all checks passed"
