#!/usr/bin/env bash
# run-all.sh: every gpuguard benchmark, gpuguard side by side with earlyoom, in one go (~15 min).
#
#   sudo apt-get install -y earlyoom gcc python3 bc   # earlyoom: run here in the foreground only
#   bench/run-all.sh [RESULTS_DIR]
#
# Needs root (to signal, and for earlyoom) and a host where losing ~3 GiB of MemAvailable for a
# few seconds is fine. Builds gpuguard in release mode (CARGO_TARGET_DIR, default
# /tmp/target-bench) and the C tools, then runs reaction.sh, overhead.sh, ticks.sh, the
# policy micro-benchmark (benches/policy.rs) and the permits against each allocator
# (allocators.sh). Results (tables in *.md, raw CSV/logs) go to
# RESULTS_DIR, default bench/results/<date>. Env knobs: RUNS (reaction runs per case, 5),
# SECONDS_PER_CASE (overhead window, 60), TICK_SECONDS (30).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
out=${1:-$BENCH_DIR/results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
(cd "$REPO_DIR" && cargo build --release --quiet) || exit 1
build_tools || exit 1
{
    echo "## machine"
    echo '```'
    echo "\$ nproc"; nproc
    echo "\$ free -g"; free -g
    echo "\$ uname -r"; uname -r
    grep -m1 "model name" /proc/cpuinfo
    "$EARLYOOM" -v 2>&1 | head -1
    "$GPUGUARD" --version 2>/dev/null || true
    echo '```'
} | tee "$out/machine.md"
status=0
"$BENCH_DIR/reaction.sh" "$out" || status=1
"$BENCH_DIR/overhead.sh" "$out" || status=1
"$BENCH_DIR/ticks.sh" "$out" || status=1
(cd "$REPO_DIR" && cargo bench --quiet --bench policy) | tee "$out/policy.md" || status=1
"$BENCH_DIR/allocators.sh" | tee "$out/allocators.md" || status=1
echo "results in $out" >&2
exit $status
