"""The /metrics endpoint, bounded: what an unauthenticated peer of the metrics port can hold.

prometheus_client's own server runs a thread per connection with no timeout, so a peer that
opens connections and sends half a request holds a daemon thread and a descriptor each, for as
long as it likes. Here one thread reads requests from every connection at once (``selectors``),
at most ``MAX_CONNS`` open: one beyond closes the oldest that has not sent a whole request, so
half-sent requests can't keep a scraper out. A request not whole within ``READ_TIMEOUT_S``, or
over ``MAX_REQUEST`` bytes, is closed unanswered. A whole request (any path; a GET) is answered
with the registry's text exposition, written as the peer reads it (a peer that doesn't is closed
at the same deadline), and the connection closed. A connection that fails in any way is
closed and logged; the endpoint goes on serving the others.

``serve(host, port, registry) -> MetricsServer``: listening and served on a daemon thread;
``server_address`` is the bound address; ``shutdown()`` then ``server_close()`` stop it.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import cast

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_CONNS = 256
MAX_REQUEST = 16 << 10
READ_TIMEOUT_S = 5.0
_TICK_S = 0.5


class MetricsServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._registry = registry
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        # per open connection: its deadline, the request so far, the reply left to send (None:
        # still reading); oldest first
        self._conns: dict[socket.socket, tuple[float, bytearray, memoryview | None]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-metrics", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(_TICK_S):
                conn = cast(socket.socket, key.fileobj)
                try:
                    self._serve(conn)
                except Exception:  # one connection's trouble never ends the endpoint
                    log.exception("metrics endpoint: a connection failed")
                    if conn in self._conns:
                        self._close(conn)
            self._expire(time.monotonic())

    def _serve(self, conn: socket.socket) -> None:
        if conn is self._listener:
            self._accept()
            return
        state = self._conns.get(conn)
        if state is None:  # closed earlier in this batch of events (an accept beyond the cap)
            return
        if state[2] is None:
            self._read(conn)
        else:
            self._write(conn)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return  # gone before accepted, or out of descriptors: the next tick tries again
        if len(self._conns) >= MAX_CONNS:
            self._close(next(iter(self._conns)))  # the oldest, still sending or reading
        conn.setblocking(False)
        self._conns[conn] = (time.monotonic() + READ_TIMEOUT_S, bytearray(), None)
        self._sel.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        buf = self._conns[conn][1]
        buf += data
        if not data or len(buf) > MAX_REQUEST:
            self._close(conn)
        elif b"\r\n\r\n" in buf:
            self._answer(conn, bytes(buf))

    def _answer(self, conn: socket.socket, request: bytes) -> None:
        get = request.startswith(b"GET ")
        body = generate_latest(self._registry) if get else b""
        status = b"200 OK" if get else b"405 Method Not Allowed"
        head = (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + CONTENT_TYPE_LATEST.encode()
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close"
                + b"\r\n\r\n")
        end, buf, _ = self._conns[conn]
        self._conns[conn] = (end, buf, memoryview(head + body))
        self._sel.modify(conn, selectors.EVENT_WRITE)

    def _write(self, conn: socket.socket) -> None:
        end, buf, out = self._conns[conn]
        assert out is not None
        try:
            sent = conn.send(out)
        except BlockingIOError:
            return
        except OSError:
            sent = len(out)  # the peer went: nothing more to send
        if sent >= len(out):
            self._close(conn)
        else:
            self._conns[conn] = (end, buf, out[sent:])

    def _expire(self, now: float) -> None:
        for conn in [c for c, (end, _, _) in self._conns.items() if end < now]:
            self._close(conn)

    def _close(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        del self._conns[conn]
        conn.close()

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(5 * _TICK_S)

    def server_close(self) -> None:
        for conn in list(self._conns):
            self._close(conn)
        self._sel.close()
        self._listener.close()


def serve(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    return MetricsServer(host, port, registry)
