"""The exceptions the gpuguard client raises: a refused permit (backpressure), an unreachable
daemon, and answers that break the protocol."""

from __future__ import annotations

from typing import Any, Dict, Optional


class GpuguardError(Exception):
    """Base class of everything this package raises about the daemon."""


class DaemonUnavailable(GpuguardError, ConnectionError):
    """The daemon's socket could not be reached, or the connection broke while it mattered
    (permits were held, or a reconnect failed)."""


class ProtocolError(GpuguardError):
    """The daemon answered with an `error` message, or with something this client cannot read."""


class PermitRefused(GpuguardError):
    """No permit: the daemon refused it (or no answer came in time).

    `reason` is the daemon's word for why (`timeout`, `too_large`, `queue_full`, `max_permits`,
    `not_allowed`, `invalid`, `cancelled`, and while the host drains before its cloud's
    maintenance or preemption, `host_maintenance` and `preempted`); `retry_after` is the daemon's estimate in seconds of
    when to try again (None when it gave none): what a server needs to answer 503 with a
    `Retry-After` header. `needed` and `free` are the daemon's dicts of what was asked and what
    was available (`gpu_bytes`, `ram_bytes`, `gpu`), or None where it did not say.
    """

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        needed: Optional[Dict[str, Any]] = None,
        free: Optional[Dict[str, Any]] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(f"permit refused ({reason}): {message}")
        self.reason = reason
        self.message = message
        self.needed = needed
        self.free = free
        self.retry_after = retry_after

    @property
    def transient(self) -> bool:
        """True when asking again later can succeed (answer 503 + Retry-After), False when it
        never can as asked (too large, not allowed, invalid: a configuration problem)."""
        return self.reason in TRANSIENT_REASONS


#: Refusal reasons after which the same request may succeed later.
TRANSIENT_REASONS = frozenset(
    {"timeout", "queue_full", "max_permits", "cancelled", "host_maintenance", "preempted"}
)
