"""The seed scenario of issue #12: a model server on a simulated card (fakegpu.py), serving
bursts of concurrent requests. Each request takes a gpuguard permit for its memory (through the
Python client) with a timeout, "works" (sleeps) holding its memory, and releases it. Without
permits (--no-permits) the bursts overflow the card, which is what the seed users saw as CUDA
OOM; with a hand-written semaphore (--semaphore N) they wait for one of N slots, as the seed
users' servers did.

The server holds its memory through one of fakegpu.py's allocators (--allocator): `release`
(cudaFree at the end of each request), `caching` (PyTorch's caching allocator: freed blocks stay
in the process and NVML keeps showing them), `prealloc` (vLLM/SGLang/JAX: a share of the card at
start, requests wait inside the engine). With --workers N it forks N worker processes, each with
its own weights, allocator and gpuguard connection, serving every Nth request of each burst.

Prints one JSON line of results on stdout:
  requests, served, refused, refused_by_reason {reason: n}, refused_without_retry_after,
  retry_after_s {min, max} (null when nothing was refused), errors, error_messages (first 5),
  overflows (CUDA OOMs), max_in_flight (on the card, across workers), max_used_bytes,
  median_latency_s (from a request's arrival to the end of its work, served ones), latencies_s
  (each served one's, sorted), fit (how
  many requests fit beside the weights with a fixed size, else null), expired (permits revoked
  while working), max_waited_s, card_total_bytes, weights_bytes, allocator, workers, permits
  (bool), semaphore, client ("thread"/"async").
Every request is served, refused (backpressure), an overflow, or an error.

Options:
  --state PATH            the fake NVML state file to write (required unless --real-gpu)
  --card-total SIZE       the card's memory (default 16GiB)
  --weights SIZE          the model's weights, resident all along (default 4GiB)
  --context SIZE          the CUDA context each server process holds (default 0)
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
  --semaphore N           a hand-written semaphore of N slots instead of permits
  --allocator release|caching|prealloc  how the server holds GPU memory (default release)
  --prealloc SHARE        the share of the card a `prealloc` engine takes at start (default 0.9)
  --workers N             forked worker processes, each with its own memory (default 1)
  --dispatch round-robin|by-burst  which worker serves a request: every Nth of each burst
                          (default), or whole bursts in turn (burst k to worker k mod N)
  --warm N                serve N requests of --warm-size (default 3GiB) at start, without
                          permits, before the first burst: the cache is warm when the daemon
                          first sees the server ask (as after a restart of the daemon)
  --torch                 the client reports the allocator's cache (`allocator="torch"`). With
                          or without it, a fake `torch` module answering from the allocator is
                          loaded, as torch is in a PyTorch server (the client empties its cache
                          on the daemon's `trim`); with --real-gpu, the real one
  --real-gpu              serve on the real GPU 0 with PyTorch's own caching allocator
                          (realgpu.py; --state, --card-total, --context, --allocator, --others
                          and --prealloc do not apply: the card is what the driver has free)
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
import multiprocessing
import os
import random
import threading
import time
from typing import Any, Dict, List, Optional

from fakegpu import ALLOCATORS, FakeCard, import_gpuguard, install_fake_torch, parse_size_range

# A preallocating engine serves its first request seconds after it took its KV pool, never
# microseconds: vLLM captures CUDA graphs and then starts its API server ("Graph capturing
# finished in 3 secs" in the v0.19.0 Llama-3.1-8B log of tests/fixtures/plan/engines). The fake
# waits a second, so the daemon's readings see the pool before the first request, as they would.
PREALLOC_WARMUP_S = 1.0

gpuguard = import_gpuguard()


class Results:
    """What happened to the requests; thread-safe. `merge` adds another worker's report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.served = self.errors = self.expired = 0
        self.refused: Dict[str, int] = {}
        self.refused_without_retry_after = 0
        self.retry_after_s: List[float] = []
        self.error_messages: List[str] = []
        self.max_waited_s = 0.0
        self.latencies_s: List[float] = []

    def count(self, outcome: str, arrived: float) -> None:
        with self._lock:
            self.requests += 1
            if outcome == "served":
                self.served += 1
                self.latencies_s.append(time.monotonic() - arrived)

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

    def raw(self, card: FakeCard) -> Dict[str, Any]:
        """This process's counts, to merge in the parent (workers) or report."""
        return {
            "requests": self.requests,
            "served": self.served,
            "errors": self.errors,
            "expired": self.expired,
            "refused_by_reason": self.refused,
            "refused_without_retry_after": self.refused_without_retry_after,
            "retry_after_s": self.retry_after_s,
            "error_messages": self.error_messages,
            "max_waited_s": self.max_waited_s,
            "latencies_s": self.latencies_s,
            "card": card.stats(),
        }


