"""Connecting to the daemon's unix sockets (session and fast lane) within a timeout."""

from __future__ import annotations

import socket
import time

_FIRST_PAUSE_S = 0.001
_MAX_PAUSE_S = 0.05


def connect_unix(path: str, timeout: float) -> socket.socket:
    """A stream socket connected to ``path``, with ``timeout`` set on it.

    A listener whose backlog is full answers a socket with a timeout (connected non-blocking)
    with EAGAIN at once: that is retried, with short pauses, until ``timeout`` has passed
    (another user opening and closing connections as fast as it could made one Attach in three
    fail at once). Any other error (no listener, no permission) raises at once.
    """
    deadline = time.monotonic() + timeout
    pause = _FIRST_PAUSE_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() + pause >= deadline:
                raise
        except OSError:
            sock.close()
            raise
        time.sleep(pause)
        pause = min(2 * pause, _MAX_PAUSE_S)
