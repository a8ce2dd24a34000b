"""The Redis keyed medium against a server that answers with the wrong reply types: what a
misbehaving or impersonating server gets is misses and counted faults, never an exception."""

from __future__ import annotations

import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.tiers.redis_medium import RedisMedium

HELLO = (b"%3\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.0.0\r\n"
         b"$5\r\nproto\r\n:3\r\n")
CLUSTER_OFF = b"# Cluster\r\ncluster_enabled:0\r\n"


def _command(rfile: socketserver.StreamRequestHandler) -> list[bytes] | None:
    line = rfile.rfile.readline()
    if not line.startswith(b"*"):
        return None
    parts = []
    for _ in range(int(line[1:])):
        size = int(rfile.rfile.readline()[1:])
        parts.append(rfile.rfile.read(size + 2)[:-2])
    return parts


class _WrongTypes(socketserver.StreamRequestHandler):
    """Connects like Redis, then answers EXISTS with a status and GETRANGE with an integer."""

    def handle(self) -> None:
        while (cmd := _command(self)) is not None:
            name = cmd[0].upper()
            if name == b"HELLO":
                reply = HELLO
            elif name == b"INFO":
                reply = b"$%d\r\n%s\r\n" % (len(CLUSTER_OFF), CLUSTER_OFF)
            elif name == b"PING":
                reply = b"+PONG\r\n"
            elif name == b"EXISTS":
                reply = b"+OK\r\n"
            elif name == b"GETRANGE":
                reply = b":7\r\n"
            else:
                reply = b"+OK\r\n"
            self.wfile.write(reply)
            self.wfile.flush()


@pytest.fixture
def wrong_types() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _WrongTypes)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"redis://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_wrong_reply_type_is_a_miss_and_a_counted_fault(wrong_types: str) -> None:
    """A multi-key EXISTS answered with a status (+OK) made ``int()`` raise outside the
    medium's fault handling: every Lookup of 2 or more keys failed with INTERNAL."""
    m = RedisMedium(wrong_types, password=None, timeout_s=0.5, retry_after_s=0.2)
    try:
        deadline = time.monotonic() + 5
        while not m.health().reachable:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert m.contains_many([b"kvtier:a", b"kvtier:b"]) == [False, False]
        health = m.health()  # down (kvtier_remote_up 0): it read as up while every call failed
        assert health.errors.get("protocol", 0) >= 1 and not health.reachable
    finally:
        m.close()
