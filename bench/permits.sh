#!/usr/bin/env bash
# permits.sh: acquire + release over the daemon's socket (issue #12), in one run: the Rust load
# generator (1 and 64 clients, back to back and paced to 20 000/s), then Python's asyncio and
# threading clients beside asyncio.Semaphore / threading.Semaphore in one process (the floor of
# what is possible). Results as Markdown tables on stdout (BENCHMARKS.md keeps them).
#
#   bench/permits.sh            PERMIT_SECONDS=10 by default
#
# Needs python3 with venv (the client is installed into target/pyenv, as scripts/test does).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv
if [ ! -x $venv/bin/python ]; then
    python3 -m venv $venv
fi
$venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall ./clients/python
export PERMIT_PYTHON=$PWD/$venv/bin/python
export PERMIT_SECONDS=${PERMIT_SECONDS:-10}
echo "## machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(uname -r)"
cargo bench --quiet --bench permits
