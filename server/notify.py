"""systemd readiness notification, written by hand (no libsystemd dependency).

``$NOTIFY_SOCKET`` is a datagram unix socket path; a leading ``@`` names an abstract socket.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def sd_notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``); False when not run under systemd or on failure."""
    addr = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@":
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True
