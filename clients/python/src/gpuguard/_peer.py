"""Who serves the socket: the daemon runs as root (or as this user, started by hand). A socket
another account made where the daemon's is looked for (a writable directory, a path from the
environment) could grant permits for memory that is not there; it is refused, as the CLI
refuses it."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from .errors import DaemonUnavailable

_UCRED = struct.Struct("3i")  # pid, uid, gid


def check_served_by_root_or_me(sock: Any, path: str) -> None:
    """Raises DaemonUnavailable unless the peer of the connected unix socket `sock` (a socket,
    or asyncio's transport socket) runs as root or as this process's effective user."""
    try:
        _, uid, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
    except (OSError, AttributeError, struct.error) as err:
        raise DaemonUnavailable(f"who serves the socket at {path} is unknown: {err!r}") from err
    if uid not in (0, os.geteuid()):
        raise DaemonUnavailable(
            f"the socket at {path} is served by uid {uid}, neither root nor you: "
            "not the gpuguard daemon, its answers are not trusted"
        )
