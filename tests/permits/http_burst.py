"""Fires bursts of concurrent HTTP requests at the FastAPI example run by fastapi_server.py (or
any server with the same POST /generate) and prints one JSON line of results:
  requests, ok (200), unavailable (503), unavailable_with_retry_after (503s carrying a valid
  Retry-After), retry_after_s {min, max} (null when no 503), other_status {code: n}, errors
  (no HTTP answer), error_messages (first 5), server (the launcher's GET /_stats: overflows,
  max_in_flight, ...; null if it has none).

Options:
  --port-file PATH   read the server's port from this file, waiting until it exists
  --url URL          or the server's base URL (default http://127.0.0.1:PORT)
  --burst N          concurrent requests per burst (default 10)
  --bursts N         bursts, one after the other (default 3)
  --pause SECONDS    pause between bursts (default 0)
  --http-timeout SECONDS  per request (default 120)

Standard library only (threads and http.client); talks to 127.0.0.1 in the tests.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
from typing import Any, Dict, List, Optional
from urllib.parse import urlsplit


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: Dict[int, int] = {}
        self.retry_after: List[float] = []
        self.unavailable_with_retry_after = 0
        self.errors: List[str] = []

    def answer(self, status: int, retry_after: Optional[str]) -> None:
        with self.lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1
            if status == 503 and retry_after is not None and retry_after.strip().isdigit():
                self.unavailable_with_retry_after += 1
                self.retry_after.append(float(retry_after))

    def error(self, err: BaseException) -> None:
        with self.lock:
            self.errors.append(f"{type(err).__name__}: {err}")


def request(
    host: str, port: int, timeout: float, number: int, tally: Tally, barrier: threading.Barrier
) -> None:
    barrier.wait()
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        body = json.dumps({"prompt": f"request {number}"})
        connection.request(
            "POST", "/generate", body=body, headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        response.read()
        tally.answer(response.status, response.getheader("Retry-After"))
    except (OSError, http.client.HTTPException) as err:
        tally.error(err)
    finally:
        connection.close()


def server_stats(host: str, port: int, timeout: float) -> Optional[Dict[str, Any]]:
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/_stats")
        response = connection.getresponse()
        body = response.read()
        return json.loads(body) if response.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Bursts of HTTP requests (see the top of this file)."
    )
    parser.add_argument("--port-file", default=None)
    parser.add_argument("--url", default=None)
    parser.add_argument("--burst", type=int, default=10)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--http-timeout", type=float, default=120.0)
    args = parser.parse_args()
    if args.url:
        parts = urlsplit(args.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
    elif args.port_file:
        while not os.path.exists(args.port_file):
            time.sleep(0.01)
        with open(args.port_file) as port_file:
            host, port = "127.0.0.1", int(port_file.read().strip())
    else:
        parser.error("give --port-file or --url")

    tally = Tally()
    number = 0
    for burst in range(args.bursts):
        if burst and args.pause:
            time.sleep(args.pause)
        barrier = threading.Barrier(args.burst)
        threads = []
        for _ in range(args.burst):
            number += 1
            threads.append(
                threading.Thread(
                    target=request, args=(host, port, args.http_timeout, number, tally, barrier)
                )
            )
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    statuses = tally.statuses
    print(
        json.dumps(
            {
                "requests": number,
                "ok": statuses.get(200, 0),
                "unavailable": statuses.get(503, 0),
                "unavailable_with_retry_after": tally.unavailable_with_retry_after,
                "retry_after_s": (
                    {"min": min(tally.retry_after), "max": max(tally.retry_after)}
                    if tally.retry_after
                    else None
                ),
                "other_status": {
                    str(code): n for code, n in statuses.items() if code not in (200, 503)
                },
                "errors": len(tally.errors),
                "error_messages": tally.errors[:5],
                "server": server_stats(host, port, args.http_timeout),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
