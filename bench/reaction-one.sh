#!/usr/bin/env bash
# reaction-one.sh: ONE reaction run: an agent, a hog filling RAM, a 1 ms MemAvailable sampler.
#
#   flock /tmp/gpuguard-memory-pressure.lock bench/reaction-one.sh AGENT RATE HOG OUT_CSV [BACKGROUND]
#
# AGENT: gpuguard | earlyoom (SIGTERM at the floor, SIGKILL at half of it: its default)
#        | earlyoom-kill (-M FLOOR,FLOOR: SIGKILL at the floor)
#        | gpuguard+growth=SIZE (gpuguard with daemon.term_max_growth = SIZE: the growth after
#          SIGTERM that proves a victim ignores it; the default is 8MiB)
# RATE: hog fill rate in bytes/s, 0 = as fast as it can.  HOG: term | ignore-term.
# BACKGROUND: the label of what reaction.sh runs beside it (none, idle1000, storm, permits), for
# the CSV. permits (gpuguard only): 64 clients asking the agent's socket for 20 000 RAM permits/s
# from before the hog starts until it ends (benches/permits.rs, PERMIT_LOAD_SOCKET).
# The floor is MemAvailable at start minus 1.5 GiB; the hog stops by itself once MemAvailable is
# 1 GiB below the floor, and never holds more than 2 GiB beyond what that takes at the start.
# Appends one CSV line to OUT_CSV (see analyze.py). Must run under the flock (run via reaction.sh).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
agent=$1 rate=$2 hogkind=$3 out=$4 background=${5:-none}

work=$(mktemp -d /tmp/gg-bench-reaction.XXXXXX)
agent_pid= sampler_pid= hog_pid= load_pid=
# BENCH_KEEP=DIR keeps each run's samples and agent log under DIR.
cleanup() {
    kill_pids "$hog_pid" "$load_pid" "$agent_pid" "$sampler_pid"
    if [[ -n ${BENCH_KEEP:-} ]]; then mkdir -p "$BENCH_KEEP" && cp -r "$work" "$BENCH_KEEP/"; fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Warm-up: on this VM (virtio-balloon free page reporting) memory freed a few seconds ago goes
# back to the hypervisor and is 5-7x slower to fault in again; touch what the hog will use right
# before the run (no agent is running yet) so that the hog fills at the rate asked.
"$HOG" --cap $((4 * GIB)) --hold 0

start=$(mem_available_bytes)
floor=$((start - 3 * GIB / 2))
warn=$((floor + 512 * MIB))
stop_below=$((floor - GIB))            # the hog never takes MemAvailable more than 1 GiB below the floor
cap=$((start - stop_below + 2 * GIB))    # nor more than 2 GiB beyond that, whatever MemAvailable says

case $agent in
gpuguard | gpuguard+growth=*)
    growth=
    [[ $agent == *+growth=* ]] && growth="term_max_growth = \"${agent#*+growth=}\""
    cat >"$work/gpuguard.toml" <<TOML
[daemon]
state_dir = "$work/state"
$growth
candidates = "models"
[ram]
min_available = $floor
warn_available = $warn
action = "kill"
[gpu]
enabled = false
[launch]
socket = "$work/gpuguard.sock"
[[model]]
name = "bench-hog"
match = { comm = "gg_bench_hog", cmdline = '^\S*/gg_bench_hog( |$)' }
TOML
    GPUGUARD_LOG=${BENCH_GPUGUARD_LOG:-info} "$GPUGUARD" daemon --config "$work/gpuguard.toml" >"$work/agent.log" 2>&1 &
    agent_pid=$!
    wait_for_line "$work/agent.log" "started" 10 || { cat "$work/agent.log" >&2; exit 1; }
    ;;
earlyoom | earlyoom-kill)
    m=$((floor / 1024))
    [[ $agent == earlyoom-kill ]] && m="$m,$m"
    # -s 100,100: no swap here, so only MemAvailable decides; --prefer/--avoid: only the hog.
    stdbuf -oL -eL "$EARLYOOM" -M "$m" -s 100,100 -r 0 --prefer '^gg_bench_hog$' \
        --avoid "$(avoid_all_but gg_bench_hog)" >"$work/agent.log" 2>&1 &
    agent_pid=$!
    wait_for_line "$work/agent.log" "SIGKILL when" 10 || { cat "$work/agent.log" >&2; exit 1; }
    ;;
*) echo "unknown agent $agent" >&2; exit 2 ;;
esac
if [[ $background == permits ]]; then
    [[ $agent == gpuguard* ]] || { echo "background permits: gpuguard only" >&2; exit 2; }
    PERMIT_LOAD_SOCKET="$work/gpuguard.sock" PERMIT_SECONDS=60 "$PERMIT_LOAD" 2>"$work/load.log" &
    load_pid=$!
    sleep 1     # the load at full rate before the hog starts
fi
sleep 0.2   # first tick / scan

hog_args=(--rate "$rate" --cap "$cap" --stop-below "$stop_below" --hold 2 --status "$work/hog.status")
[[ $hogkind == ignore-term ]] && hog_args+=(--ignore-term)
"$SAMPLER" --out "$work/samples.csv" --status "$work/hog.status" --max-s 30 &
sampler_pid=$!
sleep 0.1
"$HOG" "${hog_args[@]}" &
hog_pid=$!
hog_rc=0
wait "$hog_pid" || hog_rc=$?
hog_pid=
# The hog is gone: stop the load and the agent at once so it can never pick anything else.
if [[ -n $load_pid ]]; then
    kill -TERM "$load_pid" 2>/dev/null || true
    wait "$load_pid" 2>/dev/null || true
    load_pid=
    cat "$work/load.log" >&2
fi
kill -TERM "$agent_pid" 2>/dev/null || true
wait "$agent_pid" 2>/dev/null || true
agent_pid=
sleep 0.5   # let the sampler see memory come back
kill -TERM "$sampler_pid"
wait "$sampler_pid" || true
sampler_pid=

python3 "$BENCH_DIR/analyze.py" reaction --samples "$work/samples.csv" --status "$work/hog.status" \
    --floor "$floor" --agent "$agent" --rate "$rate" --hog "$hogkind" --hog-rc "$hog_rc" \
    --start "$start" --agent-log "$work/agent.log" --background "$background" >>"$out"
