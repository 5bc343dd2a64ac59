"""The seed scenario of issue #12: a "model server" whose GPU memory is its weights plus the
working memory of each request in flight, serving bursts of concurrent requests. Each request
takes a gpuguard permit for its memory (through the Python client) with a timeout, "works"
(sleeps) while holding it, and releases it. Without permits (--no-permits) the bursts overflow
the card, which is what the seed users saw as CUDA OOM.

The card is device 0 of a fake NVML state file (tests/fake_nvml/README.md), rewritten atomically
on every change: `device 0 total=CARD used=WEIGHTS+IN_FLIGHT(+others)` and `process 0 PID
WEIGHTS+IN_FLIGHT` for this process, so the daemon sees the memory and whose it is. A request
whose memory does not fit on the card is an overflow (a simulated CUDA OOM): it fails, and its
memory is not taken.

Prints one JSON line of results on stdout:
  requests, served, refused, refused_by_reason {reason: n}, refused_without_retry_after,
  retry_after_s {min, max} (null when nothing was refused), errors, error_messages (first 5),
  overflows, max_in_flight, max_used_bytes, fit (how many requests fit beside the weights
  with a fixed size, else null), expired (permits revoked while working), max_waited_s,
  card_total_bytes, weights_bytes, permits (bool), client ("thread"/"async").
Every request is served, refused (backpressure), an overflow, or an error.

Options:
  --state PATH            the fake NVML state file to write (required)
  --card-total SIZE       the card's memory (default 16GiB)
  --weights SIZE          the model's weights, resident all along (default 4GiB)
  --request-size SIZE     memory per request: a size, or a range LOW-HIGH drawn uniformly per
                          request in MiB steps (e.g. 1GiB-4GiB) (default 3GiB)
  --seed N                seed for the drawn sizes (default 0)
  --burst N               concurrent requests per burst (default 10)
  --bursts N              bursts, one after the other (default 3)
  --pause SECONDS         pause between bursts (default 0)
  --work SECONDS          how long a request works while holding its memory (default 0.2)
  --permit-timeout SECONDS  how long a request waits for a permit (default 2)
  --ttl SECONDS           the permit's TTL (default: the daemon's)
  --model NAME            the permits' model (default: the daemon's choice from the process)
  --permit-size exact|none|SIZE  what a permit asks for: the request's real size (default),
                          nothing (the daemon's learned size for the model), or a fixed size
  --no-permits            serve without permits (shows the overflow)
  --client thread|async   threads with gpuguard.Client, or asyncio tasks with AsyncClient
  --socket PATH           the daemon's socket (default $GPUGUARD_SOCKET, else the system one)
  --others PATH           other processes on the card (see fakegpu.py)
  --ready-file PATH       created (holding the pid) once the weights are in the state file
  --go-file PATH          wait until this file exists before the first burst

By hand, against the fake daemon (card 16 GiB - 4 GiB of weights = 12 GiB for permits):
  python clients/python/tests/fake_daemon.py --socket /tmp/g.sock --gpu-capacity 12GiB &
  python tests/permits/seed_server.py --state /tmp/nvml-state --socket /tmp/g.sock
  python tests/permits/seed_server.py --state /tmp/nvml-state --no-permits
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from typing import Any, Dict, List, Optional

from fakegpu import FakeCard, import_gpuguard, parse_size_range

gpuguard = import_gpuguard()


class Results:
    """What happened to the requests; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.served = self.errors = self.expired = 0
        self.refused: Dict[str, int] = {}
        self.refused_without_retry_after = 0
        self.retry_after_s: List[float] = []
        self.error_messages: List[str] = []
        self.max_waited_s = 0.0

    def count(self, outcome: str) -> None:
        with self._lock:
            self.requests += 1
            if outcome == "served":
                self.served += 1

    def permit_used(self, permit: Any) -> None:
        with self._lock:
            self.max_waited_s = max(self.max_waited_s, permit.waited)
            self.expired += permit.expired

    def refusal(self, refused: Any) -> None:
        with self._lock:
            self.requests += 1
            self.refused[refused.reason] = self.refused.get(refused.reason, 0) + 1
            if refused.retry_after is None:
                self.refused_without_retry_after += 1
            else:
                self.retry_after_s.append(refused.retry_after)

    def error(self, err: BaseException) -> None:
        with self._lock:
            self.requests += 1
            self.errors += 1
            if len(self.error_messages) < 5:
                self.error_messages.append(f"{type(err).__name__}: {err}")

    def report(
        self, card: FakeCard, args: argparse.Namespace, fit: Optional[int]
    ) -> Dict[str, Any]:
        stats = card.stats()
        return {
            "requests": self.requests,
            "served": self.served,
            "refused": sum(self.refused.values()),
            "refused_by_reason": self.refused,
            "refused_without_retry_after": self.refused_without_retry_after,
            "retry_after_s": (
                {"min": min(self.retry_after_s), "max": max(self.retry_after_s)}
                if self.retry_after_s
                else None
            ),
            "errors": self.errors,
            "error_messages": self.error_messages,
            "overflows": stats["overflows"],
            "max_in_flight": stats["max_in_flight"],
            "max_used_bytes": stats["max_used_bytes"],
            "fit": fit,
            "expired": self.expired,
            "max_waited_s": round(self.max_waited_s, 3),
            "card_total_bytes": stats["card_total_bytes"],
            "weights_bytes": stats["weights_bytes"],
            "permits": not args.no_permits,
            "client": args.client,
        }


