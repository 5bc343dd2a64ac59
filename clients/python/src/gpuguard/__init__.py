"""gpuguard: memory permits from the gpuguard daemon, a host-wide, memory-aware semaphore for GPU
work. `Client` (blocking, thread-safe) and `AsyncClient` (asyncio) acquire permits over the
daemon's unix socket; a refusal raises `PermitRefused` with what a server needs to answer 503
with `Retry-After`. `allocator="torch"` reports PyTorch's cache with each request
(`gpuguard.allocator`). Pure standard library. The wire protocol is docs/protocol.md in the gpuguard
repository."""

from ._session import DEFAULT_SOCKET, Permit
from .aio import AsyncClient, AsyncPermitContext
from .client import Client, PermitContext
from .errors import DaemonUnavailable, GpuguardError, PermitRefused, ProtocolError
from .sizes import parse_size

__all__ = [
    "AsyncClient",
    "AsyncPermitContext",
    "Client",
    "DEFAULT_SOCKET",
    "DaemonUnavailable",
    "GpuguardError",
    "Permit",
    "PermitContext",
    "PermitRefused",
    "ProtocolError",
    "parse_size",
]

__version__ = "0.1.0"