def report(parts: List[Dict[str, Any]], args: argparse.Namespace, fit: Optional[int]) -> Dict[str, Any]:
    """One JSON report of every process's counts (one part per worker)."""
    refused: Dict[str, int] = {}
    for part in parts:
        for reason, n in part["refused_by_reason"].items():
            refused[reason] = refused.get(reason, 0) + n
    retry_after = [r for part in parts for r in part["retry_after_s"]]
    latencies = sorted(x for part in parts for x in part["latencies_s"])
    cards = [part["card"] for part in parts]
    return {
        "requests": sum(p["requests"] for p in parts),
        "served": sum(p["served"] for p in parts),
        "refused": sum(refused.values()),
        "refused_by_reason": refused,
        "refused_without_retry_after": sum(p["refused_without_retry_after"] for p in parts),
        "retry_after_s": (
            {"min": min(retry_after), "max": max(retry_after)} if retry_after else None
        ),
        "errors": sum(p["errors"] for p in parts),
        "error_messages": [m for p in parts for m in p["error_messages"]][:5],
        "overflows": sum(c["overflows"] for c in cards),
        # Every worker sees the whole card: the most any of them saw.
        "max_in_flight": max(c["max_in_flight"] for c in cards),
        "max_used_bytes": max(c["max_used_bytes"] for c in cards),
        "median_latency_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
        "latencies_s": [round(x, 3) for x in latencies],
        "fit": fit,
        "expired": sum(p["expired"] for p in parts),
        "max_waited_s": round(max(p["max_waited_s"] for p in parts), 3),
        "card_total_bytes": cards[0]["card_total_bytes"] if args.real_gpu else args.card_total,
        "weights_bytes": args.weights,
        "allocator": "torch-cuda" if args.real_gpu else args.allocator,
        "workers": args.workers,
        "permits": not args.no_permits and not args.semaphore,
        "semaphore": args.semaphore,
        "client": args.client,
        **({"real_gpu": [{k: c.get(k) for k in ("ooms", "cache_reports")} for c in cards]}
           if args.real_gpu else {}),
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
    args: argparse.Namespace,
    card: FakeCard,
    sizes: List[List[int]],
    results: Results,
    start_burst: Any,
    done: Any,
) -> None:
    client = gpuguard.Client(args.socket, allocator="torch" if args.torch else None)
    if args.real_gpu and client._cache_reader is not None:
        client._cache_reader = card.traced(client._cache_reader)
    semaphore = threading.Semaphore(args.semaphore) if args.semaphore else None

    def work(size: int) -> str:
        handle = card.start(size)
        if handle is None:
            return "overflow"
        time.sleep(args.work)
        card.finish(handle)
        return "served"

    def request(size: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        arrived = time.monotonic()
        try:
            if args.no_permits:
                results.count(work(size), arrived)
            elif semaphore is not None:
                with semaphore:
                    results.count(work(size), arrived)
            else:
                with client.permit(**permit_options(args, size)) as permit:
                    outcome = work(size)
                results.permit_used(permit)
                results.count(outcome, arrived)
        except gpuguard.PermitRefused as refused:
            results.refusal(refused)
        except Exception as err:  # reported in the results, not lost in a thread
            results.error(err)

    try:
        for number, burst in enumerate(sizes):
            start_burst(number)
            barrier = threading.Barrier(max(len(burst), 1))
            threads = [threading.Thread(target=request, args=(size, barrier)) for size in burst]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        done()
    finally:
        client.close()


async def run_tasks(
    args: argparse.Namespace,
    card: FakeCard,
    sizes: List[List[int]],
    results: Results,
    start_burst: Any,
    done: Any,
) -> None:
    client = gpuguard.AsyncClient(args.socket, allocator="torch" if args.torch else None)
    semaphore = asyncio.Semaphore(args.semaphore) if args.semaphore else None

    async def work(size: int) -> str:
        handle = card.start(size)
        if handle is None:
            return "overflow"
        try:
            await asyncio.sleep(args.work)
        finally:
            card.finish(handle)
        return "served"

    async def request(size: int) -> None:
        arrived = time.monotonic()
        try:
            if args.no_permits:
                results.count(await work(size), arrived)
            elif semaphore is not None:
                async with semaphore:
                    results.count(await work(size), arrived)
            else:
                async with client.permit(**permit_options(args, size)) as permit:
                    outcome = await work(size)
                results.permit_used(permit)
                results.count(outcome, arrived)
        except gpuguard.PermitRefused as refused:
            results.refusal(refused)
        except Exception as err:
            results.error(err)

    try:
        for number, burst in enumerate(sizes):
            await asyncio.get_running_loop().run_in_executor(None, start_burst, number)
            await asyncio.gather(*(request(size) for size in burst))
        await asyncio.get_running_loop().run_in_executor(None, done)
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
    parser.add_argument("--state", default=None)
    parser.add_argument("--card-total", type=parse_size, default=parse_size("16GiB"))
    parser.add_argument("--weights", type=parse_size, default=parse_size("4GiB"))
    parser.add_argument("--context", type=parse_size, default=0)
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
    parser.add_argument("--semaphore", type=int, default=0)
    parser.add_argument("--allocator", choices=ALLOCATORS, default="release")
    parser.add_argument("--prealloc", type=float, default=0.9)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--dispatch", choices=["round-robin", "by-burst"], default="round-robin")
    parser.add_argument("--warm", type=int, default=0)
    parser.add_argument("--warm-size", type=parse_size, default=parse_size("3GiB"))
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--real-gpu", action="store_true")
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
    if args.state is None and not args.real_gpu:
        parser.error("--state is required (the fake NVML state file) unless --real-gpu")
    if args.burst < 1 or args.bursts < 1 or args.workers < 1:
        parser.error("--burst, --bursts and --workers must be at least 1")
    if not 0 < args.prealloc <= 1:
        parser.error("--prealloc is a share of the card, above 0 and at most 1")
    return args


def serve(
    args: argparse.Namespace,
    sizes: List[List[int]],
    start_burst: Any,
    loaded: Any = None,
    done: Any = None,
) -> Dict[str, Any]:
    """One server process: loads its weights on the card, serves its share of every burst,
    and returns its counts. `loaded` is called once the weights are on the card, `done` after
    the last burst, its connection to the daemon still open, before it exits (and its memory
    goes back to the driver)."""
    card: Any
    if args.real_gpu:
        from realgpu import RealCard

        card = RealCard(args.weights)
    else:
        card = FakeCard(
            args.state,
            args.card_total,
            args.weights,
            others_path=args.others,
            allocator=args.allocator,
            prealloc=args.prealloc,
            context_bytes=args.context,
        )
        install_fake_torch(card)
        if args.allocator == "prealloc":
            time.sleep(PREALLOC_WARMUP_S)
    if args.warm:
        # Requests served before the first burst (and before the daemon's permits): the
        # allocator's cache is already warm when the daemon first sees the process ask.
        handles = [card.start(args.warm_size) for _ in range(args.warm)]
        for handle in handles:
            if handle is not None:
                card.finish(handle)
        del handles, handle  # a real tensor lives while anything refers to it
    if loaded:
        loaded()
    results = Results()
    try:
        done = done or (lambda: None)
        if args.client == "thread":
            run_threads(args, card, sizes, results, start_burst, done)
        else:
            asyncio.run(run_tasks(args, card, sizes, results, start_burst, done))
        return results.raw(card)
    finally:
        card.close()


def share(args: argparse.Namespace, sizes: List[List[int]], worker: int) -> List[List[int]]:
    """Worker `worker`'s requests of each burst (an empty burst: it serves none of that one)."""
    if args.dispatch == "by-burst":
        return [b if k % args.workers == worker else [] for k, b in enumerate(sizes)]
    return [b[worker :: args.workers] for b in sizes]


def worker_main(
    args: argparse.Namespace,
    sizes: List[List[int]],
    barrier: Any,
    out: Any,
) -> None:
    """A forked worker: its own CUDA context, weights, allocator cache and gpuguard connection."""

    def start_burst(number: int) -> None:
        if number and args.pause:
            time.sleep(args.pause)
        barrier.wait()

    try:
        # Every worker lives until the last burst is over, as a server's workers do.
        out.put(serve(args, sizes, start_burst, loaded=barrier.wait, done=barrier.wait))
    except BaseException as err:
        out.put({"failed": f"{type(err).__name__}: {err}"})
        raise


def write_ready(args: argparse.Namespace) -> None:
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as ready:
            ready.write(f"{os.getpid()}\n")
        os.replace(args.ready_file + ".tmp", args.ready_file)
    while args.go_file and not os.path.exists(args.go_file):
        time.sleep(0.01)


def main() -> None:
    args = parse_args()
    sizes = draw_sizes(args)
    if args.workers == 1:

        def start_burst(number: int) -> None:
            if number and args.pause:
                time.sleep(args.pause)

        parts = [serve(args, sizes, start_burst, loaded=lambda: write_ready(args))]
    else:
        # Worker i serves requests i, i + N, ... of every burst, as a preforked server's
        # workers share the connections (or, by burst, every Nth burst); all start each burst
        # together.
        fork = multiprocessing.get_context("fork")
        barrier = fork.Barrier(args.workers + 1)
        out = fork.Queue()
        workers = [
            fork.Process(
                target=worker_main,
                args=(args, share(args, sizes, i), barrier, out),
            )
            for i in range(args.workers)
        ]
        for worker in workers:
            worker.start()
        barrier.wait()  # every worker's weights are on the card
        write_ready(args)
        for number in range(len(sizes)):
            if number and args.pause:
                time.sleep(args.pause)
            barrier.wait()
        barrier.wait()  # the last burst is over
        parts = [out.get() for _ in workers]
        for worker in workers:
            worker.join()
        failed = [p["failed"] for p in parts if "failed" in p]
        if failed:
            raise SystemExit(f"seed_server.py: a worker failed: {failed}")
    low, high = parse_size_range(args.request_size)
    fixed = low == high and not args.real_gpu
    fit = (args.card_total - args.weights - args.context) // low if fixed else None
    print(json.dumps(report(parts, args, fit)), flush=True)


if __name__ == "__main__":
    main()
