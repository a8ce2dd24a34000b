"""Client side of the daemon's fast lane (see ``server/fastlane.py`` for the frame format).

``FastLaneClient.acquire``/``release`` return ``None``/``False`` whenever the lane can't answer
(not resident, engine busy, denied, socket trouble); the caller then makes the gRPC call, which
does the work in full and reports errors. One socket per thread; a broken lane turns itself off.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Sequence

REQUEST = struct.Struct("<BHQ16s")
REPLY = struct.Struct("<BH")
ACQUIRE, RELEASE = 1, 2
OK = 0
MAX_PAGES = 4096


class FastLaneClient:
    def __init__(self, path: str, capability: bytes, timeout: float = 2.0) -> None:
        self.path, self._capability, self._timeout = path, capability, timeout
        self._local = threading.local()
        self.enabled = True
        self.hits = 0  # calls the lane answered (for tests and benchmarks)

    def __repr__(self) -> str:  # never show the capability
        return f"FastLaneClient({self.path!r}, enabled={self.enabled})"

    def acquire(self, pool_id: int, page_ids: Sequence[int]) -> list[int] | None:
        reply = self._call(ACQUIRE, pool_id, page_ids)
        return reply

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
        if not self.enabled or not 0 < n <= MAX_PAGES or min(page_ids) <= 0:
            return None
        return REQUEST.pack(op, n, pool_id, self._capability) + struct.pack(f"<{n}Q", *page_ids)

    def _call(self, op: int, pool_id: int, page_ids: Sequence[int]) -> list[int] | None:
        frame = self.frame(op, pool_id, page_ids)
        if frame is None:
            return None
        try:
            sock = self._socket()
            sock.sendall(frame)
            status, count = REPLY.unpack(self._recv(sock, REPLY.size))
            slots = list(struct.unpack(f"<{count}I", self._recv(sock, 4 * count))) if count else []
        except (OSError, struct.error):
            self.close()
            self.enabled = False  # the daemon went away or never offered it: gRPC from now on
            return None
        if status != OK:
            return None
        self.hits += 1
        return slots

    def _socket(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout)
            sock.connect(self.path)
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
    any socket trouble closes the connection and turns the lane off (gRPC from then on).
    """

    def __init__(self, path: str, timeout: float = 2.0) -> None:
        self.path, self._timeout = path, timeout
        self._lock = asyncio.Lock()
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.enabled = True
        self.hits = 0

    async def call(self, frame: bytes) -> list[int] | None:
        if not self.enabled:
            return None
        async with self._lock:
            try:
                status, slots = await asyncio.wait_for(self._exchange(frame), self._timeout)
            except (OSError, EOFError, asyncio.IncompleteReadError, TimeoutError, struct.error):
                await self.close()
                self.enabled = False
                return None
        if status != OK:
            return None
        self.hits += 1
        return slots

    async def _exchange(self, frame: bytes) -> tuple[int, list[int]]:
        if self._streams is None:
            self._streams = await asyncio.open_unix_connection(self.path)
        reader, writer = self._streams
        writer.write(frame)
        await writer.drain()
        status, count = REPLY.unpack(await reader.readexactly(REPLY.size))
        raw = await reader.readexactly(4 * count) if count else b""
        return status, list(struct.unpack(f"<{count}I", raw))

    async def close(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            self._streams = None
            writer.close()
