"""The asyncio client: one unix-socket connection per `AsyncClient` (per event loop), shared by
all tasks, with a reader task that routes the daemon's answers by request id. Cancelling a task
that waits for a permit sends `cancel` and never leaks a granted permit: everything written on
cancellation is written synchronously, without awaiting."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Dict, Iterable, List, Optional, Union

from . import _session
from ._session import MAX_ANSWER_BYTES, ConnectionLevelError, Lost, Permit, Request, Session
from .allocator import CacheReader, cache_reader, cache_trimmer, with_cache
from ._peer import check_served_by_root_or_me
from .errors import DaemonUnavailable, GpuguardError, ProtocolError
from .sizes import Size

logger = logging.getLogger("gpuguard")


class _AsyncConnection:
    """One connection to the daemon and the task that reads it."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, next_id: Any
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.session = Session(next_id, self)
        self._writer = writer
        self._reader_task = self.loop.create_task(self._read_loop(reader))

    @classmethod
    async def open(cls, path: str, next_id: Any, connect_timeout: float) -> "_AsyncConnection":
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(path, limit=MAX_ANSWER_BYTES + 1), connect_timeout
            )
        except (OSError, asyncio.TimeoutError) as err:
            raise DaemonUnavailable(
                f"the gpuguard daemon is not reachable at {path}: {err!r}"
            ) from err
        try:
            check_served_by_root_or_me(writer.get_extra_info("socket"), path)
        except DaemonUnavailable:
            writer.close()
            raise
        return cls(reader, writer, next_id)

    @property
    def alive(self) -> bool:
        return self.session.closed is None

    def write(self, lines: Iterable[bytes]) -> None:
        """Queues lines on the socket at once (no await: safe while being cancelled)."""
        if self.session.closed is not None:
            return
        try:
            for line in lines:
                self._writer.write(line)
        except (OSError, RuntimeError) as err:
            self._broken(f"sending to the gpuguard daemon failed: {err}")

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        cause, fatal = "the daemon closed the connection", None
        try:
            while True:
                line = await reader.readline()
                if not line.endswith(b"\n"):
                    break
                try:
                    woken, lines = self.session.on_line(line)
                except ProtocolError as err:
                    cause, fatal = str(err), err
                    break
                except ConnectionLevelError as err:
                    cause = f"the daemon rejected the connection: {err}"
                    fatal = ProtocolError(cause)
                    break
                self.write(lines)
                _wake(woken)
        except ValueError:  # asyncio's limit: a line longer than the protocol allows
            cause = f"the daemon sent a line longer than {MAX_ANSWER_BYTES} bytes"
            fatal = ProtocolError(cause)
        except OSError as err:
            cause = f"the connection to the gpuguard daemon broke: {err}"
        except asyncio.CancelledError:
            cause = "the client was closed"
            raise
        finally:
            self._broken(cause, fatal)

    def _broken(self, cause: str, fatal: Optional[Exception] = None) -> None:
        _wake(self.session.connection_lost(cause, fatal))
        try:
            self._writer.close()
        except RuntimeError:  # its event loop is gone
            pass

    async def close(self, cause: str) -> None:
        self._broken(cause)
        self._reader_task.cancel()
        try:
            await self._reader_task
        except asyncio.CancelledError:
            pass


def _wake(requests: List[Request]) -> None:
    for request in requests:
        if request.waiter is not None and not request.waiter.done():
            request.waiter.set_result(None)


async def _wait(future: "asyncio.Future[None]", timeout: Optional[float]) -> bool:
    """Waits for `future` up to `timeout` seconds without cancelling it; True if it is done."""
    if timeout is not None and timeout <= 0:
        return future.done()
    done, _ = await asyncio.wait({future}, timeout=timeout)
    return bool(done)


