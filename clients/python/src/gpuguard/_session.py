"""The permit protocol without I/O: message encoding, answer validation, and one connection's
bookkeeping (open requests by id, permits held, grants nobody waits for any more). The blocking
and the asyncio clients wrap a `Session` with their own sockets and wake-ups."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from .errors import DaemonUnavailable, PermitRefused, ProtocolError
from .sizes import Size, parse_size, seconds_to_ms

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/gpuguard/gpuguard.sock"
#: The longest line the daemon may send (a status report); anything longer is a broken peer.
MAX_ANSWER_BYTES = 1 << 20
#: The longest line the daemon accepts from a client.
MAX_REQUEST_BYTES = 64 << 10
_U64_MAX = 2**64 - 1

logger = logging.getLogger("gpuguard")


def socket_path(path: Optional[str]) -> str:
    """The socket to use: the argument, else $GPUGUARD_SOCKET, else the daemon's default."""
    return path or os.environ.get("GPUGUARD_SOCKET") or DEFAULT_SOCKET


def encode(message: Dict[str, Any]) -> bytes:
    line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {len(line)} bytes is over the protocol's {MAX_REQUEST_BYTES}")
    return line


def decode(line: bytes) -> Dict[str, Any]:
    """One answer line as a dict with a string `type`; anything else is a ProtocolError."""
    try:
        message = json.loads(line)
    except (ValueError, UnicodeDecodeError) as err:
        raise ProtocolError(
            f"the daemon sent a line that is not JSON ({err}): {line[:200]!r}"
        ) from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError(f"the daemon sent a message without a type: {line[:200]!r}")
    return message


def _is_u64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _U64_MAX


