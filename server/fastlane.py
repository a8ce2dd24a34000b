"""The fast lane: Acquire/Release of resident pages over a raw unix socket.

gRPC costs a few hundred microseconds per call in Python; an engine that re-pins pages already on
the GPU every step should not pay that. The fast lane answers only what the engine can do at once
(``TierEngine.try_acquire`` / ``try_release``: non-blocking, resident pages only) and otherwise
says "use gRPC", where the same call runs in full and reports every error.

Frames (little endian), one request then one reply, any number per connection:
    request:  op u8 | n u16 | pool_id u64 | capability 16 bytes | n x page_id u64
    reply:    status u8 | n u16 | n x slot u32      (slots only for an OK acquire)
``op``: 1 acquire, 2 release. ``status``: 0 OK, 1 use gRPC, 2 denied (unknown pool or wrong
capability: nothing changed). A frame with ``n`` of 0 or above ``MAX_PAGES`` closes the
connection. The socket is 0660 like the gRPC one; capabilities are never logged. At most
``max_conns`` connections are open at once (the session socket's share of the descriptor limit,
``MAX_CONNS`` at most), so no client can make the daemon run out of descriptors. At the cap a
new connection takes the place of one that never sent a valid capability (the oldest), else
of the least recently used one of the tenant holding the most: idle connections, or one
tenant's many, can't keep another tenant's engine off the lane (a closed connection's engine
falls back to gRPC and reconnects). A connection is dropped at once, unsent replies and all,
when it makes room, or when its client leaves replies unread for ``DRAIN_S``. The lane takes
no descriptors (``server/handed.py``).
An OK answer is counted in the RPC metrics as the method it stands for (``Acquire``/``Release``,
code OK); "use gRPC" is not (the gRPC call that follows is), nor is "denied" (the client falls
back to gRPC, which reports the error).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.types import PoolId

from .handed import refuse_rights

log = logging.getLogger(__name__)
REQUEST = struct.Struct("<BHQ16s")
REPLY = struct.Struct("<BH")
ACQUIRE, RELEASE = 1, 2
OK, USE_GRPC, DENIED = 0, 1, 2
MAX_PAGES = 4096
MAX_CONNS = 1024
DRAIN_S = 5.0  # a client that leaves its replies unread this long is hung up on
_METHODS = {ACQUIRE: "Acquire", RELEASE: "Release"}


@dataclass(slots=True, eq=False)
class _Conn:
    writer: asyncio.StreamWriter
    tenant: str | None = None  # whose valid capability it sent first (None: none yet)
    last: float = field(default_factory=time.monotonic)  # opened, or its last answered frame


class FastLane:
    """Capabilities per pool, and the asyncio server that checks them."""

    def __init__(self, engine: Any, path: str,
                 observe: Callable[[str, str, float], None] | None = None,
                 max_conns: int = MAX_CONNS) -> None:
        self._engine = engine
        self.path = path
        self.max_conns = max_conns  # the session socket's share of the descriptor limit
        self._observe = observe
        self._grants: dict[int, tuple[str, bytes]] = {}
        self._server: asyncio.AbstractServer | None = None
        self._conns: dict[asyncio.StreamWriter, _Conn] = {}

    def grant(self, pool_id: int, tenant: str) -> bytes:
        capability = secrets.token_bytes(16)
        self._grants[pool_id] = (tenant, capability)
        return capability

    def revoke(self, pool_id: int) -> None:
        self._grants.pop(pool_id, None)

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)  # stale socket of a crashed daemon
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        # The lane takes no descriptors: one passed along with a frame was released by the
        # kernel in the loop's own read, where its last close could block (``handed.py``).
        refuse_rights(listener)
        os.chmod(self.path, 0o660)
        self._server = await asyncio.start_unix_server(self._serve, sock=listener)

    async def stop(self) -> None:
        for writer in list(self._conns):  # engines fall back to gRPC (and see the drain)
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        if os.path.exists(self.path):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._conns) >= self.max_conns:
            self._make_room()
        conn = self._conns[writer] = _Conn(writer)
        try:
            while True:
                op, n, pool_id, capability = REQUEST.unpack(await reader.readexactly(REQUEST.size))
                if not 0 < n <= MAX_PAGES:
                    return
                # Ids as int64 without a Python int each (one >= 2**63 reads negative: the
                # engine's check refuses it, and the engine is told to use gRPC).
                ids = np.frombuffer(await reader.readexactly(8 * n), dtype="<i8")
                if writer.is_closing():  # dropped to make room: frames it had sent go unread
                    return
                start = time.perf_counter()
                reply = self.answer(op, pool_id, capability, ids)
                grant = self._grants.get(pool_id) if reply[0] != DENIED else None
                if grant is not None:  # a valid capability: whose connection this is
                    conn.tenant, conn.last = conn.tenant or grant[0], time.monotonic()
                if reply[0] == OK and self._observe is not None:
                    self._observe(_METHODS[op], "OK", time.perf_counter() - start)
                writer.write(reply)
                await asyncio.wait_for(writer.drain(), DRAIN_S)
        except TimeoutError:  # it does not read its replies: nothing of it is kept
            writer.transport.abort()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            return  # the engine hung up, or the daemon is stopping
        except Exception:
            log.exception("fast lane connection failed")
        finally:
            self._conns.pop(writer, None)
            writer.close()

    def _make_room(self) -> None:
        """Close one connection for a new one (see the module docstring)."""
        conns = list(self._conns.values())
        idle = [c for c in conns if c.tenant is None]
        if not idle:
            heavy, _ = Counter(c.tenant for c in conns).most_common(1)[0]
            idle = [c for c in conns if c.tenant == heavy]
        victim = min(idle, key=lambda c: c.last)
        del self._conns[victim.writer]
        # At once, unsent replies and all: a close waits to send them, and a client that does
        # not read kept its descriptor and buffers while no longer counted against the cap.
        victim.writer.transport.abort()

    def answer(self, op: int, pool_id: int, capability: bytes, ids: np.ndarray) -> bytes:
        grant = self._grants.get(pool_id)
        if grant is None or not hmac.compare_digest(grant[1], capability):
            return REPLY.pack(DENIED, 0)
        tenant, pages = grant[0], ids
        if op == ACQUIRE:
            slots = self._engine.try_acquire(tenant, PoolId(pool_id), pages)
            if slots is not None:
                return REPLY.pack(OK, len(slots)) + struct.pack(f"<{len(slots)}I", *slots)
        elif op == RELEASE and self._engine.try_release(tenant, PoolId(pool_id), pages):
            return REPLY.pack(OK, 0)
        return REPLY.pack(USE_GRPC, 0)


def lane_path(addrs: list[str]) -> str | None:
    """Beside the first unix listener; ``None`` without one (TCP-only daemons have no lane)."""
    for addr in addrs:
        if addr.startswith("unix://"):
            return addr[len("unix://"):] + ".fast"
    return None
