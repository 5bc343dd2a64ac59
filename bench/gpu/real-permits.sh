#!/usr/bin/env bash
# real-permits.sh: issue #22's scenario on a real GPU with real PyTorch, beside the hand-written
# semaphore, in one run. A ballast process leaves CARD_GIB free on GPU 0 (the card the server
# sees); tests/permits/seed_server.py --real-gpu loads 4 GiB of weights and serves three bursts of
# 10 requests, each a real tensor from PyTorch's caching allocator held 0.2 s. Once with a
# gpuguard permit per request (the daemon on the real NVML library, observe mode, 512 MiB warn
# floor, restarted per case), once with threading.Semaphore(N) per N. Then JAX's preallocation
# as gpuguard sees it, and NVML's lag (bench/gpu/nvml_lag.py). Touches only processes it starts.
#
#   bench/gpu/real-permits.sh PATH/TO/gpuguard OUTDIR [CARD_GIB]
#
# Needs root, python3 with torch (and jax, nvidia-ml-py for the last two parts) and a GPU with
# CARD_GIB + 1 GiB free. Writes OUTDIR/results.jsonl (one JSON line per case, with "case"),
# OUTDIR/status.jsonl (the daemon's status --json after each permit case), OUTDIR/nvml.json,
# OUTDIR/jax.json and OUTDIR/log. ONLY=REGEX runs only the cases whose names match; PROBES=0
# skips the JAX and NVML probes; SEEDS="1 2 ..." are the draws of mixed sizes (default "1 2");
# GPUGUARD_LOG=debug gives the daemon's reasons in daemon.log.
set -uo pipefail
BIN=$(realpath "${1:?usage: real-permits.sh PATH/TO/gpuguard OUTDIR [CARD_GIB]}")
OUT=$(realpath -m "${2:?OUTDIR}")
CARD=${3:-16}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
source "$REPO/bench/lib.sh"
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONPATH="$REPO/clients/python/src:$REPO/tests/permits${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
DAEMON= BALLAST=
cleanup() {
    for p in $DAEMON $BALLAST; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    rm -rf "$WORK"
}
trap cleanup EXIT
say() { echo "== $(date +%T) $*"; }

start_daemon() { # a fresh daemon on the real NVML; $1 = extra model lines
    if [ -n "$DAEMON" ]; then kill "$DAEMON"; wait "$DAEMON" 2>/dev/null; fi
    rm -rf "$WORK/state" "$WORK/sock"
    seed_daemon_config "$WORK" "" "${1:-}"
    "$BIN" daemon --config "$WORK/config.toml" >>"$OUT/daemon.log" 2>&1 &
    DAEMON=$!
    wait_for_socket "$WORK/sock" 10
    sleep 1
}

case_run() { # NAME ARGS...: one seed run, its JSON line tagged with the case
    local name=$1
    shift
    if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return; fi
    say "$name"
    local line
    line=$(python3 "$REPO/tests/permits/seed_server.py" --real-gpu --socket "$WORK/sock" \
        --pause 1 --permit-timeout 10 "$@" 2>>"$OUT/seed.err" | tail -1)
    echo "$line"
    python3 -c 'import json,sys; r=json.loads(sys.argv[2]); r["case"]=sys.argv[1]; print(json.dumps(r))' \
        "$name" "$line" >>"$OUT/results.jsonl" || echo "{\"case\": \"$name\", \"failed\": true}" >>"$OUT/results.jsonl"
}

status_after() { # NAME: the daemon's view after a permit case
    if [ -n "${ONLY:-}" ] && ! [[ $1 =~ $ONLY ]]; then return; fi
    "$BIN" status --json --socket "$WORK/sock" 2>&1 |
        python3 -c 'import json,sys; r=json.load(sys.stdin); print(json.dumps({"case": sys.argv[1], "status": r}))' "$1" \
        >>"$OUT/status.jsonl" || echo "status failed"
}