def _millis_to_seconds(value: Any) -> Optional[float]:
    """Seconds from a millisecond field; None when absent or not a non-negative number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return value / 1000.0


def _text(value: Any, default: str) -> str:
    return value if isinstance(value, str) else default


def _opt_dict(value: Any) -> Optional[Dict[str, Any]]:
    return value if isinstance(value, dict) else None


def acquire_fields(
    gpu_bytes: Optional[Size],
    ram_bytes: Optional[Size],
    model: Optional[str],
    gpu: Optional[int],
    timeout: Optional[float],
    ttl: Optional[float],
) -> Dict[str, Any]:
    """The fields of an `acquire` (without version, type and id); None means the daemon's
    default. Raises ValueError/TypeError naming the bad argument."""
    fields: Dict[str, Any] = {}
    if model is not None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model: {model!r} is not a model name")
        fields["model"] = model
    if gpu_bytes is not None:
        fields["gpu_bytes"] = parse_size(gpu_bytes, "gpu_bytes")
    if ram_bytes is not None:
        fields["ram_bytes"] = parse_size(ram_bytes, "ram_bytes")
    if gpu is not None:
        # A u32 on the wire: the daemon closes a connection that sends a value it cannot read,
        # which would end every permit held on it.
        if not _is_u64(gpu) or gpu >= 2**32:
            raise ValueError(f"gpu: {gpu!r} is not a GPU index")
        fields["gpu"] = gpu
    timeout_ms = seconds_to_ms(timeout, "timeout")
    if timeout_ms is not None:
        fields["timeout_ms"] = timeout_ms
    ttl_ms = seconds_to_ms(ttl, "ttl", allow_zero=False)
    if ttl_ms is not None:
        fields["ttl_ms"] = ttl_ms
    return fields


def refusal(message: Dict[str, Any]) -> PermitRefused:
    """A `refused` answer as the exception the caller sees."""
    return PermitRefused(
        _text(message.get("reason"), "unknown"),
        _text(message.get("message"), "(the daemon gave no message)"),
        needed=_opt_dict(message.get("needed")),
        free=_opt_dict(message.get("free")),
        retry_after=_millis_to_seconds(message.get("retry_after_ms")),
    )


class Permit:
    """Memory reserved by the daemon for one unit of work, until released.

    `id` is the daemon's permit number, `gpu` the GPU index it is on (None for a RAM-only
    permit), `gpu_bytes`/`ram_bytes` what is reserved, `waited` the seconds it waited in the
    daemon's queue, `ttl` the seconds it may be held (None if the daemon did not say).
    `expired` is set when the daemon revoked it at its TTL (`expired_message` says why), `lost`
    when the connection that held it broke (the daemon frees a closed connection's permits);
    releasing a permit that is no longer `active` does nothing.
    """

    __slots__ = (
        "id",
        "gpu",
        "gpu_bytes",
        "ram_bytes",
        "waited",
        "ttl",
        "model",
        "expired",
        "expired_message",
        "lost",
        "released",
        "_owner",
    )

    def __init__(self, message: Dict[str, Any], model: Optional[str], owner: Any) -> None:
        gpu = message.get("gpu")
        fields = (message.get("permit"), message.get("gpu_bytes", 0), message.get("ram_bytes", 0))
        if not all(_is_u64(f) for f in fields) or not (gpu is None or _is_u64(gpu)):
            raise ProtocolError(f"the daemon sent a malformed grant: {message!r:.300}")
        self.id, self.gpu_bytes, self.ram_bytes = fields
        self.gpu: Optional[int] = gpu
        self.waited = _millis_to_seconds(message.get("waited_ms")) or 0.0
        self.ttl = _millis_to_seconds(message.get("ttl_ms"))
        self.model = model
        self.expired = False
        self.expired_message: Optional[str] = None
        self.lost = False
        self.released = False
        self._owner = owner

    @property
    def active(self) -> bool:
        """Still reserved for this holder: not released, expired or lost."""
        return not (self.released or self.expired or self.lost)

    def __repr__(self) -> str:
        state = (
            "active"
            if self.active
            else "expired" if self.expired else "lost" if self.lost else "released"
        )
        return (
            f"<Permit {self.id} gpu={self.gpu} gpu_bytes={self.gpu_bytes} "
            f"ram_bytes={self.ram_bytes} waited={self.waited:.3f}s {state}>"
        )


class Request:
    """One open request on a connection: an acquire or a release_permit."""

    __slots__ = ("id", "kind", "model", "permit", "outcome", "cancel_sent", "waiter")

    PENDING: Any = object()

    def __init__(
        self,
        request_id: int,
        kind: str,
        model: Optional[str] = None,
        permit: Optional[Permit] = None,
    ) -> None:
        self.id = request_id
        self.kind = kind
        self.model = model
        self.permit = permit
        #: PENDING, then a Permit (granted), None (released) or an exception to raise.
        self.outcome: Any = Request.PENDING
        self.cancel_sent = False
        #: The client's wake-up (a threading.Event or an asyncio.Future).
        self.waiter: Any = None


class Lost(Exception):
    """The outcome of a request whose connection broke. `retryable`: nothing was held on it
    (the daemon's idle close, or a restart between permits), so sending again is safe and
    transparent to the caller."""

    def __init__(self, cause: str, retryable: bool) -> None:
        super().__init__(cause)
        self.retryable = retryable


class ConnectionLevelError(Exception):
    """An `error` answer without an `id` while nothing is held: the daemon rejected the
    connection's messages as a whole (e.g. a daemon that does not know permits), so the
    connection must be closed."""


#: What a Session call returns: requests to wake (their outcome is set) and lines to send.
Effects = Tuple[List[Request], List[bytes]]


class Session:
    """One connection's bookkeeping. Not thread-safe: the blocking client calls it under a lock,
    the asyncio client from its loop. Every answer is untrusted: malformed ones become
    ProtocolError outcomes, unknown ids are ignored, and a grant nobody waits for is released."""

    def __init__(self, next_id: Callable[[], int], owner: Any) -> None:
        self._next_id = next_id
        self._owner = owner
        self.pending: Dict[int, Request] = {}
        self.held: Dict[int, Permit] = {}
        self.closed: Optional[str] = None
        #: Called when the daemon asks for this process's allocator cache back (`trim`).
        self.on_trim: Optional[Callable[[], None]] = None
        self.trims = 0

    # --- what the client asks -----------------------------------------------------------------

    def open_acquire(self, fields: Dict[str, Any]) -> Tuple[Request, bytes]:
        request = Request(self._next_id(), "acquire", model=fields.get("model"))
        line = encode({"version": PROTOCOL_VERSION, "type": "acquire", "id": request.id, **fields})
        self.pending[request.id] = request
        return request, line

    def open_release(self, permit: Permit) -> Tuple[Optional[Request], List[bytes]]:
        """A release to wait for, or None when there is nothing to release (already released,
        expired, lost): then releasing is a no-op."""
        if not permit.active or self.held.get(permit.id) is not permit:
            return None, []
        permit.released = True
        request = Request(self._next_id(), "release", permit=permit)
        self.pending[request.id] = request
        return request, [self._release_line(request.id, permit.id)]

    def cancel(self, request: Request) -> List[bytes]:
        """Asks the daemon to stop waiting for an acquire that has no answer yet; the answer
        (refused, or a grant that raced the cancel) still comes to the request."""
        if self.pending.get(request.id) is not request or request.cancel_sent or self.closed:
            return []
        request.cancel_sent = True
        return [encode({"version": PROTOCOL_VERSION, "type": "cancel", "id": request.id})]

    def abandon(self, request: Request) -> List[bytes]:
        """The caller stopped waiting for an acquire (timeout, interrupt, cancelled task) and will
        not use its outcome: cancel it if it is still waiting (a grant that arrives later is
        released at once), or release the permit if it was granted meanwhile."""
        if self.pending.get(request.id) is request:
            lines = self.cancel(request)
            del self.pending[request.id]
            return lines
        permit = request.outcome
        request.outcome = None
        if (
            isinstance(permit, Permit)
            and permit.active
            and self.held.pop(permit.id, None) is permit
        ):
            permit.released = True
            return [self._release_line(self._next_id(), permit.id)]
        return []

    # --- what the daemon says -----------------------------------------------------------------

    def on_line(self, line: bytes) -> Effects:
        """Routes one answer line. Raises ProtocolError for a line that is not a message and
        ConnectionLevelError for an error without id (both: close the connection)."""
        message = decode(line)
        handler = self._HANDLERS.get(message["type"])
        if handler is None:  # a newer daemon's message: not ours to understand
            return [], []
        return handler(self, message)

    def _granted(self, message: Dict[str, Any]) -> Effects:
        request_id, permit_id = message.get("id"), message.get("permit")
        request = self._take(request_id, "acquire")
        if request is None:
            # Nobody waits for it (cancelled or timed out meanwhile): give it straight back.
            return [], (
                [self._release_line(self._next_id(), permit_id)] if _is_u64(permit_id) else []
            )
        try:
            permit = Permit(message, request.model, self._owner)
        except ProtocolError as err:
            request.outcome = err
            lines = [self._release_line(self._next_id(), permit_id)] if _is_u64(permit_id) else []
            return [request], lines
        self.held[permit.id] = permit
        request.outcome = permit
        return [request], []

    def _refused(self, message: Dict[str, Any]) -> Effects:
        request = self._take(message.get("id"), "acquire")
        if request is None:
            return [], []
        request.outcome = refusal(message)
        return [request], []

    def _released(self, message: Dict[str, Any]) -> Effects:
        request = self._take(message.get("id"), "release")
        if request is None:
            return [], []
        self.held.pop(request.permit.id, None)
        request.outcome = None
        return [request], []

    def _expired(self, message: Dict[str, Any]) -> Effects:
        permit_id = message.get("permit")
        permit = self.held.get(permit_id) if _is_u64(permit_id) else None
        if permit is not None:
            if not permit.released:
                del self.held[permit.id]
            permit.expired = True
            permit.expired_message = _text(message.get("message"), "the permit's TTL passed")
        return [], []

    def _error(self, message: Dict[str, Any]) -> Effects:
        text = _text(message.get("message"), "(no message)")
        if "id" in message:
            request = self.pending.pop(message["id"], None) if _is_u64(message["id"]) else None
        else:
            request = self._error_without_id(text)
        if request is None:
            return [], []
        if request.kind == "release":
            self.held.pop(request.permit.id, None)
            # Revoked while the release was on its way: released all the same.
            request.outcome = (
                None if request.permit.expired else ProtocolError(f"release_permit: {text}")
            )
        else:
            request.outcome = ProtocolError(f"acquire: {text}")
        return [request], []

    def _error_without_id(self, text: str) -> Optional[Request]:
        """Whose is an `error` without `id`? Releases are answered at once, so the oldest open
        release if there is one. Else, with nothing held, the connection as a whole (e.g. a
        daemon that does not know permits): ConnectionLevelError. Else it cannot be placed, and
        closing the connection would cost the permits held on it: logged and ignored."""
        release = next((r for r in self.pending.values() if r.kind == "release"), None)
        if release is not None:
            del self.pending[release.id]
            return release
        if not self.held:
            raise ConnectionLevelError(text)
        logger.warning(
            "gpuguard: the daemon sent an error about no request in particular: %s", text
        )
        return None

    def _trim_cache(self, message: Dict[str, Any]) -> Effects:
        if not (_is_u64(message.get("gpu")) and _is_u64(message.get("bytes"))):
            return [], []
        self.trims += 1
        if self.on_trim is not None:
            try:
                self.on_trim()
            except Exception as err:  # a hint: never breaks the connection
                logger.warning("gpuguard: giving the allocator's cache back failed: %r", err)
        return [], []

    _HANDLERS = {
        "granted": _granted,
        "refused": _refused,
        "released": _released,
        "expired": _expired,
        "error": _error,
        "trim": _trim_cache,
    }

    def _take(self, request_id: Any, kind: str) -> Optional[Request]:
        request = self.pending.get(request_id) if _is_u64(request_id) else None
        if request is None or request.kind != kind:
            return None
        del self.pending[request_id]
        return request

    @staticmethod
    def _release_line(request_id: int, permit_id: int) -> bytes:
        return encode(
            {
                "version": PROTOCOL_VERSION,
                "type": "release_permit",
                "id": request_id,
                "permit": permit_id,
            }
        )

    # --- the end ------------------------------------------------------------------------------

    def connection_lost(self, cause: str, fatal: Optional[Exception] = None) -> List[Request]:
        """The connection broke or was closed: the daemon has freed everything it held. Held
        permits are marked lost; open releases succeed; open acquires get `fatal` if given (the
        daemon broke the protocol), else a Lost outcome (retryable when nothing was held).
        Returns the requests to wake."""
        if self.closed is not None:
            return []
        self.closed = cause
        held_any = any(not p.released for p in self.held.values())
        for permit in self.held.values():
            permit.lost = True
        self.held.clear()
        woken = list(self.pending.values())
        for request in woken:
            if request.kind == "release":
                request.outcome = None
            else:
                request.outcome = fatal or Lost(cause, retryable=not held_any)
        self.pending.clear()
        return woken

    def idle(self) -> bool:
        return not self.pending and not self.held


def client_timeout(outcome: Any, timeout: float, margin: float) -> Exception:
    """What to raise when the daemon did not answer an acquire within its timeout plus the
    client's margin and a cancel was sent: the daemon's own refusal if one came meanwhile
    (a `cancelled` one is reported as the timeout it is), else a client-side timeout."""
    if isinstance(outcome, PermitRefused):
        if outcome.reason != "cancelled":
            return outcome
        return PermitRefused(
            "timeout",
            outcome.message,
            needed=outcome.needed,
            free=outcome.free,
            retry_after=outcome.retry_after,
        )
    return PermitRefused(
        "timeout",
        f"no answer from the gpuguard daemon within {timeout + margin:g} s "
        f"(its timeout {timeout:g} s + {margin:g} s); the request was cancelled",
    )


def lost_error(path: str, outcome: Lost) -> Exception:
    held = "" if outcome.retryable else " (permits held on it are lost)"
    return DaemonUnavailable(
        f"connection to the gpuguard daemon at {path} lost while waiting "
        f"for a permit{held}: {outcome}"
    )


def remaining_ms(fields: Dict[str, Any], elapsed_s: float) -> Dict[str, Any]:
    """The acquire's fields for sending again after `elapsed_s` seconds: less time to wait."""
    if "timeout_ms" not in fields:
        return fields
    return {**fields, "timeout_ms": max(0, fields["timeout_ms"] - int(elapsed_s * 1000))}


def status_answer(line: bytes) -> Dict[str, Any]:
    """The report from the answer to a `status` request."""
    if not line.endswith(b"\n"):
        raise ProtocolError(f"no complete status answer from the daemon (got {len(line)} bytes)")
    message = decode(line)
    if message["type"] != "status":
        raise ProtocolError(f"status: {_text(message.get('message'), message['type'])}")
    return message
