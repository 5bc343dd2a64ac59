#!/usr/bin/env bash
# workspace.sh: what a restructuring cost, beside the commit it started from, in one run.
#
#   bench/workspace.sh BASE_REV [RESULTS_DIR]     (env: IDLE_SECONDS=60)
#
# For BASE_REV and HEAD (each checked out in a scratch worktree, each with a target dir of its
# own, built one after the other on the same machine):
#   production lines   scripts/code-shape (HEAD's) over src/ and every crates/*/src: code
#                      outside tests, `#[cfg(test)]` blocks and comments-only lines counted alike
#   cold build         `cargo build --release --locked` from an empty target dir (wall time)
#   binary             the size of target/release/gpuguard, stripped copy too
#   cargo test         `cargo test --workspace --locked --no-run` from an empty debug target
#                      (wall), then the in-process tests' run (wall; `--workspace` is the whole
#                      package on a commit without a workspace)
#   idle daemon        both release binaries side by side in observe mode on the same host for
#                      IDLE_SECONDS after a 5 s warm-up (own state dir and socket each, no
#                      metrics): CPU = utime+stime over the window (% of one core), peak RSS =
#                      VmHWM at the end
# Output: RESULTS_DIR/workspace.md (also on stdout). Uses the crates already downloaded
# (--offline after one `cargo fetch`).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
base_rev=${1:?usage: bench/workspace.sh BASE_REV [RESULTS_DIR]}
out=${2:-$BENCH_DIR/results/$(date +%Y%m%d-%H%M%S)}
idle=${IDLE_SECONDS:-60}
mkdir -p "$out"
work=$(mktemp -d /var/tmp/gg-bench-workspace.XXXXXX)
daemons=()
cleanup() {
    kill_pids "${daemons[@]}"
    git -C "$REPO_DIR" worktree remove --force "$work/base" 2>/dev/null || true
    git -C "$REPO_DIR" worktree remove --force "$work/head" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

git -C "$REPO_DIR" worktree add -q --detach "$work/base" "$base_rev"
git -C "$REPO_DIR" worktree add -q --detach "$work/head" HEAD
head_rev=$(git -C "$work/head" rev-parse --short HEAD)
base_rev=$(git -C "$work/base" rev-parse --short HEAD)
(cd "$work/head" && cargo fetch --locked -q)

lines() {
    local tree=$1 total=0 dir n
    for dir in "$tree/src" "$tree"/crates/*/src; do
        [[ -d $dir ]] || continue
        n=$("$REPO_DIR/scripts/code-shape" "$dir" | awk '$1 == "total" { print $2; exit }')
        total=$((total + n))
    done
    echo "$total"
}

timed() { # timed LOG CMD...: wall seconds of CMD, its output in LOG
    local log=$1 t0
    shift
    t0=$(date +%s.%N)
    "$@" >"$log" 2>&1 || { tail -n 20 "$log" >&2; return 1; }
    echo "$(date +%s.%N) - $t0" | bc -l | xargs printf '%.0f'
}

declare -A r
for side in base head; do
    tree=$work/$side
    r[$side.lines]=$(lines "$tree")
    export CARGO_TARGET_DIR=$work/target-$side
    r[$side.build]=$(cd "$tree" && timed "$work/$side-build.log" cargo build --release --locked --offline)
    bin=$CARGO_TARGET_DIR/release/gpuguard
    r[$side.size]=$(stat -c %s "$bin")
    strip -o "$work/$side-stripped" "$bin"
    r[$side.stripped]=$(stat -c %s "$work/$side-stripped")
    r[$side.test_build]=$(cd "$tree" && timed "$work/$side-test-build.log" \
        cargo test --workspace --locked --offline --no-run)
    r[$side.test_run]=$(cd "$tree" && timed "$work/$side-test-run.log" \
        cargo test --workspace --locked --offline)
    r[$side.tests]=$(awk '/^test result:/ { p += $4 } END { print p }' "$work/$side-test-run.log")
done
unset CARGO_TARGET_DIR

# The idle daemons, side by side.
hz=$(getconf CLK_TCK)
for side in base head; do
    mkdir -p "$work/$side-state"
    cat >"$work/$side.toml" <<EOF
[daemon]
mode = "observe"
state_dir = "$work/$side-state"
[ram]
min_available = "5%"
[launch]
socket = "$work/$side.sock"
[metrics]
listen = ""
EOF
    "$work/target-$side/release/gpuguard" daemon --config "$work/$side.toml" 2>"$work/$side-daemon.log" &
    daemons+=($!)
done
for side in base head; do
    wait_for_socket "$work/$side.sock" 30 || { cat "$work/$side-daemon.log" >&2; exit 1; }
done
sleep 5
t0=() t1=()
for i in 0 1; do t0[i]=$(cpu_ticks "${daemons[i]}"); done
sleep "$idle"
for i in 0 1; do
    t1[i]=$(cpu_ticks "${daemons[i]}")
    side=$([[ $i == 0 ]] && echo base || echo head)
    r[$side.cpu]=$(echo "(${t1[i]} - ${t0[i]}) * 100 / $hz / $idle" | bc -l | xargs printf '%.3f')
    r[$side.rss]=$(echo "$(vm_hwm_kib "${daemons[i]}") / 1024" | bc -l | xargs printf '%.1f')
done
kill_pids "${daemons[@]}"
daemons=()

mib() { echo "$1 / 1048576" | bc -l | xargs printf '%.2f'; }
{
    echo "# The workspace split: $base_rev (before) and $head_rev (after), one run"
    echo
    echo "$(date -u +%Y-%m-%d), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)."
    echo
    echo "| | before ($base_rev) | after ($head_rev) |"
    echo "|---|---|---|"
    echo "| production lines (scripts/code-shape, src/ + crates/*/src) | ${r[base.lines]} | ${r[head.lines]} |"
    echo "| cold \`cargo build --release\` | ${r[base.build]} s | ${r[head.build]} s |"
    echo "| binary (stripped) | $(mib "${r[base.size]}") MiB ($(mib "${r[base.stripped]}")) | $(mib "${r[head.size]}") MiB ($(mib "${r[head.stripped]}")) |"
    echo "| cold \`cargo test --workspace --no-run\` | ${r[base.test_build]} s | ${r[head.test_build]} s |"
    echo "| \`cargo test --workspace\` once built (tests passed) | ${r[base.test_run]} s (${r[base.tests]}) | ${r[head.test_run]} s (${r[head.tests]}) |"
    echo "| idle daemon CPU over ${idle} s, side by side | ${r[base.cpu]} % | ${r[head.cpu]} % |"
    echo "| idle daemon peak RSS (VmHWM) | ${r[base.rss]} MiB | ${r[head.rss]} MiB |"
} | tee "$out/workspace.md"
