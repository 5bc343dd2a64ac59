"""A fake gpuguard daemon for the client's tests and for trying the permit scenarios by hand: the
permit half of docs/protocol.md on a unix socket (acquire, release_permit, cancel, expired,
status, idle close), granting by bytes against a fixed GPU and RAM capacity, first come first
served, with timeouts, TTLs and knobs to script races. It is not the real admission (no NVML,
no floors, no models): the real daemon's behaviour is tested by the Rust integration tests.

By hand:
    python fake_daemon.py --socket /tmp/gpuguard.sock --gpu-capacity 12GiB
then point GPUGUARD_SOCKET (or --socket) of a client or of tests/permits/*.py at it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

GIB = 1 << 30
MAX_LINE = 64 << 10


class _Waiter:
    def __init__(
        self,
        conn: "_Conn",
        request_id: int,
        gpu_bytes: int,
        ram_bytes: int,
        gpu: Optional[int],
        ttl_ms: int,
        arrived: float,
    ) -> None:
        self.conn, self.id = conn, request_id
        self.gpu_bytes, self.ram_bytes, self.gpu, self.ttl_ms = gpu_bytes, ram_bytes, gpu, ttl_ms
        self.arrived = arrived
        self.timer: Optional[asyncio.TimerHandle] = None


class _Held:
    def __init__(self, permit_id: int, conn: "_Conn", gpu_bytes: int, ram_bytes: int) -> None:
        self.id, self.conn, self.gpu_bytes, self.ram_bytes = permit_id, conn, gpu_bytes, ram_bytes
        self.timer: Optional[asyncio.TimerHandle] = None


class _Conn:
    def __init__(self, number: int, writer: asyncio.StreamWriter) -> None:
        self.number, self.writer = number, writer
        self.last_message = 0.0
        self.closed = False


class FakeDaemon:
    """The fake daemon, served by an event loop on a thread of its own.

    Knobs (set them from the test's thread; read by the loop):
    - `silent`: acquires wait without timing out (to test the client's own timeout);
    - `grant_on_cancel`: a cancel for a waiting acquire grants it instead (a grant that crossed
      the cancel on the wire);
    - `ignore_cancel`: cancels are not answered (a slow daemon: the client gives up on its own);
    - `reject_with_error`: every acquire gets an `error` without `id` (a daemon that does not
      know permits).
    Introspection: `received` (every message, with its connection number), `connections`,
    `closed_connections`, `held()`, `waiting()`, `max_held_gpu_bytes`, `wait_for(predicate)`.
    """

    def __init__(
        self,
        path: str,
        *,
        gpu_capacity: int = 16 * GIB,
        ram_capacity: int = 64 * GIB,
        idle_close_s: float = 60.0,
        default_timeout_ms: int = 2000,
        default_ttl_ms: int = 60000,
        retry_after_ms: int = 1000,
        queue_max: int = 4096,
        first_fit: bool = False,
        verbose: bool = False,
    ) -> None:
        self.path = path
        self.gpu_capacity, self.ram_capacity = gpu_capacity, ram_capacity
        self.idle_close_s = idle_close_s
        self.default_timeout_ms, self.default_ttl_ms = default_timeout_ms, default_ttl_ms
        self.retry_after_ms, self.queue_max = retry_after_ms, queue_max
        self.first_fit = first_fit
        self.verbose = verbose
        self.silent = False
        self.grant_on_cancel = False
        self.ignore_cancel = False
        self.reject_with_error = False
        self.received: List[Dict[str, Any]] = []
        self.connections = 0
        self.closed_connections = 0
        self.max_held_gpu_bytes = 0
        self._held: Dict[int, _Held] = {}
        self._waiting: List[_Waiter] = []
        self._conns: List[_Conn] = []
        self._next_permit = 100
        self._changed = threading.Condition()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._server: Optional[asyncio.AbstractServer] = None

    # --- running ------------------------------------------------------------------------------

    def start(self) -> "FakeDaemon":
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="fake-gpuguard", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._server is None:
            raise RuntimeError(f"fake daemon could not listen on {self.path}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop = None

    def __enter__(self) -> "FakeDaemon":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_unix_server(self._serve, path=self.path, limit=MAX_LINE + 1)
            )
        finally:
            ready.set()
        idle_closer = loop.create_task(self._idle_closer())
        loop.run_forever()
        self._server.close()
        idle_closer.cancel()
        for conn in list(self._conns):
            conn.writer.close()  # its reader sees the end and its task finishes
        tasks = asyncio.all_tasks(loop)
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=10))
        loop.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def call(self, function: Callable[[], Any]) -> Any:
        """Runs `function` on the daemon's loop and returns its result."""
        assert self._loop is not None
        done = threading.Event()
        box: List[Any] = []
        self._loop.call_soon_threadsafe(lambda: (box.append(function()), done.set()))
        done.wait()
        return box[0]

    # --- introspection ------------------------------------------------------------------------

    def held(self) -> int:
        with self._changed:
            return len(self._held)

    def waiting(self) -> int:
        with self._changed:
            return len(self._waiting)

    def messages(self, kind: str) -> List[Dict[str, Any]]:
        with self._changed:
            return [m for m in self.received if m.get("type") == kind]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
        """Waits until `predicate()` (called under the daemon's state lock) is true. The timeout
        is only a safety net against a hung test, not a measurement."""
        with self._changed:
            if not self._changed.wait_for(predicate, timeout):
                raise AssertionError("fake daemon: condition not reached (test hung?)")

    # --- actions for tests --------------------------------------------------------------------

    def drop_connections(self) -> None:
        """Closes every client connection, as a daemon restart would."""
        self.call(lambda: [self._close(c) for c in list(self._conns)])

    def send_all(self, message: Dict[str, Any]) -> None:
        """Sends `message` on every open client connection (an unsolicited one, e.g. `trim`)."""
        self.call(lambda: [self._send(c, message) for c in list(self._conns) if not c.closed])

    def expire_all(self) -> None:
        """Every held permit's TTL passes now."""
        self.call(lambda: [self._expire(h) for h in list(self._held.values())])

    def grant_waiting(self) -> None:
        """Grants every waiting acquire, whatever the capacity (a grant racing a cancel)."""
        self.call(lambda: [self._grant(w) for w in list(self._waiting)])

    # --- the protocol -------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._changed:
            self.connections += 1
            conn = _Conn(self.connections, writer)
            self._conns.append(conn)
        conn.last_message = time.monotonic()
        session = False
        try:
            while not conn.closed:
                try:
                    line = await reader.readline()
                except ValueError:
                    self._send(conn, {"type": "error", "message": f"line over {MAX_LINE} bytes"})
                    break
                if not line.endswith(b"\n"):
                    break
                conn.last_message = time.monotonic()
                try:
                    message = json.loads(line)
                    assert isinstance(message, dict)
                except (ValueError, AssertionError):
                    self._send(conn, {"type": "error", "message": "not a JSON object"})
                    continue
                with self._changed:
                    self.received.append(dict(message, _conn=conn.number))
                    self._changed.notify_all()
                self._log(f"conn {conn.number} <- {message}")
                kind = message.get("type")
                if message.get("version") != 1:
                    self._error(conn, message, "missing or wrong version")
                elif kind == "status":
                    self._send(conn, {"type": "status", "permits": self._status()})
                    if not session:
                        break
                elif kind == "acquire":
                    session = True
                    self._acquire(conn, message)
                elif kind == "release_permit":
                    self._release(conn, message)
                elif kind == "cancel":
                    self._cancel(conn, message)
                else:
                    self._error(conn, message, f"unknown type {kind!r}")
                    if not session:
                        break
        except (ConnectionError, OSError):
            pass
        finally:
            self._close(conn)

    def _error(self, conn: _Conn, message: Dict[str, Any], text: str) -> None:
        answer: Dict[str, Any] = {"type": "error", "message": text}
        if "id" in message:
            answer["id"] = message["id"]
        self._send(conn, answer)

    def _acquire(self, conn: _Conn, message: Dict[str, Any]) -> None:
        if self.reject_with_error:
            self._send(conn, {"type": "error", "message": "unknown type 'acquire'"})
            return
        request_id = message.get("id")
        try:
            gpu_bytes = _u64(message.get("gpu_bytes", 0), "gpu_bytes")
            ram_bytes = _u64(message.get("ram_bytes", 0), "ram_bytes")
            timeout_ms = _u64(message.get("timeout_ms", self.default_timeout_ms), "timeout_ms")
            ttl_ms = _u64(message.get("ttl_ms", self.default_ttl_ms), "ttl_ms")
            gpu = message.get("gpu")
            if gpu not in (None, 0):
                raise ValueError(f"gpu {gpu!r}: the fake daemon has one GPU, 0")
            _u64(request_id, "id")
        except ValueError as err:
            self._refuse_now(conn, request_id, "invalid", str(err), 0, 0, None)
            return
        if gpu_bytes > self.gpu_capacity or ram_bytes > self.ram_capacity:
            self._refuse_now(
                conn,
                request_id,
                "too_large",
                "more than the fake's capacity",
                gpu_bytes,
                ram_bytes,
                gpu,
            )
            return
        if len(self._waiting) >= self.queue_max:
            self._refuse_now(
                conn, request_id, "queue_full", "the queue is full", gpu_bytes, ram_bytes, gpu
            )
            return
        waiter = _Waiter(conn, request_id, gpu_bytes, ram_bytes, gpu, ttl_ms, time.monotonic())
        with self._changed:
            self._waiting.append(waiter)
            self._changed.notify_all()
        if not self.silent:
            assert self._loop is not None
            waiter.timer = self._loop.call_later(timeout_ms / 1000, self._time_out, waiter)
        self._pump()

    def _room(self) -> Dict[str, int]:
        return {
            "gpu_bytes": self.gpu_capacity - sum(h.gpu_bytes for h in self._held.values()),
            "ram_bytes": self.ram_capacity - sum(h.ram_bytes for h in self._held.values()),
        }

    def _pump(self) -> None:
        """Grants waiters in arrival order while the first one fits (with `first_fit`: every
        waiter that fits, so answers come out of order)."""
        for waiter in list(self._waiting):
            if self.silent:
                return
            room = self._room()
            if waiter.gpu_bytes <= room["gpu_bytes"] and waiter.ram_bytes <= room["ram_bytes"]:
                self._grant(waiter)
            elif not self.first_fit:
                return

    def _grant(self, waiter: _Waiter) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        self._next_permit += 1
        held = _Held(self._next_permit, waiter.conn, waiter.gpu_bytes, waiter.ram_bytes)
        with self._changed:
            self._waiting.remove(waiter)
            self._held[held.id] = held
            self.max_held_gpu_bytes = max(
                self.max_held_gpu_bytes, sum(h.gpu_bytes for h in self._held.values())
            )
            self._changed.notify_all()
        assert self._loop is not None
        held.timer = self._loop.call_later(waiter.ttl_ms / 1000, self._expire, held)
        gpu = waiter.gpu if waiter.gpu is not None else (0 if waiter.gpu_bytes else None)
        self._send(
            waiter.conn,
            {
                "type": "granted",
                "id": waiter.id,
                "permit": held.id,
                "gpu": gpu,
                "gpu_bytes": waiter.gpu_bytes,
                "ram_bytes": waiter.ram_bytes,
                "waited_ms": int((time.monotonic() - waiter.arrived) * 1000),
                "ttl_ms": waiter.ttl_ms,
            },
        )

    def _time_out(self, waiter: _Waiter) -> None:
        if waiter in self._waiting:
            self._drop_waiter(waiter)
            self._refuse(waiter, "timeout", "did not fit in time")
            self._pump()

    def _refuse(self, waiter: _Waiter, reason: str, text: str) -> None:
        room = self._room()
        answer = {
            "type": "refused",
            "id": waiter.id,
            "reason": reason,
            "message": f"fake: needs {waiter.gpu_bytes} bytes, room {room['gpu_bytes']}: {text}",
            "needed": {
                "gpu_bytes": waiter.gpu_bytes,
                "ram_bytes": waiter.ram_bytes,
                "gpu": waiter.gpu,
            },
            "free": room,
        }
        # As the daemon: a retry estimate only where retrying may help.
        if reason in ("timeout", "queue_full", "max_permits"):
            answer["retry_after_ms"] = self.retry_after_ms
        self._send(waiter.conn, answer)

    def _refuse_now(
        self,
        conn: _Conn,
        request_id: Any,
        reason: str,
        text: str,
        gpu_bytes: int,
        ram_bytes: int,
        gpu: Optional[int],
    ) -> None:
        self._refuse(_Waiter(conn, request_id, gpu_bytes, ram_bytes, gpu, 0, 0.0), reason, text)

    def _drop_waiter(self, waiter: _Waiter) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        with self._changed:
            self._waiting.remove(waiter)
            self._changed.notify_all()

    def _release(self, conn: _Conn, message: Dict[str, Any]) -> None:
        permit_id = message.get("permit")
        held = self._held.get(permit_id) if isinstance(permit_id, int) else None
        if held is None or held.conn is not conn:
            self._error(
                conn, message, f"permit {message.get('permit')!r} is not held by this connection"
            )
            return
        self._free(held)
        self._send(conn, {"type": "released", "id": message.get("id"), "permit": held.id})
        self._pump()

    def _cancel(self, conn: _Conn, message: Dict[str, Any]) -> None:
        if self.ignore_cancel:
            return
        for waiter in self._waiting:
            if waiter.conn is conn and waiter.id == message.get("id"):
                if self.grant_on_cancel:
                    self._grant(waiter)
                else:
                    self._drop_waiter(waiter)
                    self._refuse(waiter, "cancelled", "cancelled by the client")
                    self._pump()
                return

    def _expire(self, held: _Held) -> None:
        if self._held.get(held.id) is held:
            self._free(held)
            self._send(
                held.conn,
                {
                    "type": "expired",
                    "permit": held.id,
                    "message": f"permit {held.id} held past its TTL",
                },
            )
            self._pump()

    def _free(self, held: _Held) -> None:
        if held.timer is not None:
            held.timer.cancel()
        with self._changed:
            del self._held[held.id]
            self._changed.notify_all()

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        for held in [h for h in self._held.values() if h.conn is conn]:
            self._free(held)
        for waiter in [w for w in self._waiting if w.conn is conn]:
            self._drop_waiter(waiter)
        with self._changed:
            self._conns.remove(conn)
            self.closed_connections += 1
            self._changed.notify_all()
        conn.writer.close()
        self._log(f"conn {conn.number} closed")
        self._pump()

    async def _idle_closer(self) -> None:
        """Closes connections that hold nothing and said nothing for `idle_close_s`."""
        while True:
            await asyncio.sleep(min(self.idle_close_s / 4, 1.0))
            now = time.monotonic()
            for conn in list(self._conns):
                busy = any(h.conn is conn for h in self._held.values()) or any(
                    w.conn is conn for w in self._waiting
                )
                if not busy and now - conn.last_message >= self.idle_close_s:
                    self._close(conn)

    def _send(self, conn: _Conn, message: Dict[str, Any]) -> None:
        self._log(f"conn {conn.number} -> {message}")
        if not conn.closed:
            conn.writer.write(json.dumps(message).encode() + b"\n")

    def _status(self) -> Dict[str, Any]:
        return {
            "held": len(self._held),
            "waiting": len(self._waiting),
            "reserved_gpu_bytes": sum(h.gpu_bytes for h in self._held.values()),
        }

    def _log(self, text: str) -> None:
        if self.verbose:
            print(f"fake-gpuguard: {text}", file=sys.stderr, flush=True)


def _u64(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise ValueError(f"{name}: {value!r} is not a u64")
    return value


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from gpuguard import parse_size

    parser = argparse.ArgumentParser(description="A fake gpuguard daemon (permits only).")
    parser.add_argument("--socket", required=True, help="unix socket path to listen on")
    parser.add_argument("--gpu-capacity", default="12GiB", help="GPU bytes permits may reserve")
    parser.add_argument("--ram-capacity", default="64GiB", help="RAM bytes permits may reserve")
    parser.add_argument(
        "--idle-close", type=float, default=60.0, help="seconds before an idle connection is closed"
    )
    parser.add_argument(
        "--retry-after", type=float, default=1.0, help="retry_after in refusals, seconds"
    )
    parser.add_argument("--quiet", action="store_true", help="do not log every message")
    args = parser.parse_args()
    daemon = FakeDaemon(
        args.socket,
        gpu_capacity=parse_size(args.gpu_capacity),
        ram_capacity=parse_size(args.ram_capacity),
        idle_close_s=args.idle_close,
        retry_after_ms=int(args.retry_after * 1000),
        verbose=not args.quiet,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with daemon:
        print(f"fake gpuguard daemon on {args.socket}", file=sys.stderr, flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
