"""Client side of the daemon's fast lane (see ``server/fastlane.py`` for the frame format).

``FastLaneClient.acquire``/``release`` return ``None``/``False`` whenever the lane did not do the
call (not resident, engine busy, denied, socket trouble); the caller then makes the gRPC call,
which does the work in full and reports errors. One socket per thread.

Contract (both clients):
- A frame is sent at most once. Trouble before all of it is out (no daemon, a refused or stale
  connection) or the daemon hanging up on it means nothing was done (or the daemon died, and its
  pools with it): the caller uses gRPC.
- No answer within ``timeout`` once the frame is out: the daemon may still do it, so the call
  raises ``DeadlineExceeded`` (as a gRPC call past its deadline does) rather than go to gRPC and
  pin or unpin twice.
- A lane that failed is skipped, then tried again on a fresh connection: ``BACKOFF_FIRST``
  seconds after the failure, doubling with each failure in a row up to ``BACKOFF_LAST``; an
  answer or ``reset`` (a pool attached on that lane: e.g. after a daemon restart) ends the wait.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Sequence

from kvtier.errors import DeadlineExceeded

from .unixsock import connect_unix

REQUEST = struct.Struct("<BHQ16s")
REPLY = struct.Struct("<BH")
ACQUIRE, RELEASE = 1, 2
OK = 0
MAX_PAGES = 4096
BACKOFF_FIRST, BACKOFF_LAST = 0.1, 5.0  # seconds a failed lane is skipped


class Backoff:
    """When a failed lane may be tried again (see the module's contract)."""

    __slots__ = ("_delay", "_until")

    def __init__(self) -> None:
        self._delay = self._until = 0.0

    def ready(self) -> bool:
        return self._delay == 0.0 or time.monotonic() >= self._until

    def failed(self) -> None:
        self._delay = min(BACKOFF_LAST, 2 * self._delay) if self._delay else BACKOFF_FIRST
        self._until = time.monotonic() + self._delay

    def reset(self) -> None:
        self._delay = self._until = 0.0


def no_answer(path: str, timeout: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"fast lane {path}: no answer within {timeout}s (the daemon may "
                            "still do the call: it was not sent again)")


class FastLaneClient:
    def __init__(self, path: str, capability: bytes, timeout: float = 2.0) -> None:
        self.path, self._capability, self._timeout = path, capability, timeout
        self._local = threading.local()
        self.backoff = Backoff()
        self.hits = 0  # calls the lane answered (for tests and benchmarks)
        self.failures = 0  # calls the lane failed (socket trouble or no answer in time)

    def __repr__(self) -> str:  # never show the capability
        return f"FastLaneClient({self.path!r}, ready={self.backoff.ready()})"

    def acquire(self, pool_id: int, page_ids: Sequence[int]) -> list[int] | None:
        return self._call(ACQUIRE, pool_id, page_ids)

    def release(self, pool_id: int, page_ids: Sequence[int]) -> bool:
        return self._call(RELEASE, pool_id, page_ids) is not None

    def close(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
            self._local.sock = None

    def frame(self, op: int, pool_id: int, page_ids: Sequence[int]) -> bytes | None:
        """The request frame, or ``None`` when the lane can't carry this call."""
        n = len(page_ids)
        if not 0 < n <= MAX_PAGES or min(page_ids) <= 0:
            return None
        return REQUEST.pack(op, n, pool_id, self._capability) + struct.pack(f"<{n}Q", *page_ids)

    def _call(self, op: int, pool_id: int, page_ids: Sequence[int]) -> list[int] | None:
        frame = self.frame(op, pool_id, page_ids)
        if frame is None or not self.backoff.ready():
            return None
        try:
            sock = self._socket()
            sock.sendall(frame)  # a part sent and then closed is a short frame: never done
        except OSError:
            self._failed()
            return None
        try:
            status, count = REPLY.unpack(self._recv(sock, REPLY.size))
            slots = list(struct.unpack(f"<{count}I", self._recv(sock, 4 * count))) if count else []
        except TimeoutError:
            self._failed()
            raise no_answer(self.path, self._timeout) from None
        except (OSError, struct.error):
            self._failed()  # the daemon hung up
            return None
        self.backoff.reset()
        if status != OK:
            return None
        self.hits += 1
        return slots

    def _failed(self) -> None:
        self.close()
        self.failures += 1
        self.backoff.failed()

    def _socket(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = connect_unix(self.path, self._timeout)
            self._local.sock = sock
        return sock

    @staticmethod
    def _recv(sock: socket.socket, size: int) -> bytes:
        buf = b""
        while len(buf) < size:
            chunk = sock.recv(size - len(buf))
            if not chunk:
                raise ConnectionError("fast lane closed")
            buf += chunk
        return buf


class AsyncFastLane:
    """The fast lane for asyncio clients: one connection per daemon, one request at a time.

    ``call`` returns the slots (or ``[]`` for a release) when the lane answered, else ``None``;
    failures follow the module's contract (a stale connection is replaced before sending).
    """

    def __init__(self, path: str, timeout: float = 2.0) -> None:
        self.path, self._timeout = path, timeout
        self._lock = asyncio.Lock()
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.backoff = Backoff()
        self.hits = 0
        self.failures = 0

    async def call(self, frame: bytes) -> list[int] | None:
        if not self.backoff.ready():
            return None
        async with self._lock:
            try:
                reader = await asyncio.wait_for(self._send(frame), self._timeout)
            except (OSError, TimeoutError):
                self._failed()  # abort() drops any part of the frame not yet out
                return None
            try:
                status, slots = await asyncio.wait_for(self._receive(reader), self._timeout)
            except TimeoutError:
                self._failed()
                raise no_answer(self.path, self._timeout) from None
            except (OSError, EOFError, asyncio.IncompleteReadError, struct.error):
                self._failed()  # the daemon hung up
                return None
        self.backoff.reset()
        if status != OK:
            return None
        self.hits += 1
        return slots

    async def _send(self, frame: bytes) -> asyncio.StreamReader:
        if self._streams is not None and (self._streams[0].at_eof()
                                          or self._streams[1].is_closing()):
            self._drop()  # the daemon hung up since the last call (e.g. it restarted)
        if self._streams is None:
            self._streams = await asyncio.open_unix_connection(self.path)
        reader, writer = self._streams
        writer.write(frame)
        await writer.drain()
        return reader

    @staticmethod
    async def _receive(reader: asyncio.StreamReader) -> tuple[int, list[int]]:
        status, count = REPLY.unpack(await reader.readexactly(REPLY.size))
        raw = await reader.readexactly(4 * count) if count else b""
        return status, list(struct.unpack(f"<{count}I", raw))

    def _failed(self) -> None:
        self._drop()
        self.failures += 1
        self.backoff.failed()

    def _drop(self) -> None:
        if self._streams is not None:
            self._streams[1].transport.abort()
            self._streams = None

    async def close(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            self._streams = None
            writer.close()
