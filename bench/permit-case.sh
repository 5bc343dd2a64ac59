#!/usr/bin/env bash
# permit-case.sh: one permit scenario (tests/permits/seed_server.py) on a fake card of CARD GiB
# against the release binary, for chasing one case: prints the scenario's JSON; the daemon's log
# (GPUGUARD_LOG=gpuguard=debug gives a line per grant and wait with the holder's books) stays in
# WORK (default: a new temporary folder, named on stderr). FAKEGPU_TRACE=PATH adds the fake
# card's allocations and OOMs with their times (tests/permits/fakegpu.py).
#
#   bench/permit-case.sh CARD_GIB SEED_SERVER_ARGS...
#   e.g. WORK=/tmp/c GPUGUARD_LOG=gpuguard=debug bench/permit-case.sh 16 --allocator caching --workers 2 --torch
#
# Needs bench/allocators.sh's setup once (target/pyenv with the client, the fake NVML, a release build).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_DIR"
venv=target/pyenv
work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
daemon=
trap 'kill_pids $daemon' EXIT
card=$1; shift
printf 'device 0 uuid=GPU-bench total=%d used=0\n' $((card * GIB)) >"$work/nvml"
rm -rf "$work/nvml.procs"
seed_daemon_config "$work" "nvml_library = \"$BUILD_DIR/libnvidia-ml.so.1\"
sample_timeout = \"500ms\"" ""
rm -f "$work/sock"
GPUGUARD_LOG=${GPUGUARD_LOG:-info} FAKE_NVML_STATE="$work/nvml" "$GPUGUARD" daemon --config "$work/config.toml" >"$work/log" 2>&1 &
daemon=$!
until [ -S "$work/sock" ]; do sleep 0.05; done
sleep 0.5
$venv/bin/python tests/permits/seed_server.py --state "$work/nvml" --socket "$work/sock" \
    --card-total "${card}GiB" --context 512MiB --pause 1 --permit-timeout 5 "$@"
echo "work: $work" >&2
