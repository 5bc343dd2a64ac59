"""Permits from Python beside the in-process semaphores they replace (issue #12's benchmark).

Each mode runs `--clients` concurrent workers (asyncio tasks or threads) for `--seconds`, each
doing acquire + release back to back, and prints one Markdown table row: permits/s and the
latency of one acquire + release (p50, p99 in microseconds).

  asyncio-semaphore    asyncio.Semaphore(clients) in one process: the floor of what is possible
  threading-semaphore  threading.Semaphore(clients) with threads
  gpuguard-async       gpuguard.AsyncClient, tasks sharing one connection to the daemon
  gpuguard-thread      gpuguard.Client, threads sharing one connection

  python bench/permits_python.py MODE [--clients 64] [--seconds 5] [--socket PATH] [--gpu-bytes N]

The gpuguard modes need a running daemon (bench/permits.sh starts one) and the client
(`pip install ./clients/python`).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import List


def quantile(sorted_values: List[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[round((len(sorted_values) - 1) * q)]


def row(mode: str, clients: int, latencies: List[float], seconds: float) -> str:
    latencies.sort()
    return "| {} ({} clients) | {:.0f} | {:.0f} | {:.0f} |".format(
        mode,
        clients,
        len(latencies) / seconds,
        quantile(latencies, 0.5) * 1e6,
        quantile(latencies, 0.99) * 1e6,
    )


async def run_async(args: argparse.Namespace) -> str:
    stop = time.monotonic() + args.seconds
    latencies: List[float] = []
    if args.mode == "asyncio-semaphore":
        semaphore = asyncio.Semaphore(args.clients)

        async def worker() -> None:
            while time.monotonic() < stop:
                began = time.perf_counter()
                async with semaphore:
                    pass
                latencies.append(time.perf_counter() - began)
                await asyncio.sleep(0)

        await asyncio.gather(*(worker() for _ in range(args.clients)))
        return row(args.mode, args.clients, latencies, args.seconds)

    import gpuguard

    async with gpuguard.AsyncClient(args.socket) as client:
        await client.release(await client.acquire(gpu_bytes=args.gpu_bytes))  # warm

        async def worker() -> None:
            while time.monotonic() < stop:
                began = time.perf_counter()
                permit = await client.acquire(gpu_bytes=args.gpu_bytes, timeout=5)
                await client.release(permit)
                latencies.append(time.perf_counter() - began)

        await asyncio.gather(*(worker() for _ in range(args.clients)))
    return row(args.mode, args.clients, latencies, args.seconds)


def run_threads(args: argparse.Namespace) -> str:
    stop = time.monotonic() + args.seconds
    latencies: List[float] = []
    lock = threading.Lock()
    if args.mode == "threading-semaphore":
        semaphore = threading.Semaphore(args.clients)

        def work() -> None:
            semaphore.acquire()
            semaphore.release()

    else:
        import gpuguard

        client = gpuguard.Client(args.socket)
        client.release(client.acquire(gpu_bytes=args.gpu_bytes))  # warm

        def work() -> None:
            client.release(client.acquire(gpu_bytes=args.gpu_bytes, timeout=5))

    def worker() -> None:
        mine = []
        while time.monotonic() < stop:
            began = time.perf_counter()
            work()
            mine.append(time.perf_counter() - began)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return row(args.mode, args.clients, latencies, args.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "mode",
        choices=["asyncio-semaphore", "threading-semaphore", "gpuguard-async", "gpuguard-thread"],
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--socket", default=None)
    parser.add_argument("--gpu-bytes", type=int, default=64 << 20)
    args = parser.parse_args()
    if args.mode in ("asyncio-semaphore", "gpuguard-async"):
        print(asyncio.run(run_async(args)), flush=True)
    else:
        print(run_threads(args), flush=True)


if __name__ == "__main__":
    main()
