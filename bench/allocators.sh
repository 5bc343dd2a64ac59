#!/usr/bin/env bash
# allocators.sh: permits against the allocators real servers use (issue #22), beside the
# hand-written semaphore they replace, in one run. Each case is tests/permits/seed_server.py (a
# model server on a fake card: 512 MiB CUDA context + 4 GiB weights, three bursts of 10 requests,
# 0.2 s of work each, 1 s between bursts) with one of fakegpu.py's allocators, run once with a
# gpuguard permit per request (the release binary, fake NVML, a 512 MiB GPU warn floor) and once
# with threading.Semaphore(N) for each N from 1 up to the first that overflows: the best
# semaphore is the largest N with no CUDA OOM (in any of five draws, with mixed sizes). One
# Markdown row per case: requests served, OOMs, most in flight and median latency (arrival to end
# of work) for each.
#
#   bench/allocators.sh        (about 20 minutes; MIXED_DRAWS="1 2 3" for fewer draws)
#
# Needs python3 with venv (the client is installed into target/pyenv, as scripts/test does) and gcc.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_DIR"
venv=target/pyenv
[ -x $venv/bin/python ] || python3 -m venv $venv
$venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall ./clients/python
build_fake_nvml
cargo build --release --quiet
work=$(mktemp -d)
daemon=
trap 'kill_pids $daemon; rm -rf "$work"' EXIT

# start_daemon CARD_GIB [MODEL_TOML]: a daemon on a fresh fake card, watching model "seed".
start_daemon() {
    kill_pids $daemon
    printf 'device 0 uuid=GPU-bench total=%d used=0\n' $(($1 * GIB)) >"$work/nvml"
    rm -rf "$work/nvml.procs"
    seed_daemon_config "$work" "nvml_library = \"$BUILD_DIR/libnvidia-ml.so.1\"
sample_timeout = \"500ms\"" "${2:-}"
    rm -f "$work/sock"
    FAKE_NVML_STATE="$work/nvml" "$GPUGUARD" daemon --config "$work/config.toml" >"$work/log" 2>&1 &
    daemon=$!
    until [ -S "$work/sock" ]; do sleep 0.05; done
    sleep 0.5
}

# seed CARD_GIB ARGS...: one run of the scenario; prints its JSON.
seed() {
    local card=$1
    shift
    $venv/bin/python tests/permits/seed_server.py --state "$work/nvml" --socket "$work/sock" \
        --card-total "${card}GiB" --context 512MiB --pause 1 --permit-timeout 5 "$@"
}