{
say "machine"
nvidia-smi --query-gpu=index,name,memory.total,memory.used,memory.free,driver_version --format=csv
uname -r; ldd --version | head -1; python3 -c 'import torch; print("torch", torch.__version__)'
"$BIN" --version

if [ "${PROBES:-1}" = 1 ]; then
say "JAX preallocation as gpuguard sees it (before the ballast)"
start_daemon '[[model]]
name = "jax"
match = { cmdline = "gpuguard-jax-probe" }'
python3 -c '
import sys, time, jax.numpy as jnp
x = jnp.ones(1024); x.block_until_ready(); print("ready", flush=True); time.sleep(6)
' gpuguard-jax-probe >"$WORK/jax.out" 2>&1 &
JAX=$!
for _ in $(seq 100); do grep -q ready "$WORK/jax.out" && break; sleep 0.1; done
sleep 1.5
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
"$BIN" status --json --socket "$WORK/sock" >"$OUT/jax.json" 2>&1
"$BIN" status --socket "$WORK/sock" 2>&1 | head -40
wait $JAX; cat "$WORK/jax.out" | tail -3

say "NVML's figures against a real allocation"
python3 "$REPO/bench/gpu/nvml_lag.py" 5 >"$OUT/nvml.json" 2>>"$OUT/seed.err"; cat "$OUT/nvml.json"
fi

say "ballast: leave ${CARD} GiB free"
python3 -c '
import sys, time, torch
card = int(sys.argv[1]) << 30
torch.empty(1, device="cuda:0"); free, total = torch.cuda.mem_get_info(0)
x = torch.empty(free - card, dtype=torch.uint8, device="cuda:0"); x.fill_(1); torch.cuda.synchronize()
print("ready", torch.cuda.mem_get_info(0), flush=True); time.sleep(3600)
' "$CARD" gpuguard-ballast >"$WORK/ballast.out" 2>&1 &
BALLAST=$!
for _ in $(seq 300); do grep -q ready "$WORK/ballast.out" && break; sleep 0.1; done
cat "$WORK/ballast.out"
nvidia-smi --query-gpu=memory.used,memory.free --format=csv

start_daemon
case_run "no permits, 3GiB" --no-permits
for n in 2 3 4 5; do case_run "Semaphore($n), 3GiB" --semaphore $n; done
for n in 3 4 5 6; do case_run "Semaphore($n), 1-4GiB" --semaphore $n --request-size 1GiB-4GiB; done
start_daemon; case_run "permits, 3GiB" ; status_after "permits, 3GiB"
start_daemon; case_run "permits allocator=torch, 3GiB" --torch; status_after "permits allocator=torch, 3GiB"
start_daemon; case_run "permits allocator=torch, 1-4GiB" --torch --request-size 1GiB-4GiB; status_after "permits allocator=torch, 1-4GiB"
for seed in ${SEEDS:-1 2}; do
    start_daemon; case_run "permits allocator=torch, 1-4GiB, seed $seed" --torch --request-size 1GiB-4GiB --seed $seed
    start_daemon; case_run "permits, 1-4GiB, seed $seed" --request-size 1GiB-4GiB --seed $seed
    case_run "Semaphore(3), 1-4GiB, seed $seed" --semaphore 3 --request-size 1GiB-4GiB --seed $seed
done
start_daemon; case_run "permits, 1-4GiB" --request-size 1GiB-4GiB
start_daemon; case_run "permits, warm 3 before, 3GiB" --warm 3; status_after "permits, warm 3 before, 3GiB"
start_daemon; case_run "permits allocator=torch, warm 3 before, 3GiB" --torch --warm 3
start_daemon; case_run "permits allocator=torch, 2 workers, 3GiB" --torch --workers 2
start_daemon; case_run "Semaphore(1) per worker, 2 workers, 3GiB" --semaphore 1 --workers 2
for seed in ${SEEDS:-1 2}; do
    start_daemon; case_run "permits allocator=torch, 2 workers, 1-4GiB, seed $seed" --torch --workers 2 --request-size 1GiB-4GiB --seed $seed
    case_run "Semaphore(1) per worker, 2 workers, 1-4GiB, seed $seed" --semaphore 1 --workers 2 --request-size 1GiB-4GiB --seed $seed
done
say "done"
} 2>&1 | tee "$OUT/log"
