"""Client side of the daemon's session socket (frame format in ``server/fdpass.py``).

A ``Session`` is one connection a client keeps open for its lifetime: pools whose tickets it
redeems belong to it, and the daemon detaches them a grace period after it closes (the client
exited). ``redeem(ticket, tenant)`` returns the pool's memfd (or -1 for a CUDA pool);
``deposit(fd, tenant)`` hands over a sealed memfd for Register and returns its ticket. Both raise
``FailedPrecondition`` when the daemon refuses and ``Unavailable`` when the socket fails. When
the connection broke (a timeout, a daemon hiccup), the next call reconnects and first renews
every lease redeemed before (``forget(ticket)`` after a Detach), so pools survive a reconnect
within the daemon's grace. Thread-safe: one request at a time. Tickets are secrets: never log
them.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import threading
from collections.abc import Sequence

from kvtier.errors import FailedPrecondition, Unavailable

from .unixsock import connect_unix

TICKET_BYTES = 32
REQUEST = struct.Struct(f"<BB{TICKET_BYTES}s")
REPLY = struct.Struct(f"<B{TICKET_BYTES}s")
REDEEM, DEPOSIT, RENEW = 1, 2, 3
OK, DENIED, REFUSED = 0, 1, 2


class Session:
    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.path, self._timeout = path, timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._leases: dict[bytes, str] = {}  # redeemed tickets -> tenant, to renew
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"Session({self.path!r}, open={self._sock is not None})"

    def redeem(self, ticket: bytes, tenant: str) -> int:
        status, _, fd = self._call(REDEEM, ticket, tenant, -1)
        if status == REFUSED:
            raise FailedPrecondition(
                "lease ticket refused: this tenant's sessions already hold pools in a quarter of "
                "the daemon's session connections (hold every pool of a client on one session)")
        if status != OK:
            raise FailedPrecondition("lease ticket refused (expired, used or another tenant's)")
        with self._lock:
            self._leases[ticket] = tenant
        return fd

    def forget(self, ticket: bytes) -> None:
        """The pool was detached: don't renew its lease."""
        with self._lock:
            self._leases.pop(ticket, None)

    def deposit(self, fd: int, tenant: str) -> bytes:
        status, ticket, extra = self._call(DEPOSIT, bytes(TICKET_BYTES), tenant, fd)
        _close(extra)
        if status != OK:
            raise FailedPrecondition("memfd deposit refused (too many unregistered deposits)")
        return ticket

    def close(self) -> None:
        """Ends the session: the daemon detaches its pools after its lease grace."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _call(self, op: int, ticket: bytes, tenant: str, fd: int) -> tuple[int, bytes, int]:
        name = tenant.encode()
        frame = REQUEST.pack(op, len(name), ticket) + name
        anc = [] if fd < 0 else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        with self._lock:
            for attempt in (0, 1):  # a connection to a daemon that restarted fails once
                fresh = self._sock is None
                try:
                    sock = self._connect()
                    sock.sendmsg([frame], anc)
                    data, fds = _recv_reply(sock)
                    break
                except OSError as exc:
                    if self._sock is not None:
                        self._sock.close()
                        self._sock = None
                    if fresh or attempt:
                        raise Unavailable(f"daemon session socket {self.path}: {exc}") from None
        status, out = REPLY.unpack(data)
        for extra in fds[1:]:
            _close(extra)
        return status, out, fds[0] if fds else -1

    def _connect(self) -> socket.socket:
        if self._pid != os.getpid():  # a forked child: its own session, not its parent's
            if self._sock is not None:
                self._sock.close()  # the child's copy only: the parent's session stays open
                self._sock = None
            self._leases.clear()
            self._pid = os.getpid()
        if self._sock is None:
            sock = connect_unix(self.path, self._timeout)
            try:
                self._renew(sock)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _renew(self, sock: socket.socket) -> None:
        """On a new connection: take back the leases of the old one (the caller holds the lock)."""
        for ticket, tenant in list(self._leases.items()):
            name = tenant.encode()
            sock.sendall(REQUEST.pack(RENEW, len(name), ticket) + name)
            data, fds = _recv_reply(sock)
            for fd in fds:
                _close(fd)
            if data[0] != OK:  # the pool is gone (reaped, detached, or a restarted daemon)
                del self._leases[ticket]


def _recv_reply(sock: socket.socket) -> tuple[bytes, list[int]]:
    data, fds = b"", list[int]()
    while len(data) < REPLY.size:
        chunk, anc, _, _ = sock.recvmsg(REPLY.size - len(data), socket.CMSG_SPACE(4),
                                        socket.MSG_CMSG_CLOEXEC)
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", raw[: len(raw) - len(raw) % 4]))
        if not chunk:
            for fd in fds:
                _close(fd)
            raise ConnectionError("session socket closed")
        data += chunk
    return data, fds


def _close(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def session_for(address: str, timeout: float = 5.0) -> Session | None:
    """The session beside a ``unix:`` gRPC address (``<path>.fd``); ``None`` for TCP addresses."""
    if not address.startswith("unix:"):
        return None
    path = address[len("unix://"):] if address.startswith("unix://") else address[len("unix:"):]
    return Session(path + ".fd", timeout)


def deposit_all(session: Session | None, tenant: str, fds: Sequence[int], count: int
                ) -> list[bytes]:
    """One ticket per segment for Register (``b""`` for all when ``fds`` is empty: CUDA).

    Each distinct descriptor is deposited once; segments sharing it share the ticket."""
    if not fds:
        return [b""] * count
    if len(fds) != count:
        raise ValueError("give one memfd per segment (fds=...)")
    if session is None:
        raise FailedPrecondition(
            "registering CPU memory needs the daemon's session socket: connect over unix://")
    tickets: dict[int, bytes] = {}
    for fd in fds:
        if fd not in tickets:
            tickets[fd] = session.deposit(fd, tenant)
    return [tickets[fd] for fd in fds]
