#!/usr/bin/env bash
# permits.sh: acquire + release over the daemon's socket (issue #12), in one run: the Rust load
# generator (1 and 64 clients, back to back, open loop at PERMIT_RATES permits/s, and 64 paced
# threads) against gpuguard and, with the same generator, against bench/permit_echo.c, a no-op
# server that answers at once (the floor any socket daemon stands on, on this machine); then
# Python's asyncio and threading clients beside asyncio.Semaphore / threading.Semaphore in one
# process (the floor of what is possible without a socket). Results as Markdown tables on stdout
# (BENCHMARKS.md keeps them). ROUNDS alternates the two servers that many times.
#
#   bench/permits.sh       PERMIT_SECONDS=10, PERMIT_RATES="20000 10000 5000 2000 1000", ROUNDS=2
#
# Needs python3 with venv (the client is installed into target/pyenv, as scripts/test does) and gcc.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_DIR"
venv=target/pyenv
if [ ! -x $venv/bin/python ]; then
    python3 -m venv $venv
fi
$venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall ./clients/python
build_permit_echo
cargo bench --quiet --bench permits --no-run
export PERMIT_SECONDS=${PERMIT_SECONDS:-10}
export PERMIT_RATES=${PERMIT_RATES:-20000 10000 5000 2000 1000}
echo "## machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(uname -r)"
for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
    echo "### round $round: gpuguard"
    if ((round == 1)); then
        PERMIT_PYTHON=$PWD/$venv/bin/python cargo bench --quiet --bench permits
    else
        cargo bench --quiet --bench permits | grep '^|'
    fi
    echo "### round $round: the no-op server (bench/permit_echo.c)"
    PERMIT_SERVER=$PERMIT_ECHO cargo bench --quiet --bench permits | grep '^|'
done
