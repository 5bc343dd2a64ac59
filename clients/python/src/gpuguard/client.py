"""The blocking client: one unix-socket connection per `Client`, shared by all threads, with a
reader thread that routes the daemon's answers to the waiting threads by request id."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Union

from . import _session
from ._session import MAX_ANSWER_BYTES, ConnectionLevelError, Lost, Permit, Request, Session
from .allocator import CacheReader, cache_reader, cache_trimmer, with_cache
from ._peer import check_served_by_root_or_me
from .errors import DaemonUnavailable, GpuguardError, ProtocolError
from .sizes import Size

logger = logging.getLogger("gpuguard")

_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)


class _Connection:
    """One connection to the daemon and the thread that reads it."""

    def __init__(self, path: str, next_id: Any, connect_timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(connect_timeout)
        try:
            sock.connect(path)
        except OSError as err:
            sock.close()
            raise DaemonUnavailable(
                f"the gpuguard daemon is not reachable at {path}: {err}"
            ) from err
        try:
            check_served_by_root_or_me(sock, path)
        except DaemonUnavailable:
            sock.close()
            raise
        sock.settimeout(None)
        self.pid = os.getpid()
        self._sock = sock
        self._lock = threading.Lock()  # guards the session
        self._send_lock = threading.Lock()  # keeps lines whole on the socket
        self.session = Session(next_id, self)
        self._reader = threading.Thread(target=self._read_loop, name="gpuguard-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.session.closed is None

    def open_acquire(self, fields: Dict[str, Any]) -> Request:
        with self._lock:
            if self.session.closed is not None:
                request = Request(0, "acquire")
                request.outcome = Lost(self.session.closed, retryable=True)
                request.waiter = threading.Event()
                request.waiter.set()
                return request
            request, line = self.session.open_acquire(fields)
            request.waiter = threading.Event()
        self._send([line])
        return request

    def cancel(self, request: Request) -> None:
        with self._lock:
            lines = self.session.cancel(request)
        self._send(lines)

    def abandon(self, request: Request) -> None:
        with self._lock:
            lines = self.session.abandon(request)
        self._send(lines)

    def release(self, permit: Permit, timeout: float) -> None:
        with self._lock:
            request, lines = self.session.open_release(permit)
            if request is None:
                return
            request.waiter = threading.Event()
        self._send(lines)
        if not request.waiter.wait(timeout):
            with self._lock:
                self.session.pending.pop(request.id, None)
            logger.warning(
                "gpuguard: no answer to the release of permit %d within %g s "
                "(sent; the daemon frees it at its TTL at the latest)",
                permit.id,
                timeout,
            )
            return
        if isinstance(request.outcome, Exception):
            raise request.outcome

    def close(self, cause: str) -> None:
        self._broken(cause)
        if self._reader is not threading.current_thread():
            self._reader.join()

    def _send(self, lines: Iterable[bytes]) -> None:
        if not lines:
            return
        try:
            with self._send_lock:
                for line in lines:
                    self._sock.sendall(line, _SEND_FLAGS)
        except OSError as err:
            self._broken(f"sending to the gpuguard daemon failed: {err}")

    def _read_loop(self) -> None:
        cause, fatal = "the daemon closed the connection", None
        stream = self._sock.makefile("rb")
        try:
            while True:
                line = stream.readline(MAX_ANSWER_BYTES + 1)
                if not line.endswith(b"\n"):
                    if len(line) > MAX_ANSWER_BYTES:
                        cause = f"the daemon sent a line longer than {MAX_ANSWER_BYTES} bytes"
                        fatal = ProtocolError(cause)
                    break
                with self._lock:
                    try:
                        woken, lines = self.session.on_line(line)
                    except ProtocolError as err:
                        cause, fatal = str(err), err
                        break
                    except ConnectionLevelError as err:
                        cause = f"the daemon rejected the connection: {err}"
                        fatal = ProtocolError(cause)
                        break
                self._send(lines)
                _wake(woken)
        except (OSError, ValueError) as err:  # ValueError: the socket was closed under us
            cause = f"the connection to the gpuguard daemon broke: {err}"
        finally:
            self._broken(cause, fatal)
            stream.close()
            self._sock.close()

    def _broken(self, cause: str, fatal: Optional[Exception] = None) -> None:
        with self._lock:
            woken = self.session.connection_lost(cause, fatal)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass
        _wake(woken)


def _wake(requests: List[Request]) -> None:
    for request in requests:
        if request.waiter is not None:
            request.waiter.set()


class Client:
    """A blocking, thread-safe client for gpuguard memory permits.

    ``socket_path``: the daemon's socket (default: $GPUGUARD_SOCKET, else
    /run/gpuguard/gpuguard.sock). One connection is opened on first use and shared by every
    thread; it is reopened transparently after the daemon closed it while nothing was held (the
    daemon closes connections idle for 60 s). A client-side wait lasts the daemon's timeout plus
    ``timeout_margin`` seconds; after that a ``cancel`` is sent and the daemon's answer awaited
    for ``cancel_grace`` seconds (a permit granted meanwhile is released at once).

    ``allocator="torch"`` sends with each request what PyTorch's caching allocator holds unused
    on the current device (read only when torch is imported and CUDA initialised; see
    `gpuguard.allocator`), so the daemon lets this process's own cache serve its permits even
    when it cannot tell the cache from the weights. A function returning bytes works too (it is
    only read). Whatever ``allocator`` says, short of a function, the client empties PyTorch's
    cache (`torch.cuda.empty_cache()`, when torch is loaded with CUDA initialised) when the
    daemon says another process of its model waits for it (`trim`).
    """

    def __init__(
        self,
        socket_path: Optional[str] = None,
        *,
        connect_timeout: float = 5.0,
        timeout_margin: float = 1.0,
        cancel_grace: float = 2.0,
        release_timeout: float = 10.0,
        allocator: Union[None, str, CacheReader] = None,
    ) -> None:
        self.socket_path = _session.socket_path(socket_path)
        self._cache_reader = cache_reader(allocator)
        self._trim = cache_trimmer(allocator)
        self._connect_timeout = connect_timeout
        self._margin = timeout_margin
        self._cancel_grace = cancel_grace
        self._release_timeout = release_timeout
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._lock = threading.Lock()
        self._conn: Optional[_Connection] = None
        self._closed = False

    # --- permits ------------------------------------------------------------------------------

    def permit(
        self,
        gpu_bytes: Optional[Size] = None,
        ram_bytes: Optional[Size] = None,
        *,
        model: Optional[str] = None,
        gpu: Optional[int] = None,
        timeout: Optional[float] = None,
        ttl: Optional[float] = None,
    ) -> "PermitContext":
        """A context manager: acquires a permit on entry (yielding the Permit), releases it on
        exit, also when the block raises. Raises PermitRefused when no permit came."""
        return PermitContext(
            self,
            dict(
                gpu_bytes=gpu_bytes,
                ram_bytes=ram_bytes,
                model=model,
                gpu=gpu,
                timeout=timeout,
                ttl=ttl,
            ),
        )

    def acquire(
        self,
        gpu_bytes: Optional[Size] = None,
        ram_bytes: Optional[Size] = None,
        *,
        model: Optional[str] = None,
        gpu: Optional[int] = None,
        timeout: Optional[float] = None,
        ttl: Optional[float] = None,
    ) -> Permit:
        """Waits for a permit: `gpu_bytes`/`ram_bytes` as ints or strings ("3GiB"; None: the
        daemon's default for the model), `model` (None: the caller's model by its process),
        `gpu` (None: the GPU with the most room), `timeout` and `ttl` in seconds (None: the
        daemon's defaults). Raises PermitRefused (with `.reason`, `.retry_after`, ...) when the
        daemon refuses or does not answer in time, DaemonUnavailable when it cannot be reached."""
        conn = self._conn
        fields = with_cache(
            _session.acquire_fields(gpu_bytes, ram_bytes, model, gpu, timeout, ttl),
            self._cache_reader,
            idle=conn is None or not conn.session.held,
        )
        start = time.monotonic()
        request_fields = fields
        for attempt in range(2):
            conn = self._connection()
            request = conn.open_acquire(request_fields)
            outcome = self._outcome(conn, request, timeout, start)
            if not (isinstance(outcome, Lost) and outcome.retryable and attempt == 0):
                break
            # The daemon closed an idle connection just as this was sent: ask again, once.
            request_fields = _session.remaining_ms(fields, time.monotonic() - start)
        if isinstance(outcome, Permit):
            return outcome
        if isinstance(outcome, Lost):
            raise _session.lost_error(self.socket_path, outcome)
        raise outcome

    def release(self, permit: Permit) -> None:
        """Gives the permit back and waits for the daemon's answer. A permit that is no longer
        active (released, expired, lost) is left alone."""
        owner = permit._owner
        if not isinstance(owner, _Connection):
            raise TypeError(f"{permit!r} is not a permit of a blocking gpuguard.Client")
        owner.release(permit, self._release_timeout)

    def _outcome(
        self, conn: _Connection, request: Request, timeout: Optional[float], start: float
    ) -> Any:
        """The acquire's outcome (Permit, exception or Lost); cancels and cleans up when the
        caller's wait ends early (client-side timeout, KeyboardInterrupt, any exception)."""
        try:
            limit = (
                None
                if timeout is None
                else max(0.0, timeout + self._margin - (time.monotonic() - start))
            )
            if request.waiter.wait(limit):
                return request.outcome
            conn.cancel(request)
            answered = request.waiter.wait(self._cancel_grace)
            outcome = request.outcome if answered else None
            conn.abandon(request)  # releases a grant that raced the cancel
            assert timeout is not None
            return _session.client_timeout(outcome, timeout, self._margin)
        except BaseException:
            conn.abandon(request)
            raise

    # --- the connection -----------------------------------------------------------------------

    def _next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    def _connection(self) -> _Connection:
        with self._lock:
            if self._closed:
                raise GpuguardError("this gpuguard.Client is closed")
            conn = self._conn
            if conn is not None and conn.pid != os.getpid():
                conn = None  # a forked child: the parent's connection is not ours to use
            if conn is None or not conn.alive:
                conn = self._conn = _Connection(
                    self.socket_path, self._next_id, self._connect_timeout
                )
                conn.session.on_trim = self._trim
            return conn

    def status(self) -> Dict[str, Any]:
        """The daemon's status report (the schema of `gpuguard status --json`)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self._connect_timeout)
            try:
                sock.connect(self.socket_path)
                check_served_by_root_or_me(sock, self.socket_path)
                sock.sendall(
                    _session.encode({"version": _session.PROTOCOL_VERSION, "type": "status"})
                )
                with sock.makefile("rb") as stream:
                    line = stream.readline(MAX_ANSWER_BYTES + 1)
            except OSError as err:
                raise DaemonUnavailable(f"gpuguard daemon at {self.socket_path}: {err}") from err
        return _session.status_answer(line)

    def close(self) -> None:
        """Closes the connection; the daemon frees any permit still held on it."""
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None and conn.pid == os.getpid():
            conn.close("the client was closed")

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class PermitContext:
    """`with client.permit(...) as permit:`: acquire on entry, release on exit."""

    def __init__(self, client: Client, arguments: Dict[str, Any]) -> None:
        self._client = client
        self._arguments = arguments
        self._permit: Optional[Permit] = None

    def __enter__(self) -> Permit:
        self._permit = self._client.acquire(**self._arguments)
        return self._permit

    def __exit__(self, *exc_info: Any) -> None:
        permit, self._permit = self._permit, None
        if permit is not None:
            try:
                self._client.release(permit)
            except GpuguardError as err:
                logger.warning("gpuguard: releasing permit %d: %s", permit.id, err)