# runs CARD_GIB ARGS...: the scenario once, or once per draw of sizes in $DRAWS (--seed N each;
# a semaphore stops at the first draw it overflows); prints one JSON of them pooled (sums, the most in
# flight, the median of every served request's latency).
runs() {
    local card=$1
    shift
    if [ -z "${DRAWS:-}" ]; then
        seed "$card" "$@"
        return
    fi
    local d r all=()
    for d in $DRAWS; do
        r=$(seed "$card" "$@" --seed "$d")
        all+=("$r")
        [[ " $* " != *" --semaphore "* ]] || [ "$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["overflows"])' "$r")" = 0 ] || break
    done
    python3 -c '
import json, sys
runs = [json.loads(a) for a in sys.argv[1:]]
lat = sorted(x for r in runs for x in r["latencies_s"])
print(json.dumps({
    "requests": sum(r["requests"] for r in runs), "served": sum(r["served"] for r in runs),
    "overflows": sum(r["overflows"] for r in runs),
    "max_in_flight": max(r["max_in_flight"] for r in runs),
    "median_latency_s": round(lat[len(lat) // 2], 3) if lat else None, "draws": len(runs)}))
' "${all[@]}"
}

# cell JSON: "served/requests, OOM n, in flight n, median s"
cell() {
    python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("%d/%d, %d OOM, %d at once, %s" % (r["served"], r["requests"], r["overflows"], r["max_in_flight"], "-" if r["median_latency_s"] is None else "%ss" % r["median_latency_s"]))' "$1"
}

# row NAME CARD_GIB MODEL_TOML ARGS...: with DRAWS="N ..." (mixed sizes) each cell pools those
# draws, and the best semaphore is the largest with no OOM in any of them, as a semaphore tuned by
# hand must survive every burst it will meet, not one.
row() {
    local name=$1 card=$2 model=$3 n best= best_json= first_oom=
    shift 3
    start_daemon "$card" "$model"
    local permits
    permits=$(runs "$card" "$@")
    for ((n = 1; n <= 12; n++)); do
        local r
        r=$(runs "$card" --semaphore "$n" "$@")
        if [ "$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["overflows"])' "$r")" != 0 ]; then
            first_oom="Semaphore($n): $(cell "$r")"
            break
        fi
        best=$n
        best_json=$r
    done
    echo "| $name | $(cell "$permits") | ${best:+Semaphore($best): $(cell "$best_json")} | ${first_oom:-none up to 12} |"
}

# Five draws of mixed sizes per cell (a semaphore of 3 on 16 GiB survives some draws, not all).
MIXED_DRAWS=${MIXED_DRAWS:-1 2 3 4 5}

echo "## machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(uname -r), $(date -u +%FT%TZ)"
echo "| allocator, card, request size | gpuguard permits: served, OOM, most at once, median latency | best fixed semaphore (no OOM) | next semaphore up |"
echo "|---|---|---|---|"
row "releasing (cudaFree per request), 16 GiB, 3 GiB" 16 "" --allocator release
row "PyTorch caching, 16 GiB, 3 GiB" 16 "" --allocator caching
DRAWS="$MIXED_DRAWS" row "PyTorch caching, 16 GiB, 1-4 GiB" 16 "" --allocator caching --request-size 1GiB-4GiB
DRAWS="$MIXED_DRAWS" row "PyTorch caching, 24 GiB, 1-4 GiB" 24 "" --allocator caching --request-size 1GiB-4GiB
DRAWS="$MIXED_DRAWS" row "PyTorch caching, 16 GiB, 1-4 GiB, allocator=\"torch\"" 16 "" --allocator caching --request-size 1GiB-4GiB --torch
DRAWS="$MIXED_DRAWS" row "PyTorch caching, 24 GiB, 1-4 GiB, allocator=\"torch\"" 24 "" --allocator caching --request-size 1GiB-4GiB --torch
row "PyTorch caching, 2 forked workers, 16 GiB, 3 GiB, allocator=\"torch\"" 16 "" --allocator caching --workers 2 --torch
row "PyTorch caching, 2 forked workers, 24 GiB, 3 GiB" 24 "" --allocator caching --workers 2
row "the same, allocator=\"torch\" (reports the cache, empties it on trim)" 24 "" --allocator caching --workers 2 --torch
row "the same, whole bursts to one worker in turn, allocator=\"torch\"" 24 "" --allocator caching --workers 2 --dispatch by-burst --torch
DRAWS="$MIXED_DRAWS" row "PyTorch caching, 2 forked workers, 16 GiB, 1-4 GiB, allocator=\"torch\"" 16 "" --allocator caching --workers 2 --request-size 1GiB-4GiB --torch
DRAWS="$MIXED_DRAWS" row "PyTorch caching, 3 forked workers, 24 GiB, 1-4 GiB, allocator=\"torch\"" 24 "" --allocator caching --workers 3 --request-size 1GiB-4GiB --torch
row "PyTorch caching warm before its first permit, 16 GiB, 3 GiB" 16 "" --allocator caching --warm 3
row "the same, allocator=\"torch\"" 16 "" --allocator caching --warm 3 --torch
row "preallocating engine (vLLM, 0.9), max_permits 4, 16 GiB, 3 GiB (permits of size 0)" 16 "max_permits = 4" --allocator prealloc --permit-size none
