#!/usr/bin/env bash
# reaction.sh: the reaction benchmark: gpuguard vs earlyoom on the same hogs, same host, same run.
#
#   bench/reaction.sh [RESULTS_DIR]      (env: RUNS=5, AGENTS, RATES, HOGS, BACKGROUNDS)
#
# For every background (none: the host as it is; idle1000: 1000 idle processes; storm: those
# plus a fork storm of up to 400 short-lived processes at once, see lib.sh; permits: 20 000
# permits/s on gpuguard's own socket, gpuguard only, BACKGROUNDS="none permits" AGENTS=gpuguard),
# run index, hog kind
# (term, ignore-term) and rate (1 GiB/s, max), each agent gets one run (interleaved, so drift on
# a shared host hits all agents alike); each run holds the memory-pressure flock for its whole
# duration (see reaction-one.sh, which also warms the memory up first: on a VM, memory handed
# back to the hypervisor is 5-7x slower to fault in).
# Output: RESULTS_DIR/reaction.csv (one line per run) and a table of medians on stdout.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
out=${1:-$BENCH_DIR/results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
RUNS=${RUNS:-5}
AGENTS=${AGENTS:-gpuguard earlyoom earlyoom-kill}
RATES=${RATES:-$GIB 0}
HOGS=${HOGS:-term ignore-term}
BACKGROUNDS=${BACKGROUNDS:-none idle1000 storm}
[[ -x $GPUGUARD ]] || { echo "build gpuguard first: cargo build --release (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)" >&2; exit 1; }
[[ -x $HOG && -x $SAMPLER && -x $STORM ]] || build_tools
[[ " $BACKGROUNDS " != *" permits "* ]] || build_permit_load
trap stop_background EXIT
trap 'exit 130' INT TERM

csv="$out/reaction.csv"
: >"$csv"
for background in $BACKGROUNDS; do
    echo "background: $background" >&2
    start_background "$background"
    for ((run = 1; run <= RUNS; run++)); do
        for hog in $HOGS; do
            for rate in $RATES; do
                for agent in $AGENTS; do
                    echo "run $run/$RUNS ($background): $agent, hog $hog, rate $rate B/s" >&2
                    flock "$LOCK" "$BENCH_DIR/reaction-one.sh" "$agent" "$rate" "$hog" "$csv" "$background" \
                        2>>"$out/reaction.stderr" || echo "  run failed (see $out/reaction.stderr)" >&2
                    tail -n 1 "$csv" >&2
                done
            done
        done
    done
    stop_background
done
python3 "$BENCH_DIR/analyze.py" reaction-table "$csv" | tee "$out/reaction.md"