def permit_size(args: argparse.Namespace, size: int) -> Optional[int]:
    if args.permit_size == "exact":
        return size
    if args.permit_size == "none":
        return None
    return gpuguard.parse_size(args.permit_size, "--permit-size")


def permit_options(args: argparse.Namespace, size: int) -> Dict[str, Any]:
    return dict(
        gpu_bytes=permit_size(args, size),
        model=args.model,
        timeout=args.permit_timeout,
        ttl=args.ttl,
    )


def run_threads(
    args: argparse.Namespace, card: FakeCard, sizes: List[List[int]], results: Results
) -> None:
    client = gpuguard.Client(args.socket)

    def work(size: int) -> str:
        if not card.start(size):
            return "overflow"
        time.sleep(args.work)
        card.finish(size)
        return "served"

    def request(size: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            if args.no_permits:
                results.count(work(size))
                return
            with client.permit(**permit_options(args, size)) as permit:
                outcome = work(size)
            results.permit_used(permit)
            results.count(outcome)
        except gpuguard.PermitRefused as refused:
            results.refusal(refused)
        except Exception as err:  # reported in the results, not lost in a thread
            results.error(err)

    try:
        for number, burst in enumerate(sizes):
            if number and args.pause:
                time.sleep(args.pause)
            barrier = threading.Barrier(len(burst))
            threads = [threading.Thread(target=request, args=(size, barrier)) for size in burst]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        client.close()


async def run_tasks(
    args: argparse.Namespace, card: FakeCard, sizes: List[List[int]], results: Results
) -> None:
    client = gpuguard.AsyncClient(args.socket)

    async def work(size: int) -> str:
        if not card.start(size):
            return "overflow"
        try:
            await asyncio.sleep(args.work)
        finally:
            card.finish(size)
        return "served"

    async def request(size: int) -> None:
        try:
            if args.no_permits:
                results.count(await work(size))
                return
            async with client.permit(**permit_options(args, size)) as permit:
                outcome = await work(size)
            results.permit_used(permit)
            results.count(outcome)
        except gpuguard.PermitRefused as refused:
            results.refusal(refused)
        except Exception as err:
            results.error(err)

    try:
        for number, burst in enumerate(sizes):
            if number and args.pause:
                await asyncio.sleep(args.pause)
            await asyncio.gather(*(request(size) for size in burst))
    finally:
        await client.aclose()


def draw_sizes(args: argparse.Namespace) -> List[List[int]]:
    low, high = parse_size_range(args.request_size)
    rng = random.Random(args.seed)
    mib = 1 << 20
    if low == high:
        return [[low] * args.burst for _ in range(args.bursts)]
    return [
        [rng.randint(low // mib, high // mib) * mib for _ in range(args.burst)]
        for _ in range(args.bursts)
    ]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parse_size = gpuguard.parse_size
    parser = argparse.ArgumentParser(
        description="The seed scenario's model server (see the top of this file)."
    )
    parser.add_argument("--state", required=True)
    parser.add_argument("--card-total", type=parse_size, default=parse_size("16GiB"))
    parser.add_argument("--weights", type=parse_size, default=parse_size("4GiB"))
    parser.add_argument("--request-size", default="3GiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--burst", type=int, default=10)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--work", type=float, default=0.2)
    parser.add_argument("--permit-timeout", type=float, default=2.0)
    parser.add_argument("--ttl", type=float, default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--permit-size", default="exact")
    parser.add_argument("--no-permits", action="store_true")
    parser.add_argument("--client", choices=["thread", "async"], default="thread")
    parser.add_argument("--socket", default=None)
    parser.add_argument("--others", default=None)
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--go-file", default=None)
    args = parser.parse_args(argv)
    try:
        parse_size_range(args.request_size)
        if args.permit_size not in ("exact", "none"):
            parse_size(args.permit_size, "--permit-size")
    except (ValueError, TypeError) as err:
        parser.error(str(err))
    if args.burst < 1 or args.bursts < 1:
        parser.error("--burst and --bursts must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    sizes = draw_sizes(args)
    card = FakeCard(args.state, args.card_total, args.weights, others_path=args.others)
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as ready:
            ready.write(f"{os.getpid()}\n")
        os.replace(args.ready_file + ".tmp", args.ready_file)
    while args.go_file and not os.path.exists(args.go_file):
        time.sleep(0.01)
    results = Results()
    if args.client == "thread":
        run_threads(args, card, sizes, results)
    else:
        asyncio.run(run_tasks(args, card, sizes, results))
    low, high = parse_size_range(args.request_size)
    fit = (args.card_total - args.weights) // low if low == high else None
    print(json.dumps(results.report(card, args, fit)), flush=True)


if __name__ == "__main__":
    main()