class AsyncClient:
    """An asyncio client for gpuguard memory permits; the same options as `gpuguard.Client`.

    One connection per event loop, opened on first use and shared by every task (64 or more
    concurrent waiters are routed by request id), reopened transparently after the daemon
    closed it while nothing was held. `async with client.permit(...) as permit:` acquires and
    releases; cancelling the awaiting task sends `cancel` and releases a permit that was granted
    meanwhile. Create it anywhere (no loop needed until first use).
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
        self._conn: Optional[_AsyncConnection] = None
        self._connecting: Optional["asyncio.Task[_AsyncConnection]"] = None
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
    ) -> "AsyncPermitContext":
        """An async context manager: acquires on entry (yielding the Permit), releases on exit,
        also when the block raises or is cancelled. Raises PermitRefused when no permit came."""
        return AsyncPermitContext(
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

    async def acquire(
        self,
        gpu_bytes: Optional[Size] = None,
        ram_bytes: Optional[Size] = None,
        *,
        model: Optional[str] = None,
        gpu: Optional[int] = None,
        timeout: Optional[float] = None,
        ttl: Optional[float] = None,
    ) -> Permit:
        """Waits for a permit; arguments, answers and errors as `gpuguard.Client.acquire`."""
        conn = self._conn
        fields = with_cache(
            _session.acquire_fields(gpu_bytes, ram_bytes, model, gpu, timeout, ttl),
            self._cache_reader,
            idle=conn is None or not conn.session.held,
        )
        loop = asyncio.get_running_loop()
        start = loop.time()
        request_fields = fields
        for attempt in range(2):
            conn = await self._connection()
            request, line = conn.session.open_acquire(request_fields)
            request.waiter = loop.create_future()
            conn.write([line])
            outcome = await self._outcome(conn, request, timeout, start)
            if not (isinstance(outcome, Lost) and outcome.retryable and attempt == 0):
                break
            # The daemon closed an idle connection just as this was sent: ask again, once.
            request_fields = _session.remaining_ms(fields, loop.time() - start)
        if isinstance(outcome, Permit):
            return outcome
        if isinstance(outcome, Lost):
            raise _session.lost_error(self.socket_path, outcome)
        raise outcome

    async def release(self, permit: Permit) -> None:
        """Gives the permit back and waits for the daemon's answer; a permit that is no longer
        active is left alone. The release is on the wire before the first await, so cancelling
        this call cannot leak the permit."""
        conn = permit._owner
        if not isinstance(conn, _AsyncConnection):
            raise TypeError(f"{permit!r} is not a permit of a gpuguard.AsyncClient")
        request, lines = conn.session.open_release(permit)
        if request is None:
            return
        request.waiter = conn.loop.create_future()
        conn.write(lines)
        if not await _wait(request.waiter, self._release_timeout):
            conn.session.pending.pop(request.id, None)
            logger.warning(
                "gpuguard: no answer to the release of permit %d within %g s "
                "(sent; the daemon frees it at its TTL at the latest)",
                permit.id,
                self._release_timeout,
            )
            return
        if isinstance(request.outcome, Exception):
            raise request.outcome

    async def _outcome(
        self, conn: _AsyncConnection, request: Request, timeout: Optional[float], start: float
    ) -> Any:
        """The acquire's outcome (Permit, exception or Lost); cancels and cleans up when the
        caller's wait ends early (client-side timeout, task cancelled)."""
        try:
            limit = (
                None
                if timeout is None
                else max(0.0, timeout + self._margin - (conn.loop.time() - start))
            )
            if await _wait(request.waiter, limit):
                return request.outcome
            conn.write(conn.session.cancel(request))
            answered = await _wait(request.waiter, self._cancel_grace)
            outcome = request.outcome if answered else None
            conn.write(conn.session.abandon(request))  # releases a grant that raced the cancel
            assert timeout is not None
            return _session.client_timeout(outcome, timeout, self._margin)
        except BaseException:  # CancelledError included
            conn.write(conn.session.abandon(request))
            raise

    # --- the connection -----------------------------------------------------------------------

    def _next_id(self) -> int:
        return next(self._ids)

    async def _connection(self) -> _AsyncConnection:
        if self._closed:
            raise GpuguardError("this gpuguard.AsyncClient is closed")
        loop = asyncio.get_running_loop()
        conn = self._conn
        if conn is not None and conn.alive and conn.loop is loop:
            return conn
        task = self._connecting
        if task is None or task.get_loop() is not loop:
            task = self._connecting = loop.create_task(self._open())
            task.add_done_callback(_retrieve)
        # Shielded: one task's cancellation must not abort the connection the others wait for.
        return await asyncio.shield(task)

    async def _open(self) -> _AsyncConnection:
        try:
            conn = await _AsyncConnection.open(
                self.socket_path, self._next_id, self._connect_timeout
            )
        finally:
            self._connecting = None
        conn.session.on_trim = self._trim
        old, self._conn = self._conn, conn
        if old is not None and old.alive:  # a connection of an event loop no longer used
            old._broken("replaced by a connection on another event loop")
        return conn

    async def status(self) -> Dict[str, Any]:
        """The daemon's status report (the schema of `gpuguard status --json`)."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path, limit=MAX_ANSWER_BYTES + 1),
                self._connect_timeout,
            )
        except (OSError, asyncio.TimeoutError) as err:
            raise DaemonUnavailable(f"gpuguard daemon at {self.socket_path}: {err!r}") from err
        try:
            check_served_by_root_or_me(writer.get_extra_info("socket"), self.socket_path)
            writer.write(_session.encode({"version": _session.PROTOCOL_VERSION, "type": "status"}))
            line = await asyncio.wait_for(reader.readline(), self._connect_timeout)
        except (OSError, ValueError, asyncio.TimeoutError) as err:
            raise DaemonUnavailable(f"gpuguard daemon at {self.socket_path}: {err!r}") from err
        finally:
            writer.close()
        return _session.status_answer(line)

    async def aclose(self) -> None:
        """Closes the connection; the daemon frees any permit still held on it."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close("the client was closed")

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


def _retrieve(task: "asyncio.Task[Any]") -> None:
    """Marks a connect task's failure as seen (its waiters may all have been cancelled)."""
    if not task.cancelled():
        task.exception()


class AsyncPermitContext:
    """`async with client.permit(...) as permit:`: acquire on entry, release on exit."""

    def __init__(self, client: AsyncClient, arguments: Dict[str, Any]) -> None:
        self._client = client
        self._arguments = arguments
        self._permit: Optional[Permit] = None

    async def __aenter__(self) -> Permit:
        self._permit = await self._client.acquire(**self._arguments)
        return self._permit

    async def __aexit__(self, *exc_info: Any) -> None:
        permit, self._permit = self._permit, None
        if permit is not None:
            try:
                await self._client.release(permit)
            except GpuguardError as err:
                logger.warning("gpuguard: releasing permit %d: %s", permit.id, err)
